"""FP8 block-scaled releases (e4m3 `*.weight` + float32 `*.weight_scale_inv` per 128 x 128 block): dequantised on
the device to the compute dtype, bit-identical to a numpy dequantisation, ragged edge blocks included."""

import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding

import glm_dsa
from checkpoints import CheckpointError, load_hf_params
from checkpoints.fp8_blocks import E4M3, is_fp8_weight_key, quantize_blocks, write_fp8_release
from checkpoints.layout import param_specs
from checkpoints.loader import HFCheckpoint, dequantize_blocks_np
from checkpoints.random import write_random_checkpoint
from sharding import ParallelConfig, make_mesh, param_spec

# widths 200, 136, 160 are not multiples of 128: every weight has ragged edge blocks, some in both axes
CFG = glm_dsa.configs.tiny.replace(num_hidden_layers=2, indexer_types=("full", "shared"), hidden_size=200,
                                   q_lora_rank=136, intermediate_size=136, moe_intermediate_size=40)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    write_random_checkpoint(CFG, root / "hf", seed=3, dtype="float32", progress=False)
    write_fp8_release(root / "hf", root / "fp8", max_shard_bytes=200_000)  # sharded files + index
    return root / "fp8"


def _numpy_reference(path, cfg) -> dict[str, np.ndarray]:
    """Every parameter dequantised on the host with numpy (float32), then laid out by the layout's from_hf."""
    ck = HFCheckpoint(path)

    def host(key):
        raw = np.asarray(ck.raw(key))
        if key + "_scale_inv" in ck:
            return dequantize_blocks_np(raw, np.asarray(ck.raw(key + "_scale_inv")))
        return raw.astype(np.float32)

    return {p: np.asarray(s.from_hf(*(host(k) for k in s.hf_keys)), np.float32) for p, s in param_specs(cfg).items()}


def test_quantize_blocks_ragged_edges():
    w = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)
    w[256:, 128:] = 0  # an all-zero edge block gets scale 1, not 0 / NaN
    w8, s = quantize_blocks(w)
    assert w8.dtype == E4M3 and s.shape == (3, 2) and s.dtype == np.float32 and s[2, 1] == 1.0
    back = dequantize_blocks_np(w8, s)
    assert back.shape == w.shape
    np.testing.assert_allclose(back, w, rtol=2 ** -3, atol=s.max() * 2 ** -9)  # 3 mantissa bits; subnormals
    assert np.abs(np.asarray(w8, np.float32)).max() <= 448


def test_release_layout(fp8_dir):
    ck = HFCheckpoint(fp8_dir)
    key = "model.layers.0.self_attn.q_a_proj.weight"  # [136, 200] -> 2 x 2 blocks, ragged in both axes
    assert ck.dtype(key) == E4M3 and ck.shape(key + "_scale_inv") == (2, 2)
    assert ck.dtype("model.embed_tokens.weight") == np.float32 and not is_fp8_weight_key("lm_head.weight")
    assert sum(k.endswith("_scale_inv") for k in ck.keys()) > 20


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_matches_numpy_dequantisation_on_a_mesh(fp8_dir, dtype):
    """Device dequantisation + layout == numpy dequantisation + layout, bit for bit, placed by the partition table."""
    par = ParallelConfig(4, 2, dcp_q_replicate=True)
    mesh = make_mesh(par)
    got = load_hf_params(fp8_dir, CFG, dtype=dtype, progress=False, quantization="none",
                         sharding_for=lambda p, s: NamedSharding(mesh, param_spec(p, par.q_replicate)))
    want = _numpy_reference(fp8_dir, CFG)
    specs = param_specs(CFG)
    assert got.keys() == want.keys()
    for p, a in got.items():
        target = np.float32 if specs[p].fp32 else dtype
        assert a.dtype == target, p
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, param_spec(p, True)), a.ndim), p
        np.testing.assert_array_equal(np.asarray(a), want[p].astype(target), err_msg=p)


