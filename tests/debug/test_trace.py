"""Traces and their diff: DCP partials merge to the DCP=1 values, and an injected field defect is located
at its source (layer 0's attention), not downstream."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm_dsa
import kernels.fused_norm_rope as fnr
from checkpoints.random import write_random_checkpoint
from glm_dsa.cli import main
from glm_dsa.model.step import prefill_inputs
from glm_dsa.debug.trace import diff_traces, load_trace, traced_step
from kernels.lse_merge import merge_partials
from sharding import ParallelConfig

CFG = glm_dsa.configs.tiny


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace_tiny")
    write_random_checkpoint(CFG, path, seed=3, dtype="float32", progress=False)
    return path


PROMPT = np.random.default_rng(5).integers(0, CFG.vocab_size, 19).tolist()


def _trace(ckpt, parallel=None):
    return glm_dsa.load(ckpt, dtype="float32", max_model_len=64, progress=False, parallel=parallel).trace(PROMPT)


@pytest.fixture(scope="module")
def single(ckpt):
    return _trace(ckpt)


def test_dcp_trace_partials_merge_to_single_device(ckpt, single):
    t = _trace(ckpt, ParallelConfig(4, 4, cp_kv_cache_interleave_size=2))
    assert t["layers.0.dcp.partial_o"].shape == (4, 19, CFG.num_attention_heads, CFG.kv_lora_rank)
    o, lse = merge_partials(jnp.asarray(t["layers.1.dcp.partial_o"]), jnp.asarray(t["layers.1.dcp.partial_lse"]))
    np.testing.assert_allclose(np.asarray(o), t["layers.1.dcp.merged_o"], atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), t["layers.1.dcp.merged_lse"], atol=1e-6)
    assert np.isneginf(t["layers.0.dcp.partial_lse"][3, 0]).all()  # token 0 lives on rank 0 only
    rows, first = diff_traces(t, single, rtol=1e-4, atol=1e-5)
    assert first is None and len(rows) == len(single)


@pytest.mark.parametrize("par", [ParallelConfig(), ParallelConfig(4, 4, cp_kv_cache_interleave_size=2)],
                         ids=["single", "tp4-dcp4-I2"])
def test_tracing_does_not_change_logits_or_caches(ckpt, single, par):
    """The active tracer only gathers what the step computes: the traced step's logits and caches are the
    untraced step's, bit for bit, and its records are those `Engine.trace` returns."""
    eng = glm_dsa.load(ckpt, dtype="float32", max_model_len=64, progress=False, parallel=par)
    caches, batch = prefill_inputs(eng.params, np.asarray([PROMPT]), config=CFG, parallel=eng.parallel,
                                   block_size=eng.block_size)
    logits, new_caches = jax.jit(functools.partial(glm_dsa.step, config=CFG, parallel=par))(eng.params, caches, batch)
    t_logits, t_caches, records = jax.jit(functools.partial(traced_step, config=CFG, parallel=par))(
        eng.params, caches, batch)
    np.testing.assert_array_equal(np.asarray(t_logits), np.asarray(logits))
    chex.assert_trees_all_equal(t_caches, new_caches)  # the same tree, every leaf equal (a diff names its path)
    dcp_names = {f"layers.{i}.dcp.{k}_{v}" for i in range(CFG.num_hidden_layers) for k in ("partial", "merged")
                 for v in ("o", "lse")}
    assert set(records) == set(single) | (dcp_names if par.dcp > 1 else set())
    if par.dcp == 1:  # the same computation as `single`'s
        for k, v in records.items():
            np.testing.assert_array_equal(np.asarray(v), single[k], err_msg=k)


def test_diff_names_the_source_of_the_q_norm_defect(ckpt, single, monkeypatch):
    original = fnr.fused_norm_rope_cache

    def defective(q_c, kv_c, positions, slot_mapping, *a, **kw):  # q norm skipped on non-owned rows
        out = original(q_c, kv_c, positions, slot_mapping, *a, **kw)
        return (jnp.where((slot_mapping < 0)[:, None], q_c, out[0]),) + tuple(out[1:])

    monkeypatch.setattr(fnr, "fused_norm_rope_cache", defective)
    _, first = diff_traces(_trace(ckpt, ParallelConfig(4, 4)), single)
    assert first == "layers.0.attn.q_norm"


def test_cli_trace_and_diff(ckpt, single, tmp_path, capsys):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    ids = ",".join(map(str, PROMPT))
    assert main(["trace", "--checkpoint", str(ckpt), "--prompt-ids", ids, "--out", str(a), "--dtype", "float32"]) == 0
    assert main(["trace", "--checkpoint", str(ckpt), "--prompt-ids", ids, "--out", str(b), "--dtype", "float32",
                 "--layers", "1,2"]) == 0
    assert set(load_trace(b)) == {k for k in single if k.split(".")[1] in ("1", "2")}
    capsys.readouterr()
    assert main(["diff", str(a), str(b)]) == 0
    assert "no divergence" in capsys.readouterr().out
    bad = load_trace(b)
    bad["layers.2.residual"] = bad["layers.2.residual"] + 1.0
    from safetensors.numpy import save_file
    save_file(bad, str(b))
    assert main(["diff", str(a), str(b)]) == 1
    assert "first divergence: layers.2.residual" in capsys.readouterr().out


def test_diff_set_valued_and_infinities():
    a = {"layers.0.attn.topk": np.array([[3, 1, -1]]), "layers.0.dcp.partial_lse": np.array([[-np.inf, 1.0]])}
    b = {"layers.0.attn.topk": np.array([[1, 3, -1, -1]]), "layers.0.dcp.partial_lse": np.array([[-np.inf, 1.0]])}
    rows, first = diff_traces(a, b)
    assert first is None and rows[0].jaccard == 1.0
    b["layers.0.attn.topk"] = np.array([[1, 4, -1, -1]])
    rows, first = diff_traces(a, b)
    assert first == "layers.0.attn.topk" and abs(rows[0].jaccard - 1 / 3) < 1e-9


def test_traced_step_decides_in_the_steps_batch_invariant_mode(ckpt):
    """`traced_step` takes the kernels' choices `step` takes for the same options: in batch-invariant mode those of
    the step's kind (it ran the default mode's rules, so a trace of an invariant step showed other kernels' bits).
    Traced for the GPU on the CPU (abstract evaluation only); the default mode's choices, which differ here, are the
    negative control."""
    from glm_dsa.model.options import StepOptions
    from kernels import registry
    eng = glm_dsa.load(ckpt, dtype="float32", max_model_len=64, progress=False)
    caches, batch = prefill_inputs(eng.params, np.asarray([PROMPT]), config=CFG, parallel=eng.parallel,
                                   block_size=eng.block_size)

    def decisions(fn, options):
        with registry.deciding_for("gpu"), registry.record() as log:
            jax.eval_shape(functools.partial(fn, config=CFG, parallel=eng.parallel, options=options),
                           eng.params, caches, batch)
        return [(d.rule, d.choice, d.step_kind) for d in log]

    invariant = StepOptions(batch_invariant=True, invariant_prompt_rows=64)
    expected = decisions(glm_dsa.step, invariant)
    assert expected and all(kind == "decode" for _, _, kind in expected)  # 19 rows: a decode step of that kind
    assert decisions(traced_step, invariant) == expected
    assert decisions(traced_step, StepOptions()) != expected
