"""FP8 weights kept FP8 on the devices (docs/math.md §11, checkpoints.quantization): an FP8 release with dims that are
not multiples of 128 loads as float8 leaves with their scale grids, the model computes from them under every
TP / DCP layout (QREP too) and gives the logits of the dequantised model; quantization "fp8" quantises a float
checkpoint at load exactly as the numpy block quantiser does; "none" dequantises; the scale grids are sharded
with their weights on 128 boundaries and replicated otherwise; bad scales and layouts that do not fit are refused
by name, before anything is allocated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import glm_dsa
from checkpoints import CheckpointError
from checkpoints.fp8_blocks import write_fp8_release
from checkpoints.fp8_blocks import quantize_blocks
from checkpoints.loader import HFCheckpoint
from checkpoints.random import write_random_checkpoint
from sharding import TP, TP_AXES, ParallelConfig, fp8_scale_spec

# hidden 200, q_lora 136, dense 136, experts 40: every weight has ragged 128-blocks, and no TP shard of them falls on
# a block boundary (the replicated-grid path with traced offsets)
CFG = glm_dsa.configs.tiny.replace(num_hidden_layers=2, indexer_types=("full", "shared"), hidden_size=200,
                                   q_lora_rank=136, intermediate_size=136, moe_intermediate_size=40)
IDS = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 9))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8w")
    write_random_checkpoint(CFG, root / "hf", seed=3, dtype="float32", progress=False)
    write_fp8_release(root / "hf", root / "fp8")
    return root


def _leaf(params, path):
    node = params
    for part in path.split("."):
        node = node[int(part) if part.isdigit() else part]
    return node


@pytest.mark.parametrize("par", [ParallelConfig(1, 1), ParallelConfig(2, 1), ParallelConfig(4, 2),
                                 ParallelConfig(4, 4, dcp_q_replicate=True)], ids=str)
def test_release_stays_fp8_and_gives_the_dequantised_logits(dirs, par):
    ref = glm_dsa.load(dirs / "fp8", parallel=par, dtype="float32", quantization="none", progress=False,
                       max_model_len=32)
    eng = glm_dsa.load(dirs / "fp8", parallel=par, dtype="float32", progress=False, max_model_len=32)
    leaves = jax.tree_util.tree_leaves(eng.params)
    fp8 = sum(x.nbytes for x in leaves if x.dtype == jnp.float8_e4m3fn)
    assert fp8 > 0.5 * sum(x.nbytes for x in leaves)  # most parameter bytes (the rest: embed, lm_head, router)
    assert not any(x.dtype == jnp.float8_e4m3fn for x in jax.tree_util.tree_leaves(ref.params))
    w = _leaf(eng.params, "layers.0.attn.q_b_proj")
    assert w.dtype == jnp.float8_e4m3fn and w.shape[:2] == (136, CFG.num_attention_heads)
    assert _leaf(eng.params, "layers.0.attn.q_b_proj_scale").shape == (2, -(-w.shape[1] * w.shape[2] // 128))
    assert _leaf(eng.params, "layers.0.attn.kv_b_proj").dtype == jnp.float32  # dequantised at load (absorbed)
    assert _leaf(eng.params, "embed").dtype == jnp.float32
    # the xla impl computes from the same quantised values in float32: equal to float32 rounding
    np.testing.assert_allclose(eng.logits(IDS), ref.logits(IDS), atol=2e-5, rtol=0)


def test_quantization_fp8_at_load_matches_the_numpy_block_quantiser(dirs):
    eng = glm_dsa.load(dirs / "hf", dtype="float32", quantization="fp8", progress=False, max_model_len=32)
    ck = HFCheckpoint(dirs / "hf")
    q, s = quantize_blocks(ck.read("model.layers.1.mlp.experts.3.down_proj.weight"))  # HF [out, in]
    got = _leaf(eng.params, "layers.1.moe.experts_down")  # kept FP8: K-major, the release's [E, out, in]
    np.testing.assert_array_equal(np.asarray(got[3]).view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(_leaf(eng.params, "layers.1.moe.experts_down_scale")[3]), s)
    q, s = quantize_blocks(ck.read("model.layers.1.self_attn.o_proj.weight"))  # HF [out, in]
    got = np.asarray(_leaf(eng.params, "layers.1.attn.o_proj")).reshape(-1, q.shape[0])  # ours [in, out]
    np.testing.assert_array_equal(got.view(np.uint8), q.T.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(_leaf(eng.params, "layers.1.attn.o_proj_scale")), s.T)
    ref = glm_dsa.load(dirs / "hf", dtype="float32", progress=False, max_model_len=32).logits(IDS)
    err = np.linalg.norm(eng.logits(IDS) - ref) / np.linalg.norm(ref)
    assert 1e-5 < err < 3e-2  # e4m3 weights: close to the float model, not equal to it


def test_scale_grids_shard_on_block_boundaries_only():
    sizes = {TP: 4, "dcp": 2}
    # q_b [Rq, H, D] split on heads over every TP device: 64 heads x 192 = 12288 / 8 = 1536 = 12 blocks each
    assert fp8_scale_spec(P(None, TP_AXES, None), (2048, 64, 192), (0, 1, 2), sizes) == P(None, TP_AXES)
    # 40-wide expert slices of 320 / 8: not whole blocks -> the grid is replicated, ranks slice it
    assert fp8_scale_spec(P(None, None, TP_AXES), (16, 200, 320), (1, 1, 1), sizes) == P(None, None, None)
    # o_proj [H, Dv, D] split on its input (heads): 64 x 256 / 8 = 2048 = 16 blocks
    assert fp8_scale_spec(P(TP_AXES, None, None), (64, 256, 6144), (0, 2, 1), sizes) == P(TP_AXES, None)
    assert fp8_scale_spec(P(), (6144, 2048), (0, 1, 1), sizes) == P(None, None)


def test_bad_quantization_and_a_layout_that_does_not_fit(dirs, monkeypatch):
    with pytest.raises(ValueError, match="quantization must be"):
        glm_dsa.load(dirs / "fp8", quantization="int4", progress=False)
    import checkpoints.loader as loader
    monkeypatch.setattr(loader, "load_hf_params", lambda *a, **k: pytest.fail("loaded despite not fitting"))
    with pytest.raises(ValueError, match=r"weights need .* GiB per device .* 0\.00 GiB free"):
        glm_dsa.load(dirs / "fp8", dtype="float32", device_memory=1000, progress=False)


@pytest.mark.parametrize("bad", [np.nan, 0.0, -1.0, np.inf])
def test_a_bad_block_scale_is_named(dirs, tmp_path, bad, rewrite_checkpoint):
    key = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"

    def edit(t):
        s = t[key].copy()
        s[1, 0] = bad
        return {**t, key: s}
    rewrite_checkpoint(dirs / "fp8", tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=rf"'{key}'.*not finite and positive.*block \[1, 0\]"):
        glm_dsa.load(tmp_path / "bad", progress=False)


def test_a_scale_without_its_weight_is_named(dirs, tmp_path, rewrite_checkpoint):
    key = "model.layers.0.self_attn.q_a_proj.weight"
    rewrite_checkpoint(dirs / "fp8", tmp_path / "orphan", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(CheckpointError, match=rf"'{key}_scale_inv'.*no weight '{key}'"):
        glm_dsa.load(tmp_path / "orphan", progress=False)


def test_an_fp8_release_with_a_nextn_layer_speculates(tmp_path):
    """MTP on an FP8 release: the target stays FP8, the nextn layer is dequantised at load, and greedy decoding
    with two drafts gives the tokens of plain greedy decoding of the same FP8 model."""
    cfg = CFG.replace(num_nextn_predict_layers=1)
    write_random_checkpoint(cfg, tmp_path / "hf", seed=5, dtype="float32", progress=False, with_mtp=True)
    write_fp8_release(tmp_path / "hf", tmp_path / "fp8")
    prompts = [[3, 14, 15, 92, 65], [35, 89]]
    plain = glm_dsa.load(tmp_path / "fp8", dtype="float32", progress=False, max_model_len=32)
    spec = glm_dsa.load(tmp_path / "fp8", dtype="float32", progress=False, max_model_len=32, num_speculative_tokens=2)
    assert _leaf(spec.params, "layers.0.attn.q_a_proj").dtype == jnp.float8_e4m3fn
    assert plain.generate(prompts, 6, stop_token_ids=[]) == spec.generate(prompts, 6, stop_token_ids=[])


def test_load_parses_the_headers_once(dirs, monkeypatch):
    """`glm_dsa.load` opens an HF checkpoint (every safetensors header) once, for the FP8 plan and the read."""
    opened = []
    init = HFCheckpoint.__init__

    def counting(self, path):
        opened.append(path)
        init(self, path)
    monkeypatch.setattr(HFCheckpoint, "__init__", counting)
    eng = glm_dsa.load(dirs / "fp8", dtype="float32", progress=False, max_model_len=32)
    assert len(opened) == 1
    assert any(str(a.dtype) == "float8_e4m3fn" for a in jax.tree_util.tree_leaves(eng.params))


def test_quantization_is_resolved_once_into_one_plan(dirs, monkeypatch):
    """One resolver reads `quantization`: None is the checkpoint's own form ("checkpoint"), which "none" is not,
    and a typo is one ValueError naming the argument and what it takes. `glm_dsa.load` decides the plan once
    (from the headers) and the reader loads exactly the plan's weights FP8."""
    import pickle

    import checkpoints.loader as loader
    from checkpoints.quantization import QuantizationPlan, resolve_quantization
    assert [resolve_quantization(q) for q in (None, "fp8", "none")] == ["checkpoint", "fp8", "none"]
    for bad in ("None", "FP8", "int4", True, 8):
        with pytest.raises(ValueError, match=r"quantization must be None \(the checkpoint's own form\), 'fp8' or "
                                             r"'none', got " + repr(bad)):
            resolve_quantization(bad)
    plan = QuantizationPlan({"a", "b"}, "fp8")
    assert plan == {"a", "b"} and pickle.loads(pickle.dumps(plan)).setting == "fp8"

    decided, plan_of = [], loader.fp8_plan

    def counting(specs, quantization, block_scaled):
        out = plan_of(specs, quantization, block_scaled)
        if not isinstance(quantization, QuantizationPlan):
            decided.append(out)
        return out
    monkeypatch.setattr(loader, "fp8_plan", counting)
    for quantization, setting in ((None, "checkpoint"), ("none", "none")):
        decided.clear()
        eng = glm_dsa.load(dirs / "fp8", dtype="float32", progress=False, max_model_len=32, quantization=quantization)
        assert [p.setting for p in decided] == [setting]  # decided once, read by the loader as it is
        fp8 = {k for k, a in _flat(eng.params).items() if str(a.dtype) == "float8_e4m3fn"}
        assert fp8 == set(decided[0]) and (len(fp8) > 0) == (quantization is None)


def _flat(params) -> dict:
    from glm_dsa.model.param_tree import flatten_params
    return flatten_params(params)
