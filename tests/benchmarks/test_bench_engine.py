"""The end-to-end benchmark (`python -m glm_dsa bench`, benchmarks/bench_engine.py) on CPU: speed is measured on
the GPU, never asserted here; what is checked is what it reports and which token ids it feeds the model."""

import datetime
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.bench_engine import decode_attention_bytes, decode_batch, flops_per_token
from glm_dsa import configs
from glm_dsa.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    assert "--decode-batches" in capsys.readouterr().out


def test_small_cpu_run_in_a_subprocess(tmp_path):
    """The CLI from a temporary working directory: a harness record with the nested results, every stage it
    names timed, and the collectives said to be not measured rather than given as 0.0 or nan."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
               JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "glm_dsa", "bench", "--preset", "tiny", "--input-len", "24", "--output-len", "3",
           "--batch", "2", "--decode-batches", "2", "--max-num-batched-tokens", "16", "--json-out", "bench.json"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # nothing else written to the cwd
    res = json.loads((tmp_path / "bench.json").read_text())
    assert {"date", "commit", "device", "command", "rows"} <= set(res)
    datetime.datetime.fromisoformat(res["date"])
    assert res["device"] == "cpu" and res["command"].startswith("python -m glm_dsa bench --preset tiny")
    assert res["roofline"]["known"] is False and "unknown device" in res["roofline"]["name"]
    r = res["impls"]["xla"]
    assert r["prefill_tokens_per_s"] > 0 and r["end_to_end_s"] > 0
    d = r["decode"]["2"]
    assert d["ms_per_step"] > 0
    assert set(d["stages_ms"]) == {"indexer", "sparse_mla", "norms_rope_cache", "moe"}
    assert all(np.isfinite(v) and v > 0 for v in d["stages_ms"].values())
    assert "not measured" in d["stages_not_measured"]["collectives"]
    phases = [(row["impl"], row["phase"], row.get("B")) for row in res["rows"]]
    assert phases == [("xla", "end_to_end", None), ("xla", "decode", 2)]
    assert res["rows"][1]["ms_per_step"] == d["ms_per_step"] and res["rows"][1]["context"] == 24
    assert "decode B=2" in proc.stdout and "collectives not measured" in proc.stdout


def test_decode_batch_draws_ids_from_the_vocabulary():
    """Ids cover [0, vocab) (a vocab of 256: some >= 200, none >= 256); rows sit at position context - 1 of their
    own pages (the slot worked out by hand)."""
    b, context, block, vocab = 512, 40, 16, 256
    batch = decode_batch(b, context, block, vocab, np.random.default_rng(0))
    ids = np.asarray(batch.token_ids)
    assert ids.shape == (b,) and ids.min() >= 0 and ids.max() < vocab and ids.max() >= 200
    assert np.all(np.asarray(batch.positions) == 39)
    pages = 3  # ceil(40 / 16); pages 1.. in order, row i owns pages 1 + 3i .. 3 + 3i
    assert np.array_equal(np.asarray(batch.block_tables)[5], [16, 17, 18])
    assert np.asarray(batch.slot_mapping)[5] == (1 + 5 * pages + 39 // 16) * 16 + 39 % 16
    tiny = decode_batch(64, context, block, configs.tiny.vocab_size, np.random.default_rng(1))
    assert np.asarray(tiny.token_ids).max() < configs.tiny.vocab_size


def test_roofline_counts_by_hand():
    cfg = configs.glm52
    # B=128 at 32K: 78 layers x 2048 rows x 576 x 2 B + 21 full layers x 32768 keys x 128 x 2 B, per sequence
    want = 128 * (78 * 2048 * 576 * 2 + 21 * 32768 * 128 * 2)
    assert decode_attention_bytes(cfg, 128, 32768, 2) == want
    # fp8_ds_mla: 656-byte MLA rows (512 e4m3 + 4 tile scales + 64 bf16 rope) and 132-byte FP8 indexer keys
    want = 128 * (78 * 2048 * 656 + 21 * 32768 * 132)
    assert decode_attention_bytes(cfg, 128, 32768, 0, mla_row_bytes=656, index_row_bytes=132) == want
    assert 2 * 30e9 < flops_per_token(cfg, 1) < 2 * 50e9  # ~40B active parameters per token


def test_a_decode_batch_out_of_memory_is_a_row_not_the_end(monkeypatch):
    """A decode batch whose caches do not fit the device (RESOURCE_EXHAUSTED) is reported as that batch's row and
    the run goes on to the next batch; any other error still ends the run."""
    import argparse

    import jax

    from glm_dsa.serving import benchmark as bench_engine  # the engine benchmark lives in the package (the CLI runs it)

    real = bench_engine._decode_row

    def row(cfg, params, parallel, bc, impl, b, *rest):
        if b == 2:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.5GiB")
        return real(cfg, params, parallel, bc, impl, b, *rest)

    monkeypatch.setattr(bench_engine, "_decode_row", row)
    p = argparse.ArgumentParser()
    bench_engine.add_arguments(p)
    bc = bench_engine.config_from_args(p.parse_args(
        ["--preset", "tiny", "--input-len", "16", "--output-len", "2", "--batch", "1", "--decode-batches", "2,1",
         "--no-end-to-end", "--no-stages"]))
    lines = []
    res = bench_engine.run_bench(bc, log=lines.append)
    decode = res["impls"]["xla"]["decode"]
    assert decode[2] == {"error": "out of memory: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.5GiB"}
    assert decode[1]["ms_per_step"] > 0
    assert "decode B=2: out of memory" in lines[-1]
    assert [r.get("error") is None for r in bench_engine.result_rows(res)] == [False, True]

    def broken(*a):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(bench_engine, "_decode_row", broken)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        bench_engine.run_bench(bc, log=lines.append)


def test_random_fp8_caches_hold_valid_rows():
    """The decode benchmark's fp8_ds_mla caches hold quantised rows of normal values (finite, unit spread): random
    bytes would decode to NaN attention and a degenerate expert routing, timing a different step."""
    import jax.numpy as jnp

    from benchmarks.bench_engine import decode_engine
    from glm_dsa.model.random_init import init_params
    from kernels.common.fp8_formats import dequantize_index_rows, dequantize_mla_rows

    cfg = configs.tiny
    eng = decode_engine(cfg, init_params(cfg), None, "bfloat16", "xla", 2, 64, "fp8_ds_mla")
    mla, index = eng.caches["mla"][0], eng.caches["indexer"][0]
    assert mla.dtype == index.dtype == jnp.uint8
    kv, k_pe = dequantize_mla_rows(mla.reshape(-1, mla.shape[-1]), cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    keys = dequantize_index_rows(index.reshape(-1, index.shape[-1]), cfg.index_head_dim)
    for x in (kv, k_pe, keys):
        x = np.asarray(x, np.float32)
        assert np.isfinite(x).all() and 0.8 < x.std() < 1.2


def test_batch_invariant_cost_rows(tmp_path, monkeypatch):
    """`bench --batch-invariant-cost` at tiny sizes (the step rows lowered: 8192-row prompt steps take seconds on a
    CPU): a prefill row and a decode row per batch, each with both modes' times, their ratio and the acceptance
    limit where there is one; the batch-invariant decode step it times is padded to the bucket of its rows."""
    import argparse

    from glm_dsa.serving import benchmark
    from kernels import registry

    monkeypatch.setattr(registry, "INVARIANT_PROMPT_ROWS", 128)
    monkeypatch.setattr(registry, "INVARIANT_STEP_ROWS", 64)
    timed = []
    real = benchmark.serving_decode_ms

    def spy(eng, b, ctx, rng, steps=10):
        timed.append((eng.batch_invariant, eng.runner.step_shapes(benchmark.decode_plan(eng, b, ctx, rng))))
        return real(eng, b, ctx, rng, steps)

    monkeypatch.setattr(benchmark, "serving_decode_ms", spy)
    p = argparse.ArgumentParser()
    benchmark.add_arguments(p)
    out = tmp_path / "cost.json"
    args = p.parse_args(["--preset", "tiny", "--num-layers", "2", "--batch-invariant-cost", "--input-len", "24",
                         "--output-len", "3", "--batch", "2", "--decode-batches", "32", "--max-num-batched-tokens",
                         "16", "--json-out", str(out)])
    assert benchmark.run_from_args(args, command="bench --batch-invariant-cost") == 0
    rec = json.loads(out.read_text())
    assert rec["command"] == "bench --batch-invariant-cost" and rec["invariant_step_rows"] == [128, 64]
    assert [(r["check"], r["phase"], r.get("B")) for r in rec["rows"]] == [
        ("batch_invariant_cost", "prefill", None), ("batch_invariant_cost", "decode", 32)]
    pre, d32 = rec["rows"]
    assert pre["ratio"] == pre["invariant_s"] / pre["default_s"] and pre["default_s"] > 0
    assert pre["invariant_steps"] > pre["invariant_prompt_steps"] > 0 and pre["default_steps"] > 0
    assert pre["max_num_batched_tokens"] == 16
    assert d32["ratio"] == d32["invariant_ms"] / d32["default_ms"] and d32["context"] == 24
    assert (pre["limit"], d32["limit"]) == (1.15, 1.10) and isinstance(d32["within_limit"], bool)
    assert benchmark._cost_row("decode", 1.0, 2.0, 1)["limit"] is None  # B = 1: no acceptance line
    # 32 rows at the context's pages (one of 64 tokens) in both modes: in batch-invariant mode the bucket of 32 rows
    # (of 8 to the decode rows, 64), and the block-table width of max_model_len
    assert timed == [(False, (32, 1, 32)), (True, (32, 1, 32))]
    assert rec["decode_buckets"] == [8, 16, 32, 64] and d32["invariant_rows"] == 32
