"""Indexer decode (docs/math.md §2) on the GPU: scores alone, top-k alone, scores + top-k, for the "triton" impl
(the looped scores kernel + the select top-k kernel, kernels/indexer/topk_triton.py), the "mosaic" impl (the Mosaic GPU
scores kernel of kernels/indexer/mosaic.py + the same top-k; FP8 caches), the previous one ("triton_old": the
one-tile scores kernel + `lax.top_k`) and the xla op. Scores + top-k is timed in score order (config {}) and as a
set (config {"ordered": false}: how the model calls it).

GLM-5 dims: 32 indexer heads of 128, top-k 2048, a 32K-token context per request (pages of 64), B decode rows, an FP8
[slots, 132] (or bf16 [slots, 128]) indexer cache. An executable runs a stage `reps` times over different requests;
one stage is (T(reps) - T(1)) / (reps - 1), each T the median of `iters` runs (`benchmarks.harness.per_op_time`).
The top-k stage runs on scores the kernel computed (one array per rep): the real score distribution. TB/s counts the
indexer-cache bytes of the visible keys (132 B a key for FP8, 256 B for bf16) for the scores and the whole op.

Each B first checks on its own data, on the GPU: the select kernel's (positions, scores) equal `lax.top_k`'s bit for
bit (the first B also on rows with a quarter of the scores tied at zero and rows of 1, 1000, 2048, 2049 keys), and
the largest relative distance of the new scores from the one-tile kernel's. On the first B, `--sweep` also ranks a
few scores configs and top-k variants by amortised time (T(reps) / reps, one compile each), and times the select
kernel cut short after each stage (`topk_select(_stop=...)`: 0 row load + bounds, 1 + tau and tie cut, 3 + scatter)
so the top-k's time splits by stage.

Rows: {"op": "indexer", "stage": "scores" | "topk" | "scores+topk", "cache", "B", "impl", "config", "us", "xla_us",
"tb_s", "kernel_us", "device_us", "xla_kernel_us", "xla_device_us"} (sweep rows carry "amortised_us" instead of
"us"; the trace times, on the scores + top-k rows: kernel time and device span from a profiler trace, harness
docstring); the best row per stage is printed at the end.

    PYTHONPATH=. python3 benchmarks/bench_indexer.py --out $OUT/bench_indexer.json
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import (Budget, budgeted_sweep, command_line, micros, per_op_time, per_rep, record, timeit,
                                trace_micros, traced_times_or_none, write_json)
from kernels import fp8_formats, indexer
from kernels.indexer import mosaic as indexer_mosaic
from kernels.indexer import triton as indexer_triton
from kernels.indexer import topk_triton

HI, DI, TOPK, CTX, PAGE = 32, 128, 2048, 32768, 64
OLD_SCORES = dict(block_s=128, block_t=1, num_warps=4, num_stages=1, block_n=0)  # the one-tile kernel of before
SCORES_SWEEP = [dict(fp8_dot=False), dict(block_n_mult=2), dict(num_stages=3), dict(block_s=64), dict(num_warps=8),
                dict(block_n_mult=4), dict(block_s=64, num_stages=3)]
TOPK_SWEEP = [dict(_stop=0), dict(_stop=1), dict(_stop=3), dict(sort="none"), dict(num_warps=16), dict(sort="kernel")]


def make_case(b, fp8, reps, seed=0):
    """(cache, block tables, q, w, requests, lens), the last four `reps` arrays each ([B, H, Di], [B, H], [B], [B];
    `harness.per_rep`): rep i reads requests i*B .. (mod max(B, 16) regions of 32K keys in shuffled pages)."""
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
    return (cache, bt, *map(per_rep, (q, w, req, lens)))  # per-rep arrays: the timed executables slice nothing


def bytes_moved(b, fp8):
    """Indexer-cache bytes of the visible keys of B rows."""
    return b * CTX * (fp8_formats.index_row_bytes(DI) if fp8 else 2 * DI)


def resolve(cfg, b):
    """A scores sweep entry as kernel options: block_n_mult scales the shape default's keys per program."""
    cfg = dict(cfg)
    mult = cfg.pop("block_n_mult", None)
    if mult is not None:
        cfg["block_n"] = min(CTX, mult * indexer_triton.loop_block_n(b, CTX, cfg.get("block_s", 128)))
    return cfg


