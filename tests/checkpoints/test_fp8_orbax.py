"""FP8 weights in orbax checkpoints: e4m3 leaves and their float32 '<path>_scale' grids saved and restored as they
are (bytes and shardings), dequantised on restore (quantization "none"), and bf16 weights quantised on restore
(quantization "fp8"), each against a numpy oracle (`fp8_formats.quantize_blocks_np`); random benchmark parameters
use the same quantiser."""

import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import glm_dsa
from checkpoints import CheckpointError, load_hf_params, load_orbax_params, orbax_io, save_orbax_params
from checkpoints.fp8_blocks import write_fp8_release
from checkpoints.fp8_blocks import dequantize_blocks_np, quantize_blocks
from checkpoints.layout import fp8_scale_shape, kept_fp8_spec, param_specs
from checkpoints.loader import HFCheckpoint
from checkpoints.quantization import fp8_eligible, scale_path
from checkpoints.random import write_random_checkpoint
from glm_dsa.model.random_init import init_params
from glm_dsa.model.loading import param_sharding
from glm_dsa.model.placement import leaf_spec
from glm_dsa.model.param_tree import flatten_params
from glm_dsa.model.step import resolve_parallel
from sharding import ParallelConfig

# widths 200 and 136 are not multiples of 128: weights have ragged edge blocks, some in both axes
CFG = glm_dsa.configs.tiny.replace(num_hidden_layers=2, indexer_types=("full", "shared"), hidden_size=200,
                                   q_lora_rank=136, intermediate_size=136, moe_intermediate_size=40)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
SPECS = param_specs(CFG)
# one MoE layer, experts 512 wide: at TP=4 each shard holds one whole 128-block, so their scale grids are split
WIDE = CFG.replace(moe_intermediate_size=512, num_hidden_layers=1, indexer_types=("full",), mlp_layer_types=("sparse",))


def _tp4():
    return resolve_parallel(ParallelConfig(4, 2, dcp_q_replicate=True), CFG)


def _flat2d(a, spec):
    """Our-layout array -> [*lead, IN, OUT] (its fp8_grid's flattened input and output axes)."""
    lead, n_in, _ = spec.fp8_grid
    shape = spec.shape
    return np.asarray(a).reshape(*shape[:lead], int(np.prod(shape[lead:lead + n_in])),
                                 int(np.prod(shape[lead + n_in:])))


def _np_dequantize(q, scale, spec):
    """numpy float32 oracle of one FP8 leaf in its kept form, back in our layout: `dequantize_blocks_np` per HF
    [OUT, IN] matrix (K-major expert stacks are those, stacked) or per [IN, OUT] one (blocks are symmetric)."""
    if spec.fp8_kmajor:
        q, scale = np.asarray(q), np.asarray(scale)
        return np.stack([dequantize_blocks_np(q[e], scale[e]).T for e in range(q.shape[0])])
    q2, s2 = _flat2d(q, spec), np.asarray(scale)
    if spec.fp8_grid[0]:
        return np.stack([dequantize_blocks_np(q2[e], s2[e]) for e in range(q2.shape[0])]).reshape(spec.shape)
    return dequantize_blocks_np(q2, s2).reshape(spec.shape)


def _np_quantize(w, spec):
    """numpy oracle of the kept form: `quantize_blocks` of the HF [OUT, IN] form, transposed back to ours, or for
    K-major expert stacks left as the release's [E, OUT, IN] with its [E, OUT-blocks, IN-blocks] grids."""
    w2 = _flat2d(np.asarray(w, np.float32), spec)
    mats = list(w2) if spec.fp8_grid[0] else [w2]
    out = [quantize_blocks(m.T) for m in mats]
    if spec.fp8_kmajor:
        return np.stack([o[0] for o in out]), np.stack([o[1] for o in out])
    q = [o[0].T for o in out]
    s = [o[1].T for o in out]
    if spec.fp8_grid[0]:
        return np.stack(q).reshape(spec.shape), np.stack(s)
    return q[0].reshape(spec.shape), s[0]


