"""Indexer scores + top-k for a prefill chunk on the GPU: the row-block Triton kernel, the per-row kernel and xla.

One request with a 32K-token context in a paged FP8 indexer cache (GLM-5 dims: 32 heads of 128, top-k 2048,
pages of 64); the chunk is T query rows at the last positions [32K - T, 32K) (kv_lens = position + 1), the
most expensive chunk of a 32K prompt. Reports ms per call (median of `iters`), the scores kernel alone, and
TFLOP/s of the score matmuls (2 * H * Di per visible (row, key) pair).

    PYTHONPATH=. python3 benchmarks/bench_indexer_prefill.py --out bench_indexer_prefill.json
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

from benchmarks.harness import command_line, record, timeit, write_json
from kernels import fp8_formats, indexer
from kernels.indexer import triton as indexer_triton

HI, DI, TOPK, CTX, PAGE = 32, 128, 2048, 32768, 64


def make_case(t, fp8=True, seed=0):
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    n_pages = CTX // PAGE + 1
    keys = jax.random.normal(k1, (n_pages * PAGE, DI), jnp.bfloat16)
    cache = jax.jit(fp8_formats.quantize_index_rows)(keys) if fp8 else keys
    bt = (1 + jax.random.permutation(k2, n_pages - 1)).reshape(1, -1).astype(jnp.int32)
    q = jax.random.normal(k3, (t, HI, DI), jnp.bfloat16)
    w = jax.random.uniform(k4, (t, HI), jnp.float32) * (HI ** -0.5) * (DI ** -0.5)
    pos = CTX - t + jnp.arange(t, dtype=jnp.int32)
    return cache, bt, q, w, jnp.zeros(t, jnp.int32), pos + 1


def main(argv=None):
    """The command line: one row per format and chunk length T."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1024,8192")
    ap.add_argument("--formats", default="fp8")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--xla", type=int, default=1, help="also time the xla op")
    ap.add_argument("--per_row", type=int, default=1, help="also time the per-row kernel (block_t=1)")
    ap.add_argument("--out", default="bench_indexer_prefill.json")
    args = ap.parse_args(argv)
    rows = []
    for fmt in args.formats.split(","):
        for t in (int(v) for v in args.rows.split(",")):
            cache, bt, q, w, req, lens = make_case(t, fmt == "fp8")
            pairs = float(jnp.sum(lens))
            flops = 2 * HI * DI * pairs
            res = {"format": fmt, "T": t, "visible_pairs": pairs}

            def total(impl, **opts):
                f = jax.jit(functools.partial(indexer.indexer_topk, block_size=PAGE, topk=TOPK, impl=impl, **opts))
                return timeit(f, q, w, cache, req, lens, bt, warmup=1, reps=args.iters)

            def scores(**opts):
                qq, ww = indexer.prepare_queries(q, w, cache)
                f = jax.jit(functools.partial(indexer_triton.indexer_scores_triton, block_size=PAGE, **opts))
                return timeit(f, qq, ww, cache, req, lens, bt, warmup=1, reps=args.iters)

            res["triton_ms"] = 1e3 * total("triton")
            res["scores_ms"] = 1e3 * scores()
            res["scores_tflops"] = flops / (res["scores_ms"] * 1e-3) / 1e12
            if args.per_row:
                res["per_row_scores_ms"] = 1e3 * scores(block_t=1)
            if args.xla:
                res["xla_ms"] = 1e3 * total("xla")
                res["speedup"] = res["xla_ms"] / res["triton_ms"]
            print(json.dumps(res), flush=True)
            rows.append(res)
    write_json(args.out, record(rows, command=command_line(argv, script=__file__)))


if __name__ == "__main__":
    main()