def scores_runner(reps, opts, impl="triton"):
    """Jitted: `reps` passes of the scores kernel of `impl` ("triton" or "mosaic", kernel options `opts`), pass i on
    request set i."""
    kernel = indexer_mosaic.indexer_scores_mosaic if impl == "mosaic" else indexer_triton.indexer_scores_triton

    @jax.jit
    def run(cache, bt, q, w, req, lens):
        outs = []
        for i in range(reps):
            qq, ww = indexer.prepare_queries(q[i], w[i], cache)
            outs.append(kernel(qq, ww, cache, req[i], lens[i], bt, block_size=PAGE, **opts))
        return outs
    return run


def topk_runner(reps, impl, opts):
    """Jitted: `reps` top-k passes (op "topk": impl "xla" is `lax.top_k`) over stored scores [reps, B, S']."""
    @jax.jit
    def run(sc, lens):
        if opts.get("_stop") is not None:  # the select kernel cut short (stage breakdown)
            return [topk_triton.topk_select(sc[i], lens[i], TOPK, CTX, **opts) for i in range(reps)]
        return [indexer.select_topk(sc[i], lens[i], TOPK, CTX, impl=impl, **opts) for i in range(reps)]
    return run


def total_runner(reps, impl, opts):
    """Jitted: `reps` whole indexer ops (`indexer.indexer_topk` with impl and kernel options)."""
    @jax.jit
    def run(cache, bt, q, w, req, lens):
        return [indexer.indexer_topk(q[i], w[i], cache, req[i], lens[i], bt, block_size=PAGE, topk=TOPK, impl=impl,
                                     **opts) for i in range(reps)]
    return run


def check(data, b, fp8, ties):
    """On the GPU: select kernel == lax.top_k bit for bit on the kernel's scores (and, with `ties`, on rows with tied
    zeros and short rows); the new scores' largest relative distance from the one-tile kernel's (bf16 dots)."""
    cache, bt, q, w, req, lens = data
    qq, ww = indexer.prepare_queries(q[0], w[0], cache)
    f = functools.partial(indexer_triton.indexer_scores_triton, block_size=PAGE)
    new = jax.jit(f)(qq, ww, cache, req[0], lens[0], bt)
    old = np.asarray(jax.jit(functools.partial(f, **OLD_SCORES))(qq, ww, cache, req[0], lens[0], bt))[:, :CTX]
    res = {"B": b, "cache": "fp8" if fp8 else "bf16",
           "scores_rel_vs_one_tile": float(np.max(np.abs(np.asarray(new)[:, :CTX] - old)
                                                  / np.maximum(np.abs(old), np.abs(old).max() * 1e-3)))}
    lax_topk = jax.jit(lambda s, n: indexer.topk_positions(s, n, TOPK, CTX))
    select = jax.jit(lambda s, n: indexer.select_topk(s, n, TOPK, CTX, impl="triton"))

    def same(s, n):
        got, want = select(s, n), lax_topk(s, n)
        return bool(np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
                    and np.array_equal(np.asarray(got[1]).view(np.int32), np.asarray(want[1]).view(np.int32)))

    res["select_equal_lax"] = same(new, lens[0])
    if ties:  # a quarter of the scores zero; rows of 1, 1000, 2048, 2049 visible keys (-inf past them)
        sc = jnp.where(jnp.arange(new.shape[1])[None, :] % 4 == 0, 0.0, new)
        n = jnp.asarray(([1, 1000, 2048, 2049] * b)[:b], jnp.int32)
        res["select_equal_lax_ties_short"] = same(jnp.where(jnp.arange(sc.shape[1])[None, :] < n[:, None], sc,
                                                            -jnp.inf), n)
    return res