def _spec_of(p, a, cfg, par):
    """leaf_spec of the restored leaf `p` (FP8 weights in their kept form)."""
    return leaf_spec(p, a.shape, cfg, par, kept=a.dtype == E4M3)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8orbax")
    write_random_checkpoint(CFG, root / "hf", seed=5, dtype="float32", progress=False)
    write_fp8_release(root / "hf", root / "fp8")
    return root


@pytest.fixture(scope="module")
def kept(release):
    """The FP8 release loaded in its own form on a TP=4 x DCP=2 (QREP) mesh, and saved to orbax."""
    par = _tp4()
    flat = load_hf_params(release / "fp8", CFG, dtype="bfloat16", progress=False, quantization=None,
                          sharding_for=param_sharding(par, CFG))
    save_orbax_params(flat, CFG, release / "orbax")
    return flat


def test_save_records_fp8_leaves(release, kept):
    meta = orbax_io.read_orbax_metadata(release / "orbax")
    fp8 = {p for p, a in kept.items() if a.dtype == E4M3}
    assert len(fp8) > 10 and "layers.0.attn.kv_b_proj" not in fp8  # kv_b_proj is dequantised at load
    assert meta["dtype"] == "bfloat16"  # FP8 weights, scales and float32 parameters do not count
    q_a = "layers.0.attn.q_a_proj"  # [200, 136] -> 2 x 2 blocks
    assert meta["params"][q_a] == {"shape": [200, 136], "dtype": "float8_e4m3fn"}
    assert meta["params"][scale_path(q_a)] == {"shape": [2, 2], "dtype": "float32"}
    assert set(meta["params"]) == set(kept)
    assert orbax_io.stored_fp8_plan(release / "orbax", None, CFG) == fp8
    assert orbax_io.stored_fp8_plan(release / "orbax", None) == fp8
    assert orbax_io.stored_fp8_plan(release / "orbax", "none", CFG) == frozenset()
    assert orbax_io.stored_fp8_plan(release / "orbax", "fp8", CFG) == {p for p, s in SPECS.items() if fp8_eligible(s)}
    with pytest.raises(ValueError, match="needs the model config"):
        orbax_io.stored_fp8_plan(release / "orbax", "fp8")


@pytest.mark.parametrize("mesh", ["one device", "tp4"])
def test_fp8_round_trip_bytes_and_shardings(release, kept, mesh):
    par = _tp4() if mesh == "tp4" else None
    got = load_orbax_params(release / "orbax", CFG, dtype="bfloat16", progress=False, quantization=None,
                            sharding_for=param_sharding(par, CFG) if par else None)
    assert got.keys() == kept.keys()
    for p, a in got.items():
        assert a.dtype == kept[p].dtype, p
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(kept[p]).view(np.uint8), err_msg=p)
        if par:
            want = _spec_of(p, a, CFG, par)
            assert a.sharding.spec == want, (p, a.sharding.spec, want)


def test_none_dequantises_to_the_numpy_oracle(release, kept):
    """quantization "none": each FP8 weight == its e4m3 bytes x block scales in float32 (numpy), then cast."""
    par = _tp4()
    for dtype in (np.float32, ml_dtypes.bfloat16):
        got = load_orbax_params(release / "orbax", CFG, dtype=dtype, progress=False, quantization="none",
                                sharding_for=param_sharding(par, CFG))
        assert got.keys() == SPECS.keys()  # no scale leaves left
        n = 0
        for p, a in got.items():
            want_dtype = np.float32 if SPECS[p].fp32 else dtype
            assert a.dtype == want_dtype, p
            if kept[p].dtype == E4M3:
                want = _np_dequantize(kept[p], kept[scale_path(p)], SPECS[p]).astype(want_dtype)
                np.testing.assert_array_equal(np.asarray(a), want, err_msg=p)
                assert a.sharding.spec == leaf_spec(p, a.shape, CFG, par), p
                n += 1
        assert n > 10
    # the float32 dequantisation is that of the HF release itself (numpy, from the safetensors bytes)
    ck, q_a = HFCheckpoint(release / "fp8"), "model.layers.0.self_attn.q_a_proj.weight"
    hf = dequantize_blocks_np(np.asarray(ck.raw(q_a)), np.asarray(ck.raw(q_a + "_scale_inv")))
    f32 = load_orbax_params(release / "orbax", CFG, dtype=np.float32, progress=False, quantization="none")
    np.testing.assert_array_equal(np.asarray(f32["layers.0.attn.q_a_proj"]), hf.T)


