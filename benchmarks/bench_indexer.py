"""Indexer scores + top-k (docs/math.md §2) on the GPU: Pallas Triton scores + chunked top-k against the xla op.

GLM-5 dims: 32 indexer heads of 128, top-k 2048, a 32K-token context per request (pages of 64), B decode
rows in {1, 8, 32, 128}, bf16 [slots, 128] and FP8 [slots, 132] indexer caches. One executable runs the op
`reps` times over different requests (the caches are several times the L2); median over `iters` runs /
reps. Effective TB/s counts the indexer-cache bytes of the visible keys (the issue's figure of merit);
`scores_us` times the Triton scoring kernel alone, so top-k = total - scores. Percentages are of the device's
HBM peak (`benchmarks.harness.device_peaks`).

    PYTHONPATH=. python3 benchmarks/bench_indexer.py --out bench_indexer.json [--sweep]
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp

from benchmarks.harness import Budget, budgeted_sweep, command_line, device_peaks, per_op_time, record, timeit
from benchmarks.harness import write_json
from kernels import fp8_formats, indexer, indexer_triton

HI, DI, TOPK, CTX, PAGE = 32, 128, 2048, 32768, 64


def make_case(b, fp8, reps, seed=0):
    regions = max(b, 16)
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    n_pages = regions * CTX // PAGE
    keys = jax.random.normal(k1, (n_pages * PAGE, DI), jnp.bfloat16)
    cache = jax.jit(fp8_formats.quantize_index_rows)(keys) if fp8 else keys
    del keys
    bt = jax.random.permutation(k2, n_pages).reshape(regions, CTX // PAGE).astype(jnp.int32)
    q = jax.random.normal(k3, (reps, b, HI, DI), jnp.bfloat16)
    w = jax.random.uniform(k4, (reps, b, HI), jnp.float32) * (HI ** -0.5) * (DI ** -0.5)
    req = ((jnp.arange(reps)[:, None] * b + jnp.arange(b)[None, :]) % regions).astype(jnp.int32)
    lens = jnp.full((reps, b), CTX, jnp.int32)
    jax.block_until_ready((cache, bt, q, w))
    return cache, bt, q, w, req, lens


def bytes_moved(b, fp8):
    row = fp8_formats.index_row_bytes(DI) if fp8 else 2 * DI
    return b * CTX * row


def make_runner(impl, reps, scores_only=False, topk_only=False, **opts):
    """A jitted runner of `reps` indexer ops (or their scoring or top-k stage alone), op i on request set i."""
    @jax.jit
    def run(cache, bt, q, w, req, lens):
        outs = []
        for i in range(reps):
            if topk_only:  # the top-k stage alone, on stand-in scores of the same shape
                sc = (q[i, :, :1, :1].astype(jnp.float32) * jnp.arange(CTX, dtype=jnp.float32)[None, None]).reshape(
                    q.shape[1], CTX) % 7.0
                outs.append(indexer.topk_positions(sc, lens[i], TOPK))
            elif scores_only:
                qq, ww = indexer.prepare_queries(q[i], w[i], cache)
                outs.append(indexer_triton.indexer_scores_triton(qq, ww, cache, req[i], lens[i], bt, block_size=PAGE,
                                                                 **opts))
            else:
                outs.append(indexer.indexer_topk(q[i], w[i], cache, req[i], lens[i], bt, block_size=PAGE, topk=TOPK,
                                                 impl=impl, **opts))
        return outs

    return run


def main(argv=None):
    """The command line: one row per format and B (and each swept scoring config's amortised time)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--formats", default="fp8,bf16")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sweep", type=int, default=0)
    ap.add_argument("--xla_topk", type=int, default=0)
    ap.add_argument("--budget_s", type=float, default=100.0)
    ap.add_argument("--out", default="bench_indexer.json")
    args = ap.parse_args(argv)
    budget = Budget(args.budget_s)  # one budget for the whole run: later B get the default config only
    results, skipped = [], []
    peaks = device_peaks()
    dev = jax.devices()[0].device_kind
    for fmt in args.formats.split(","):
        fp8 = fmt == "fp8"
        for b in [int(x) for x in args.batches.split(",")]:
            data = make_case(b, fp8, args.reps)
            nbytes = bytes_moved(b, fp8)
            t_xla, _ = per_op_time(lambda n: make_runner("xla", n), data, args.reps, args.iters)
            configs = [dict(block_s=128, num_warps=4, num_stages=1)]
            if args.sweep:
                configs += [dict(block_s=bs, num_warps=nw, num_stages=ns)
                            for bs, nw, ns in itertools.product([128, 256, 512, 1024], [4, 8], [1, 2])]
            sweep = budgeted_sweep(configs, lambda cfg, data=data: timeit(
                make_runner("triton", args.reps, scores_only=True, **cfg), *data, warmup=1,
                reps=args.iters) / args.reps, budget, label=f"{fmt} B={b}")
            results += [dict(op="indexer_scores", fmt=fmt, B=b, cfg=cfg, amortised_us=raw * 1e6)
                        for cfg, raw in sweep.measured]
            if sweep.skipped:
                skipped.append(dict(op="indexer_scores", fmt=fmt, B=b, configs=sweep.skipped))
            if not sweep.measured:
                raise RuntimeError(f"indexer {fmt} B={b}: no scoring config ran: {sweep.failed}")
            cfg = sweep.best()[0]
            t_sc, _ = per_op_time(lambda n: make_runner("triton", n, scores_only=True, **cfg), data, args.reps,
                                  args.iters)
            t_tk = None
            if args.xla_topk:  # lax.top_k alone on [B, 32K] scores, for comparison with the select kernel
                t_tk, _ = per_op_time(lambda n: make_runner("triton", n, topk_only=True), data, args.reps, args.iters)
            t, _ = per_op_time(lambda n: make_runner("triton", n, **cfg), data, args.reps, args.iters)
            rec = dict(op="indexer_topk", fmt=fmt, B=b, cfg=cfg, t_us=t * 1e6, scores_us=t_sc * 1e6,
                       topk_us=(t - t_sc) * 1e6, xla_topk_us=None if t_tk is None else t_tk * 1e6,
                       xla_us=t_xla * 1e6, tbps=nbytes / t / 1e12, pct=100 * nbytes / t / peaks.hbm_bytes_per_s,
                       scores_tbps=nbytes / t_sc / 1e12, speedup=t_xla / t, bytes=nbytes, device=dev)
            results.append(rec)
            print(f"indexer {fmt:5s} B={b:4d}  triton {rec['t_us']:8.1f} us (scores {rec['scores_us']:7.1f})  "
                  f"{rec['tbps']:5.2f} TB/s ({rec['pct']:4.1f}%; scores {rec['scores_tbps']:.2f}, "
                  f"top-k {rec['topk_us']:.1f} us)  "
                  f"xla {rec['xla_us']:8.1f} us  x{rec['speedup']:.1f}  {cfg}", flush=True)
            del data
            write_json(args.out, record(results, command=command_line(argv, script=__file__), skipped=skipped,
                                        roofline=peaks.name))


if __name__ == "__main__":
    main()
