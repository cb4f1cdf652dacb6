"""`info --kernels`'s dispatch table (glm_dsa.model.kernel_table) against what `glm_dsa.step` actually dispatches: the
table traces one layer of each kind of a trimmed model over caches and a batch of its own; here the whole model's
step is traced over caches and a decode or prefill batch built as the engine builds them, both deciding for a GPU
on this CPU, and every (rule, choice) of each shape class must agree. Parameters are shapes only (the rules read
shapes and dtypes; drawing them would cost seconds per parameter). Also: the table's GPU choices for GLM-5.2's
attention geometry, and the CLI's errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm_dsa import configs
from glm_dsa.cli import main
from glm_dsa.model.random_init import init_params
from glm_dsa.model.kernel_table import dispatch_table, invariant_shape_classes, shape_classes
from glm_dsa.model.layers import StepBatch
from glm_dsa.model.options import StepOptions
from glm_dsa.model.paged_cache import allocate_caches, cache_dtype
from glm_dsa.model.step import resolve_parallel, step
from kernels import registry
from sharding import ParallelConfig

CONTEXT, BLOCK = 256, 64
DECODE, PREFILL = (1, 4), (64,)


def _actual(cfg, parallel, rows, requests, *, kv_cache_dtype, quantization, dtype, options=None):
    """{(rule, choice)} of one step of the whole model over `rows` rows of `requests` requests (`options`: the
    step's StepOptions, default impl "auto")."""
    parallel = resolve_parallel(parallel, cfg)
    params = jax.eval_shape(functools.partial(init_params, cfg, dtype=dtype, parallel=parallel,
                                              quantization=quantization))
    pages = CONTEXT // BLOCK
    caches = allocate_caches(cfg, (pages * requests + 1) * parallel.dcp, BLOCK, cache_dtype(kv_cache_dtype, dtype),
                             kv_cache_dtype=kv_cache_dtype)
    decode = rows <= requests  # a decode row per request (batch-invariant decode buckets may be fewer rows)
    req = np.arange(rows, dtype=np.int32) if decode else np.repeat(np.arange(requests, dtype=np.int32),
                                                                   rows // requests)
    pos = np.full(rows, CONTEXT - 1, np.int32) if decode else np.arange(rows, dtype=np.int32)
    tables = 1 + np.arange(requests * pages, dtype=np.int32).reshape(requests, pages)
    slots = tables[req, pos // BLOCK] * BLOCK + pos % BLOCK
    batch = StepBatch(*(jnp.asarray(a) for a in (np.zeros(rows, np.int32), pos, slots, req, tables,
                                                 np.arange(requests, dtype=np.int32))))
    with registry.deciding_for("gpu"), registry.record() as log:
        jax.eval_shape(functools.partial(step, config=cfg, parallel=parallel,
                                         options=options or StepOptions(impl="auto")), params, caches, batch)
    return {(d.rule, d.choice) for d in log}


CASES = {
    "tiny bf16, tp 1": (configs.tiny, ParallelConfig(tensor_parallel_size=1), "auto", None, "float32"),
    "heads fp8 weights and cache, tp 2": (configs.heads, ParallelConfig(tensor_parallel_size=2), "fp8_ds_mla", "fp8",
                                          "bfloat16"),
}


@pytest.mark.parametrize("case", CASES)
def test_table_is_what_the_step_dispatches(case):
    cfg, parallel, kv, quant, dtype = CASES[case]
    table = dispatch_table(cfg, parallel=parallel, decode_rows=DECODE, prefill_rows=PREFILL, context=CONTEXT,
                           block_size=BLOCK, kv_cache_dtype=kv, quantization=quant, dtype=dtype)
    assert {r["shape"] for r in table} == {label for label, _, _ in shape_classes(DECODE, PREFILL)}
    for label, rows, requests in shape_classes(DECODE, PREFILL):
        listed = {(r["rule"], r["choice"]) for r in table if r["shape"] == label}
        assert listed == _actual(cfg, parallel, rows, requests, kv_cache_dtype=kv, quantization=quant,
                                 dtype=dtype), label
    chosen = {(r["shape"], r["rule"]): r["choice"] for r in table}
    if case.startswith("heads"):  # GLM-5.2's attention geometry: Mosaic attention and decode indexer scores
        assert chosen["decode B=4", "sparse_mla.auto"] == "mosaic"
        assert chosen["decode B=4", "indexer.auto"] == "mosaic"
        assert chosen["prefill T=64", "indexer.auto"] == "triton"
        assert chosen["prefill T=64", "indexer.scores_form"] == "row_block"
        assert chosen["decode B=1", "moe.fp8_form"] == "w8a8"
        assert chosen["prefill T=64", "fp8_linear.model_form"] == "w8a8_mosaic"  # `fp8_linear.MOSAIC_ROWS`
        assert chosen["decode B=4", "fp8_linear.model_form"] == "fp8_linear"
    else:  # float32: no Mosaic (bf16 / FP8 caches only), bf16-free weights: no FP8 forms
        assert chosen["decode B=1", "sparse_mla.auto"] == "triton"
        assert not any(rule.startswith(("moe.fp8", "fp8_linear")) for _, rule in chosen)


def test_batch_invariant_table_is_what_the_step_dispatches():
    """Batch-invariant mode's table (`--batch-invariant`: a prompt step and a decode step at each bucket, here of
    256 rows and 8, 16 and 32 rows, of 32 requests) is what the whole model's step dispatches in that mode, the
    step's padded rows naming its kind (`StepOptions.invariant_prompt_rows`); every decode bucket lists the same.
    FP8 weights and cache at GLM-5.2's attention geometry: the prompt step takes the default mode's prefill choices at
    its shape (the Mosaic W8A8 GEMM for the FP8 linears and experts, the row-block indexer scores, the select
    top-k, launch configs for its rows), the decode step the fixed per-row ones."""
    cfg, parallel, kv, quant, dtype = CASES["heads fp8 weights and cache, tp 2"]
    kw = dict(kv_cache_dtype=kv, quantization=quant, dtype=dtype)
    table = dispatch_table(cfg, parallel=parallel, batch_invariant=True, invariant_rows=(256, 32), context=CONTEXT,
                           block_size=BLOCK, **kw)
    options = StepOptions(impl="auto", batch_invariant=True, invariant_prompt_rows=256, invariant_decode_rows=32)
    classes = invariant_shape_classes(256, 32)
    assert [rows for _, rows, _ in classes] == [256, 8, 16, 32]
    (prompt, _, _), (decode, _, _) = classes[0], classes[-1]
    assert {r["shape"] for r in table} == {label for label, _, _ in classes}
    listed = {label: {(r["rule"], r["choice"]) for r in table if r["shape"] == label} for label, _, _ in classes}
    for label, rows, requests in classes:
        assert listed[label] == _actual(cfg, parallel, rows, requests, options=options, **kw), label
        if label != prompt:
            assert listed[label] == listed[decode], label
    default = _actual(cfg, parallel, 256, 1, **kw)  # the default mode's prefill chunk of 256 rows
    assert listed[prompt] == default
    chosen = {(r["shape"], r["rule"]): r["choice"] for r in table}
    assert {rule: chosen[prompt, rule] for rule in ("moe.fp8_form", "fp8_linear.model_form", "indexer.auto",
                                                     "indexer.scores_form", "topk.auto", "launch_rows")} == {
        "moe.fp8_form": "w8a8_mosaic", "fp8_linear.model_form": "w8a8_mosaic", "indexer.auto": "triton",
        "indexer.scores_form": "row_block", "topk.auto": "triton", "launch_rows": "rows"}
    assert {rule: chosen[decode, rule] for rule in ("moe.fp8_form", "fp8_linear.model_form", "indexer.auto",
                                                     "indexer.scores_form", "topk.auto", "launch_rows")} == {
        "moe.fp8_form": "w8a8", "fp8_linear.model_form": "fp8_linear", "indexer.auto": "triton",
        "indexer.scores_form": "per_row", "topk.auto": "triton", "launch_rows": "fixed"}
    # the engine's own shapes: a prompt step of 8192 rows, decode steps of 8 to 256
    assert [rows for _, rows, _ in invariant_shape_classes()] == [8192, 8, 16, 32, 64, 128, 256]


def test_cli_prints_the_table(capsys):
    assert main(["info", "--kernels", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["shape", "op", "rule", "choice", "why"]
    assert "decode B=128" in out and "prefill T=2048" in out and "sparse_mla.auto" in out
    assert main(["info", "--kernels", "--preset", "tiny", "--batch-invariant"]) == 0
    out = capsys.readouterr().out
    assert "invariant prompt T=8192" in out and "invariant decode T=256" in out and "prefill T=" not in out
    assert "invariant decode T=8 " in out


@pytest.mark.parametrize("argv,match", [
    (["info", "--kernels", "--preset", "nope"], "invalid choice: 'nope'"),
    (["info", "--kernels", "--preset", "tiny", "--kv-cache-dtype", "fp9"], "invalid choice: 'fp9'"),
    (["info", "--kernels", "--preset", "tiny", "--quantization", "fp4"], "fp4"),
])
def test_cli_refuses_bad_flags(argv, match, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert match in capsys.readouterr().err