def test_fp8_quantises_a_bf16_checkpoint(tmp_path):
    """quantization "fp8" on a bf16 orbax checkpoint: the bytes and scales of numpy `quantize_blocks` (transposed),
    on the mesh as leaf_spec says; weights without an FP8 form (and kv_b_proj) stay bf16."""
    rng = np.random.default_rng(7)
    flat = {}
    for p, s in SPECS.items():
        w = rng.standard_normal(s.shape, dtype=np.float32) * rng.uniform(0.01, 3.0)
        flat[p] = w if s.fp32 else w.astype(ml_dtypes.bfloat16)
    flat["layers.0.attn.q_a_proj"][:128, :] = 0  # all-zero blocks: scale 1.0
    save_orbax_params(flat, CFG, tmp_path)
    par = _tp4()
    got = load_orbax_params(tmp_path, CFG, dtype="bfloat16", progress=False, quantization="fp8",
                            sharding_for=param_sharding(par, CFG))
    plan = {p for p, s in SPECS.items() if fp8_eligible(s)}
    assert set(got) == set(SPECS) | {scale_path(p) for p in plan}
    for p, spec in SPECS.items():
        if p in plan:
            q, s = _np_quantize(flat[p], spec)
            assert got[p].dtype == E4M3 and got[scale_path(p)].shape == fp8_scale_shape(kept_fp8_spec(spec)), p
            np.testing.assert_array_equal(np.asarray(got[p]).view(np.uint8), q.view(np.uint8), err_msg=p)
            np.testing.assert_array_equal(np.asarray(got[scale_path(p)]), s, err_msg=p)
            for leaf in (p, scale_path(p)):
                assert got[leaf].sharding.spec == _spec_of(leaf, got[leaf], CFG, par), leaf
        else:
            np.testing.assert_array_equal(np.asarray(got[p]), flat[p], err_msg=p)
    assert np.all(np.asarray(got[scale_path("layers.0.attn.q_a_proj")])[0] == 1.0)


def test_init_params_fp8_is_the_bf16_draw_quantised(tmp_path):
    """Random benchmark parameters with quantization "fp8": the bf16 draw of the same seed, quantised (numpy),
    with TP-split scale grids; an orbax round trip onto another mesh keeps their bytes, placed by leaf_spec."""
    par, specs = resolve_parallel(ParallelConfig(4, 2, dcp_q_replicate=True), WIDE), param_specs(WIDE)
    bf16 = flatten_params(init_params(WIDE, seed=3, dtype="bfloat16", parallel=par))
    fp8 = flatten_params(init_params(WIDE, seed=3, dtype="bfloat16", parallel=par, quantization="fp8"))
    for p in ("layers.0.attn.q_a_proj", "layers.0.moe.experts_down", "layers.0.moe.experts_up", "layers.0.attn.o_proj"):
        q, s = _np_quantize(np.asarray(bf16[p]), specs[p])
        np.testing.assert_array_equal(np.asarray(fp8[p]).view(np.uint8), q.view(np.uint8), err_msg=p)
        np.testing.assert_array_equal(np.asarray(fp8[scale_path(p)]), s, err_msg=p)
        assert fp8[scale_path(p)].sharding.spec == leaf_spec(scale_path(p), s.shape, WIDE, par)
    assert fp8["layers.0.attn.kv_b_proj"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert scale_path("embed") not in fp8
    up = fp8["layers.0.moe.experts_up"]  # K-major [8, 512, 200]: the expert width split over TP on axis 1
    assert up.shape == (8, 512, 200) and up.sharding.spec == PartitionSpec(None, ("tp", "dcp"), None)
    split = fp8[scale_path("layers.0.moe.experts_up")]  # [8, 4, 2]: one out-block per TP shard
    assert split.sharding.spec == PartitionSpec(None, ("tp", "dcp"), None)
    assert split.addressable_shards[0].data.shape == (8, 1, 2)
    save_orbax_params(fp8, WIDE, tmp_path)
    other = resolve_parallel(ParallelConfig(2), WIDE)
    got = load_orbax_params(tmp_path, WIDE, dtype="bfloat16", progress=False, sharding_for=param_sharding(other, WIDE))
    assert got.keys() == fp8.keys()
    for p, a in got.items():
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(fp8[p]).view(np.uint8), err_msg=p)
        assert a.sharding.spec == _spec_of(p, a, WIDE, other), p


