"""Sparse MLA (docs/math.md §5) on the GPU: the Pallas Triton kernel against the xla op, GLM-5 dims.

H=64 heads, rows [512 | 64], top-k 2048 indices per query row into a 32K-token context per request, B decode
rows, bf16 and fp8_ds_mla caches. Per (cache, B) it times the xla op, the two-launch kernel (default
config: split-K partials, then the Pallas Triton merge launch; and the same with XLA's `merge_partials`), the
one-launch form (`merge="kernel"`: the last program of a
(row, head block) merges the partials in the same launch) over a few configs, and with `--sweep` more configs
of the two-launch form. Each op is checked against the xla op once (max relative error of o, `err`).

Timing: one jitted executable runs the op `reps` times on different inputs (op i reads its own cache region);
time per op = (T(reps ops) - T(1 op)) / (reps - 1), so the fixed cost of dispatching an executable cancels;
each T is the median of `iters` runs, and before every timed run a 256 MB write evicts the L2 (untimed), so
the cache rows come from HBM as in decode (at B = 1 all reps of one run read 38 MB: the L2 would hold them).
Effective TB/s = bytes that must be read and written (gathered cache rows + q + o/lse + indices) / time.

Rows (JSON, --out): {"op": "sparse_mla", "cache", "B", "impl", "config", "us", "xla_us", "tb_s", "err",
"kernel_us", "device_us", "xla_kernel_us", "xla_device_us"} (from a profiler trace, for xla and the first two
candidates: the op's kernel time, and its device span, first kernel to last, which counts the idle gaps between its
kernels but not the host's work per input array that the wall clock `us` includes, harness docstring);
impl is "xla", "triton_2launch" (the default config and --sweep configs) or "triton_1launch". The best per
(cache, B) is printed (a config whose result is off the xla op by 5% or more never is). B = 1..32, both
caches, in about 3 minutes on an H200 (estimated from a first run; --budget_s 60: past it, each (cache, B)
gets xla, the default and the first one-launch config only; each timing compiles two executables, ~4 s):

    PYTHONPATH=. python3 benchmarks/bench_sparse_mla.py --out $OUT/mla_small.json

Kernel durations without the host (Nsight Compute; each op once, L2 flushed by ncu before each kernel):

    PYTHONPATH=. ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum,\
launch__registers_per_thread,launch__grid_size,smsp__sass_inst_executed_op_local_ld.sum \
      python3 benchmarks/bench_sparse_mla.py --profile 1 --batches 1,4,16 > $OUT/ncu_mla.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import (Budget, command_line, cu_profiler, device_peaks, per_rep, record, trace_micros,
                                traced_times_or_none, write_json)
from kernels import fp8_formats, sparse_mla
from kernels.sparse_mla import triton as sparse_mla_triton

H, R, DR, K, CTX = 64, 512, 64, 2048, 32768
SCALE = (192 + 64) ** -0.5


def make_case(b, fp8, reps, seed=0):
    """(cache, q, idx): q and idx are `reps` arrays [b, H, R + Dr] and [b, K] (`harness.per_rep`, so the timed
    executable slices nothing); row r of rep i reads region (i * b + r) % regions."""
    regions = max(b, 16)
    if fp8:  # a uint8 cache must stay under 2 GiB (triton_common.check_addressable): at most 99 regions
        regions = min(regions, (2**31 - 1) // (CTX * fp8_formats.mla_row_bytes(R, DR)))
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    n = regions * CTX
    if fp8:
        kv = jax.random.normal(k1, (n, R), jnp.bfloat16)
        pe = jax.random.normal(k2, (n, DR), jnp.bfloat16)
        cache = jax.jit(fp8_formats.quantize_mla_rows)(kv, pe)
        del kv, pe
    else:
        cache = jax.random.normal(k1, (n, R + DR), jnp.bfloat16)
    q = jax.random.normal(k3, (reps, b, H, R + DR), jnp.bfloat16)
    # distinct positions per row: (a * j + c) mod 32K with odd a
    a = 2 * jax.random.randint(k4, (reps, b, 1), 0, CTX // 2) + 1
    c = jax.random.randint(k2, (reps, b, 1), 0, CTX)
    pos = (a * jnp.arange(K)[None, None, :] + c) % CTX
    region = (jnp.arange(reps)[:, None, None] * b + jnp.arange(b)[None, :, None]) % regions
    idx = (region * CTX + pos).astype(jnp.int32)
    jax.block_until_ready((cache, q, idx))
    return cache, per_rep(q), per_rep(idx)


def bytes_moved(b, fp8):
    row = fp8_formats.mla_row_bytes(R, DR) if fp8 else 2 * (R + DR)
    return b * K * row + b * H * (R + DR) * 2 + b * H * (R + 1) * 4 + b * K * 4


def make_runner(impl, reps, **opts):
    """A jitted runner of `reps` sparse MLA ops, op i on query set i."""
    def op(q, cache, idx):
        return sparse_mla.sparse_mla(q, cache, idx, scale=SCALE, kv_lora_rank=R, impl=impl, **opts)

    @jax.jit
    def run(cache, q, idx):
        return [op(q[i], cache, idx[i]) for i in range(reps)]

    return run


def make_flush(mbytes=256):
    """A function that writes `mbytes` MB (over 4x the H200's L2) and waits: the next executable starts with a
    cold L2."""
    x = jnp.zeros((mbytes << 18,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)
    return lambda: jax.block_until_ready(f(x))


def cold_median(fn, args, iters, flush):
    """Median wall seconds of `fn(*args)` (blocked), each run after `flush()`; one untimed warm-up run."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        flush()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_op(impl, data, reps, iters, flush, kernel_time=False, **opts):
    """(seconds per op, `harness.TraceTimes` per op or None, the 1-op executable's (o, lse) for rep 0): wall clock
    (T(reps) - T(1)) / (reps - 1); kernel time and device span by a profiler trace of the same two executables
    (`harness.per_op_traced_times`, each run after the L2 flush), when `kernel_time`."""
    lo, hi = make_runner(impl, 1, **opts), make_runner(impl, reps, **opts)
    t_lo = cold_median(lo, data, iters, flush)
    t_hi = cold_median(hi, data, iters, flush)
    k = traced_times_or_none({1: lo, reps: hi}.get, data, reps, before=flush) if kernel_time else None
    return max(t_hi - t_lo, 1e-9) / (reps - 1), k, lo(*data)[0]


def profile_once(impl, data, **opts):
    """Run one op (warmed up, compiled) between cuProfilerStart and Stop: with `ncu --profile-from-start off`
    only its kernels are profiled (ncu's own cache control flushes the L2 before each)."""
    run = make_runner(impl, 1, **opts)
    jax.block_until_ready(run(*data))
    cu_profiler(True)
    jax.block_until_ready(run(*data))
    cu_profiler(False)


def rel_err(out, ref):
    """max |o - o_ref| / max |o_ref| (o of rep 0), and whether the -inf pattern of lse agrees."""
    o, lse = (np.asarray(x) for x in out)
    o_ref, lse_ref = (np.asarray(x) for x in ref)
    err = float(np.max(np.abs(o - o_ref)) / max(np.max(np.abs(o_ref)), 1e-30))
    return err if np.array_equal(np.isneginf(lse), np.isneginf(lse_ref)) else float("inf")


def one_launch_configs(b, fp8, wide=False):
    """One-launch configs to try at B rows of 64 heads: `sparse_mla_triton.one_launch_config` first (always
    measured), then a few variants. Programs = B x (64 / block_h) x n_split, aiming at 64-128 CTAs; the merging
    program reads n_split x block_h x 512 partial floats (2 KB per head and split), so the variants keep
    n_split x block_h <= 512 and prefer splitting heads to splitting keys. `wide`: a grid for exploration."""
    if wide:
        out = []
        for bh, ns, nw, st, bk in itertools.product([16, 32, 64], [2, 4, 8, 16, 32], [4, 8], [2, 3], [32, 64]):
            n_prog = b * (64 // bh) * ns
            if n_prog < 16 or n_prog > 512 or ns * bh > 512 or (fp8 and bk == 64 and bh == 64):
                continue
            if bk * ns > K:
                continue
            out.append(dict(block_h=bh, block_k=bk, n_split=ns, num_warps=nw, num_stages=st, merge="kernel"))
        return out
    first = dataclasses.asdict(sparse_mla_triton.one_launch_config(b, H, K, fp8))
    # variants measured in the first H200 run (bf16 best at B = 8, 16: the first config; B = 1: 16 x 16)
    variants = {1: [(16, 8, "float32"), (16, 16, "bfloat16"), (32, 16, "float32")],
                2: [(16, 8, "float32"), (32, 8, "bfloat16")],
                4: [(16, 4, "float32"), (32, 4, "float32")],
                8: [(16, 2, "float32"), (32, 4, "float32")],
                16: [(32, 2, "float32"), (16, 4, "float32")]}.get(b, [(32, 2, "float32"), (64, 2, "float32")])
    out = [first]
    for bh, ns, pd in variants:
        cfg = dict(first, block_h=bh, n_split=ns, partial_dtype=pd)
        if cfg not in out:
            out.append(cfg)
    return out


def two_launch_sweep(b, fp8, level):
    """More configs of the two-launch form: level 0 none, 1 a focused grid, 2 a few candidates."""
    if not level:
        return []
    if level == 2:
        if b >= 32:
            return [dict(block_h=64, block_k=64, num_warps=16, num_stages=3, n_split=1 if b >= 128 else 4),
                    dict(block_h=64, block_k=64, num_warps=8, num_stages=2, n_split=2 if b >= 128 else 8)]
        return [dict(block_h=32, block_k=32, num_warps=4, num_stages=2, n_split=16 if b == 1 else 4),
                dict(block_h=64, block_k=32, num_warps=8, num_stages=2, n_split=32 if b == 1 else 8)]
    out = []
    splits = [1, 2, 4] if b >= 32 else ([4, 8, 16] if b >= 8 else [16, 32, 64])
    for bh, bk, nw, ns in itertools.product([64, 32], [32, 64], [4, 8], [1, 2, 3]):
        if bh == 32 and (bk != 32 or ns == 1):
            continue
        for split in splits:
            if b * (64 // bh) * split < 64 or (bk == 64 and split == splits[-1]):
                continue
            out.append(dict(block_h=bh, block_k=bk, num_warps=nw, num_stages=ns, n_split=split))
    return out


def main(argv=None):
    """The command line: rows per (cache, B, impl, config), the best printed per (cache, B)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--formats", default="bf16,fp8", help="bf16 and/or fp8 (fp8_ds_mla)")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--one_launch", type=int, default=1, help="0 none, 1 a few configs per B, 2 a wide grid")
    ap.add_argument("--sweep", type=int, default=0, help="two-launch configs beside the default: 0, 1 grid, 2 few")
    ap.add_argument("--budget_s", type=float, default=60.0,
                    help="after this, each (cache, B) gets xla, the default and its first one-launch config only")
    ap.add_argument("--profile", type=int, default=0,
                    help="1: no timing; each op once inside cudaProfilerStart/Stop (run under ncu "
                         "--profile-from-start off); a line per op says which, in order")
    ap.add_argument("--kernel_time", type=int, default=1,
                    help="1: for xla and the first two candidates, also the GPU kernel time (a profiler trace)")
    ap.add_argument("--out", default="bench_sparse_mla.json")
    args = ap.parse_args(argv)
    budget = Budget(args.budget_s)
    rows, best_lines, skipped, failed = [], [], [], []
    peaks = device_peaks()
    flush = make_flush()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    # B outer, cache inner: the budget goes to the sweeps of the smallest B of both caches first
    for b, fmt in itertools.product([int(x) for x in args.batches.split(",")], args.formats.split(",")):
        fp8 = fmt == "fp8"
        cache_name = "fp8_ds_mla" if fp8 else "bf16"
        data = make_case(b, fp8, args.reps)
        nbytes = bytes_moved(b, fp8)
        default = dataclasses.asdict(sparse_mla_triton.default_config(b, H, K, fp8))
        default.update(merge="launch")  # the two-launch default (merge kernel), whatever default_config picks later
        one = one_launch_configs(b, fp8, args.one_launch == 2) if args.one_launch else []
        xla_merge = [("triton_2launch", dict(default, merge="xla"))] if default["n_split"] > 1 else []
        cands = ([("triton_2launch", default)] + xla_merge + [("triton_1launch", c) for c in one]
                 + [("triton_2launch", c) for c in two_launch_sweep(b, fp8, args.sweep)])
        if args.profile:
            for impl, cfg in [("xla", {})] + cands:
                print(f"PROFILE {cache_name} B={b} {impl} {cfg}", flush=True)
                profile_once("xla" if impl == "xla" else "triton", data, **cfg)
            continue
        kt = bool(args.kernel_time)
        t_xla, k_xla, ref = time_op("xla", data, args.reps, args.iters, flush, kt)
        xla_trace = trace_micros(k_xla, "xla_")
        cell = [dict(op="sparse_mla", cache=cache_name, B=b, impl="xla", config=None, us=t_xla * 1e6,
                     xla_us=t_xla * 1e6, tb_s=nbytes / t_xla / 1e12, err=0.0, **trace_micros(k_xla),
                     **xla_trace)]
        for i, (impl, cfg) in enumerate(cands):
            if budget.spent() and i > 1:  # the default and the first one-launch config always run
                skipped.append(dict(cache=cache_name, B=b, impl=impl, config=cfg))
                continue
            try:
                t, k, out = time_op("triton", data, args.reps, args.iters, flush, kt and i < 2, **cfg)
            except Exception as e:  # a config that does not compile (shared memory, registers) is a result
                print(f"  {cache_name} B={b} {impl} {cfg}: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr,
                      flush=True)
                failed.append(dict(cache=cache_name, B=b, impl=impl, config=cfg, error=str(e)[:300]))
                continue
            cell.append(dict(op="sparse_mla", cache=cache_name, B=b, impl=impl, config=cfg, us=t * 1e6,
                             xla_us=t_xla * 1e6, tb_s=nbytes / t / 1e12, err=rel_err(out, ref), **trace_micros(k),
                             **xla_trace))
        for r_ in cell[1:]:
            kern = ("" if r_["kernel_us"] is None
                    else f" (kernels {r_['kernel_us']:.1f}, device {r_['device_us']:.1f})")
            print(f"  {cache_name:10s} B={b:3d} {r_['impl']:15s} {r_['us']:8.1f} us{kern}  err {r_['err']:.1e}  "
                  f"{ {k: v for k, v in r_['config'].items() if k != 'partial_dtype'} }", flush=True)
        ok = [r_ for r_ in cell if r_["err"] < 5e-2]  # a wrong result is never the best
        best = min(ok, key=lambda r_: r_["us"])
        line = (f"BEST sparse_mla {cache_name:10s} B={b:3d}  {best['impl']:15s} {best['us']:8.1f} us "
                f"{best['tb_s']:5.2f} TB/s ({100 * best['tb_s'] * 1e12 / peaks.hbm_bytes_per_s:4.1f}%)  "
                f"xla {t_xla * 1e6:8.1f} us  x{t_xla * 1e6 / best['us']:.2f}  {best['config']}  "
                f"[{budget.elapsed():.0f} s]")
        print(line, flush=True)
        best_lines.append(line)
        rows += cell
        del data
        write_json(args.out, record(rows, command=command_line(argv, script=__file__), roofline=peaks.name,
                                    method="(T(reps) - T(1)) / (reps - 1), cold L2 per run",
                                    reps=args.reps, iters=args.iters, skipped=skipped, failed=failed))
    print("\n".join(best_lines))


if __name__ == "__main__":
    main()