def test_glm_dsa_load_takes_an_fp8_release(fp8_dir):
    """glm_dsa.load(quantization="none") on the FP8 directory holds the numpy-dequantised parameters (so the logits
    of that model)."""
    eng = glm_dsa.load(fp8_dir, parallel=ParallelConfig(2, 2), dtype="float32", max_model_len=32, progress=False,
                       quantization="none")
    want = _numpy_reference(fp8_dir, CFG)
    for p, a in want.items():
        node = eng.params
        for part in p.split("."):
            node = node[int(part) if part.isdigit() else part]
        np.testing.assert_array_equal(np.asarray(node), a, err_msg=p)


def test_errors_name_the_tensor(tmp_path, rewrite_checkpoint):
    cfg = CFG.replace(num_hidden_layers=1, indexer_types=("full",))
    write_random_checkpoint(cfg, tmp_path / "hf", dtype="float32", progress=False)
    write_fp8_release(tmp_path / "hf", tmp_path / "fp8")
    key = "model.layers.0.self_attn.q_a_proj.weight"

    def drop_scale(t):
        del t[key + "_scale_inv"]
        return t

    rewrite_checkpoint(tmp_path / "fp8", tmp_path / "noscale", drop_scale)
    with pytest.raises(CheckpointError, match=rf"'{key}'.*float8_e4m3fn.*no '{key}_scale_inv'"):
        load_hf_params(tmp_path / "noscale", cfg, dtype=np.float32, progress=False)

    def bad_grid(t):
        t[key + "_scale_inv"] = np.ones((1, 2), np.float32)
        return t

    rewrite_checkpoint(tmp_path / "fp8", tmp_path / "badgrid", bad_grid)
    with pytest.raises(CheckpointError, match=rf"'{key}_scale_inv'.*\[1, 2\], expected \[2, 2\]"):
        load_hf_params(tmp_path / "badgrid", cfg, dtype=np.float32, progress=False)