def test_bad_fp8_leaves_are_named(release, kept, tmp_path):
    q_a = "layers.0.attn.q_a_proj"
    no_scale = {p: a for p, a in kept.items() if p != scale_path(q_a)}
    with pytest.raises(CheckpointError, match=rf"missing parameters \['{q_a}_scale'\]"):
        save_orbax_params(no_scale, CFG, tmp_path / "a")
    stray = {p: np.asarray(a) for p, a in kept.items()}
    stray["lm_head_scale"] = np.ones((2, 2), np.float32)  # a scale without an FP8 weight
    with pytest.raises(CheckpointError, match="unknown parameters \\['lm_head_scale'\\]"):
        save_orbax_params(stray, CFG, tmp_path / "b")
    embed = dict(kept, embed=np.zeros(SPECS["embed"].shape, E4M3))  # no FP8 form
    with pytest.raises(CheckpointError, match="'embed' is float8_e4m3fn but is not a linear weight"):
        save_orbax_params(embed, CFG, tmp_path / "c")
    half = dict(kept, **{scale_path(q_a): np.ones((2, 2), np.float16)})
    with pytest.raises(CheckpointError, match=f"'{q_a}_scale'.*float32, got float16"):
        save_orbax_params(half, CFG, tmp_path / "d")


def test_format_version_1_fp8_experts_are_refused(release, kept, tmp_path):
    """Version 1 stored FP8 expert stacks [E, in, out]: such a checkpoint is refused with the way out (convert
    again), before any restore; a version 1 checkpoint without FP8 experts reads as version 2 does."""
    import json
    import shutil

    def as_version_1(src, dst):
        shutil.copytree(src, dst)
        meta_file = orbax_io.committed_checkpoint(dst) + "/" + orbax_io.META
        meta = json.load(open(meta_file))
        meta["version"] = 1
        json.dump(meta, open(meta_file, "w"))

    as_version_1(release / "orbax", tmp_path / "old")
    with pytest.raises(CheckpointError, match=r"version 1 stores FP8 expert stacks.*'layers\.\d\.moe\.experts_"
                                              r"\w+'.*convert the HF checkpoint again"):
        load_orbax_params(tmp_path / "old", CFG, dtype="bfloat16", progress=False)
    bf16 = {p: np.asarray(a) for p, a in load_hf_params(release / "hf", CFG, dtype="bfloat16", progress=False,
                                                        quantization="none").items()}
    save_orbax_params(bf16, CFG, tmp_path / "bf16")
    as_version_1(tmp_path / "bf16", tmp_path / "old_bf16")
    got = load_orbax_params(tmp_path / "old_bf16", CFG, dtype="bfloat16", progress=False)
    np.testing.assert_array_equal(np.asarray(got["layers.1.moe.experts_up"]), bf16["layers.1.moe.experts_up"])


def test_a_sharding_callback_of_our_layout_places_k_major_experts(release, kept):
    """A `sharding_for(path, shape)` that knows only our [in, out] layout (no `kept`) still places the K-major
    expert stacks: its spec for our layout, last two axes swapped; the bytes are those of the orbax round trip."""
    from jax.sharding import NamedSharding

    from sharding import make_mesh, param_spec

    par = _tp4()
    mesh = make_mesh(par)

    def ours(p, shape):  # the partition table for our layout; scale grids replicated
        return NamedSharding(mesh, PartitionSpec() if p.endswith("_scale") else param_spec(p, par.q_replicate))
    for load, src in ((load_orbax_params, release / "orbax"), (load_hf_params, release / "fp8")):
        got = load(src, CFG, dtype="bfloat16", progress=False, sharding_for=ours)
        up = "layers.1.moe.experts_up"
        assert got[up].dtype == E4M3 and got[up].sharding.spec == PartitionSpec(None, ("tp", "dcp"), None)
        for p, a in got.items():
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(kept[p]).view(np.uint8),
                                          err_msg=p)