def main(argv=None):
    """The command line (see the module docstring); exit status 1 if a check failed."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="32,128,1")
    ap.add_argument("--formats", default="fp8")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--sweep", type=int, default=1, help="on the first B: rank scores configs and top-k variants")
    ap.add_argument("--xla", type=int, default=1, help="also time the whole xla op")
    ap.add_argument("--old", type=int, default=1, help="also time the previous impl (one-tile scores + lax.top_k)")
    ap.add_argument("--budget_s", type=float, default=30.0, help="wall budget of each of the two sweeps")
    ap.add_argument("--kernel_time", type=int, default=1,
                    help="1: scores + top-k also by its GPU kernel time (a profiler trace)")
    ap.add_argument("--impls", default="triton,mosaic",
                    help="kernel impls timed (scores, and scores + top-k in score order and as a set); the Mosaic "
                         "kernel takes FP8 caches only")
    ap.add_argument("--out", default="bench_indexer.json")
    args = ap.parse_args(argv)
    rows, checks, best = [], [], {}
    impls = [i for i in args.impls.split(",") if i]

    def log(s):
        print(s, flush=True)

    def emit(stage, fmt, b, impl, cfg, sec, xla_sec=None, nbytes=None, traced=None, xla_traced=None):
        row = dict(op="indexer", stage=stage, cache=fmt, B=b, impl=impl, config=cfg, us=sec * 1e6,
                   xla_us=micros(xla_sec), tb_s=None if nbytes is None else nbytes / sec / 1e12,
                   **trace_micros(traced), **trace_micros(xla_traced, "xla_"))
        rows.append(row)
        log(f"  {stage:12s} {fmt:4s} B={b:4d} {impl:11s} {row['us']:9.1f} us"
            + ("" if traced is None else f" (kernels {row['kernel_us']:.1f}, device {row['device_us']:.1f})")
            + ("" if xla_sec is None else f"  (xla {row['xla_us']:.1f} us)")
            + ("" if nbytes is None else f"  {row['tb_s']:.2f} TB/s") + f"  {cfg}")
        if impl == "triton" and ((stage, fmt, b) not in best or best[(stage, fmt, b)]["us"] > row["us"]):
            best[(stage, fmt, b)] = row

    def sweep(stage, fmt, b, configs, measure):
        res = budgeted_sweep(configs, measure, Budget(args.budget_s), label=f"{stage} {fmt} B={b}")
        for cfg, sec in res.measured:
            rows.append(dict(op="indexer", stage=stage, cache=fmt, B=b, impl="triton", config=cfg,
                             amortised_us=sec * 1e6))
            log(f"  {stage:12s} {fmt:4s} B={b:4d} sweep {sec * 1e6:9.1f} us amortised  {cfg}")
        for cfg, err in res.failed:
            rows.append(dict(op="indexer", stage=stage, cache=fmt, B=b, impl="triton", config=cfg, error=err))
        return res

    def save():
        write_json(args.out, record(rows, command=command_line(argv, script=__file__), checks=checks,
                                    best=list(best.values())))

    first = True
    for fmt in args.formats.split(","):
        fp8 = fmt == "fp8"
        for b in [int(x) for x in args.batches.split(",")]:
            data = make_case(b, fp8, args.reps)
            nbytes = bytes_moved(b, fp8)
            try:
                checks.append(check(data, b, fp8, ties=first))
            except Exception as e:  # a failed check is reported; the timings still run
                checks.append({"B": b, "cache": fmt, "error": f"{type(e).__name__}: {str(e)[:400]}"})
            log(f"check {checks[-1]}")

            def op_time(make, args_):
                return per_op_time(make, args_, args.reps, args.iters)[0]

            def kernel_time(make, args_):  # harness.TraceTimes per op (a profiler trace), None if it failed
                return traced_times_or_none(make, args_, args.reps, log=log) if args.kernel_time else None

            # scores alone
            emit("scores", fmt, b, "triton", {}, op_time(lambda n: scores_runner(n, {}), data), nbytes=nbytes)
            if "mosaic" in impls and fp8:
                emit("scores", fmt, b, "mosaic", {}, op_time(lambda n: scores_runner(n, {}, "mosaic"), data),
                     nbytes=nbytes)
            if args.old:
                emit("scores", fmt, b, "triton_old", OLD_SCORES, op_time(lambda n: scores_runner(n, OLD_SCORES), data),
                     nbytes=nbytes)
            if first and args.sweep:
                base = timeit(scores_runner(args.reps, {}), *data, warmup=1, reps=args.iters) / args.reps
                res = sweep("scores", fmt, b, [c for c in SCORES_SWEEP if fp8 or "fp8_dot" not in c],
                            lambda c, b=b, data=data: timeit(scores_runner(args.reps, resolve(c, b)), *data, warmup=1,
                                                             reps=args.iters) / args.reps)
                top = res.best()
                if top and top[1] < 0.97 * base:  # a config that beats the default: time it as the rows are
                    cfg = resolve(top[0], b)
                    emit("scores", fmt, b, "triton", cfg, op_time(lambda n: scores_runner(n, cfg), data),
                         nbytes=nbytes)

            # top-k alone, on the kernel's scores (one array per rep)
            cache, bt, q, w, req, lens = data
            sc = tuple(scores_runner(args.reps, {})(*data))
            x_tk = op_time(lambda n: topk_runner(n, "xla", {}), (sc, lens))
            emit("topk", fmt, b, "xla", {}, x_tk, x_tk)
            emit("topk", fmt, b, "triton", {}, op_time(lambda n: topk_runner(n, "triton", {}), (sc, lens)), x_tk)
            if first and args.sweep:
                sweep("topk", fmt, b, TOPK_SWEEP, lambda c, sc=sc, lens=lens: timeit(
                    topk_runner(args.reps, "triton", c), sc, lens, warmup=1, reps=args.iters) / args.reps)
            del sc

            # scores + top-k (the whole op also by its kernels' time)
            make_xla = functools.lru_cache(None)(lambda n: total_runner(n, "xla", {}))
            make_tri = functools.lru_cache(None)(lambda n: total_runner(n, "triton", {}))
            x_all = op_time(make_xla, data) if args.xla else None
            kx_all = kernel_time(make_xla, data) if args.xla else None
            emit("scores+topk", fmt, b, "triton", {}, op_time(make_tri, data), x_all, nbytes,
                 kernel_time(make_tri, data), kx_all)
            for impl in [i for i in impls if fp8 or i != "mosaic"]:  # as a set (how the model calls it)
                for cfg in ([{"ordered": False}] if impl == "triton" else [{}, {"ordered": False}]):
                    make = functools.lru_cache(None)(lambda n, impl=impl, cfg=cfg: total_runner(n, impl, cfg))
                    emit("scores+topk", fmt, b, impl, cfg, op_time(make, data), x_all, nbytes, kernel_time(make, data),
                         kx_all)
            if args.old:
                old = dict(OLD_SCORES, topk_impl="lax")
                emit("scores+topk", fmt, b, "triton_old", old, op_time(lambda n: total_runner(n, "triton", old), data),
                     x_all, nbytes)
            if x_all is not None:
                emit("scores+topk", fmt, b, "xla", {}, x_all, x_all, nbytes, kx_all, kx_all)
            first = False
            del data
            save()
    log("best (triton):")
    for r in best.values():
        log(f"  {r['stage']:12s} {r['cache']:4s} B={r['B']:4d} {r['us']:9.1f} us"
            + ("" if r["xla_us"] is None else f"  (xla {r['xla_us']:.1f})") + f"  {r['config']}")
    save()
    ok = all("error" not in c and all(v for key, v in c.items() if key.startswith("select_equal")) for c in checks)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