def _float64_reference(path, cfg, specs, dtype) -> dict[str, np.ndarray]:
    """Every parameter dequantised on the host in float64 (`w * scale` is exact there: 4 significant bits times
    24), rounded once to float32 as the device's float32 product is, then cast to the parameter's dtype."""
    ck = HFCheckpoint(path)

    def host(key):
        raw = np.asarray(ck.raw(key))
        if raw.dtype == np.uint8:
            raw = raw.view(E4M3)
        out = raw.astype(np.float64)
        if key + "_scale_inv" in ck:
            scale = np.asarray(ck.raw(key + "_scale_inv"), np.float64)
            rows, cols = np.indices(out.shape)
            out = out * scale[rows // 128, cols // 128]
        return out

    return {p: np.asarray(s.from_hf(*(host(k) for k in s.hf_keys))).astype(np.float32)
            .astype(np.float32 if s.fp32 else dtype) for p, s in specs.items()}


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_each_device_is_sent_only_its_shard(fp8_dir, monkeypatch, dtype):
    """On 8 devices, every upload of FP8 bytes carries one device's shard at most (never the whole parameter on
    device 0), one upload per device, and the values are the float64 dequantisation, including TP slices that
    do not start on a 128-row block (kv_b_proj: 40-row heads, the 4th slice spans HF rows 120..160)."""
    import jax
    from jax.sharding import Mesh, PartitionSpec

    # all 8 devices: heads over 'tp' (4 heads), MLP and expert widths over both axes (the partition table's
    # placement with query replication, except o_proj's heads, which cannot split 8 ways here)
    assert jax.device_count() >= 8
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("tp", "dcp"))

    def placement(p):
        return PartitionSpec("tp", None, None) if p.endswith("o_proj") else param_spec(p, True)

    specs = param_specs(CFG)
    current, puts = [None], []
    real_put = jax.device_put

    def spy(x, device=None, *args, **kwargs):
        leaves = [a for a in jax.tree.leaves(x) if isinstance(a, np.ndarray)]
        puts.append((current[0], device, [(a.dtype, a.shape) for a in leaves]))
        return real_put(x, device, *args, **kwargs)

    def sharding_for(p, shape):
        current[0] = p
        return NamedSharding(mesh, placement(p))

    monkeypatch.setattr(jax, "device_put", spy)
    got = load_hf_params(fp8_dir, CFG, dtype=dtype, progress=False, sharding_for=sharding_for, quantization="none")
    monkeypatch.undo()

    ck = HFCheckpoint(fp8_dir)
    scaled = [p for p, s in specs.items() if any(ck.is_block_scaled(k) for k in s.hf_keys)]
    assert {"layers.0.attn.kv_b_proj", "layers.1.moe.experts_gate", "layers.0.mlp.down"} <= set(scaled)
    for p in scaled:
        sharding = NamedSharding(mesh, placement(p))
        shard_values = int(np.prod(sharding.shard_shape(specs[p].shape)))
        mine = [(dev, leaves) for who, dev, leaves in puts if who == p]
        sent = [sum(int(np.prod(s)) for dt, s in leaves if dt == E4M3) for _, leaves in mine]
        assert max(sent) <= shard_values, (p, mine, shard_values)  # never more than one shard in one upload
        assert sent == [shard_values] * len(sharding.addressable_devices), (p, sent)  # each device: its shard
        assert sorted(getattr(d, "id", -1) for d, _ in mine) == sorted(d.id for d in sharding.addressable_devices), p
    kv = got["layers.0.attn.kv_b_proj"]  # [Rkv, H=4, 40] over tp=4: HF rows 0, 40, 80, 120 start each slice
    assert {s.index[1].start * 40 for s in kv.addressable_shards} == {0, 40, 80, 120}

    want = _float64_reference(fp8_dir, CFG, specs, dtype)
    for p, a in got.items():
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, placement(p)), a.ndim), p
        for shard in a.addressable_shards:  # each device's own data, not a gathered copy
            np.testing.assert_array_equal(np.asarray(shard.data), want[p][shard.index], err_msg=p)


def test_uint8_fp8_bytes_with_scales_load_as_e4m3(tmp_path, rewrite_checkpoint):
    """e4m3 bytes stored as uint8 (with their scales) load as the e4m3 weights; without scales they are refused."""
    cfg = CFG.replace(num_hidden_layers=1, indexer_types=("full",))
    write_random_checkpoint(cfg, tmp_path / "hf", dtype="float32", progress=False)
    write_fp8_release(tmp_path / "hf", tmp_path / "fp8")
    key = "model.layers.0.self_attn.kv_b_proj.weight"

    def as_bytes(t):
        t[key] = t[key].view(np.uint8)
        return t

    rewrite_checkpoint(tmp_path / "fp8", tmp_path / "u8", as_bytes)
    assert HFCheckpoint(tmp_path / "u8").dtype(key) == np.uint8
    got = load_hf_params(tmp_path / "u8", cfg, dtype=np.float32, progress=False, quantization="none")
    want = _float64_reference(tmp_path / "fp8", cfg, param_specs(cfg), np.float32)
    np.testing.assert_array_equal(np.asarray(got["layers.0.attn.kv_b_proj"]), want["layers.0.attn.kv_b_proj"])
    np.testing.assert_array_equal(HFCheckpoint(tmp_path / "u8").read(key), HFCheckpoint(tmp_path / "fp8").read(key))

    def drop_scale(t):
        del t[key + "_scale_inv"]
        return t

    rewrite_checkpoint(tmp_path / "u8", tmp_path / "u8noscale", drop_scale)
    with pytest.raises(CheckpointError, match=rf"'{key}'.*has dtype uint8.*floating point"):
        load_hf_params(tmp_path / "u8noscale", cfg, dtype=np.float32, progress=False)
