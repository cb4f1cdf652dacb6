"""Fused q/kv norm + RoPE + cache write (docs/math.md §4) on the GPU: Pallas Triton launch configs vs the xla op.

GLM-5 dims: q_lora 2048, kv 512 + 64, indexer key 128; a full layer (indexer key written too, no top-k
buffer, as the model calls it); bf16 and fp8_ds_mla caches (the fp8 run uses the FP8 indexer cache too).
Slots: whole 64-token pages in random page order, 1 row in 16 has slot -1. Each timing is one jitted
executable that runs the op `reps` times on distinct input sets (so the inputs of one call are not in
the 60 MB L2 from the previous one, except at small T), the caches threaded through and donated; the
median over `iters` runs, divided by reps (the dispatch of the executable is included once).

Bytes that must move per token: read q_c (2 * 2048), write q (2 * 2048), read kv_c (2 * 576), write the
MLA row (1152 bf16 / 656 fp8), read the indexer key (2 * 128), write its row (256 / 132), read position
and slot (8): 11016 / 10396 B. TB/s = those bytes / time.

Ceilings timed beside the op (`--ceilings`, at the largest T): "copy" (a device copy moving the op's bytes:
read and write half of them each), "q_copy" (a copy of q_c: the q part's 8192 B per token), and
"q_norm_triton" (the q part alone, `kernels.fused_norm_rope.triton.q_norm_triton`, with the q fields of the configs).

Configs: `candidates(T)` (the default launch first). Rows {"op", "cache", "T", "impl", "config", "us",
"xla_us", "tb_s", "kernel_us", "device_us", "xla_kernel_us", "xla_device_us"} (the trace times, for xla and the
default launch: kernel time and device span per op from a profiler trace, without the host's dispatch) go to
--out (Triton rows also "mismatch": the fraction of q / cache elements off the xla op's after the timed runs,
which all write the same rows; a config above 1e-3 is reported WRONG and not ranked); the best config per
(T, cache) is printed.

    PYTHONPATH=. python3 benchmarks/bench_fused_norm_rope.py --out bench_fused_norm_rope.json --ceilings
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import (TraceTimes, command_line, device_peaks, median_seconds, record, trace_micros,
                                traced_times, write_json)
from kernels import fp8_formats as f8
from kernels import fused_norm_rope as fnr
from kernels.fused_norm_rope import triton as fnt

RQ, R, DR, DI = 2048, 512, 64, 128
PAGE = 64
REPS = {1: 64, 64: 32, 4096: 16, 65536: 3}
SMS = 132  # H200 SMs: persistent program counts are multiples of it


def candidates(T: int, fp8: bool = False) -> list[fnt.FusedNormRopeConfig]:
    """Launch configs timed at T, the default first. Few at small T (launch-bound); at T >= 4096 the layouts
    (split / fused / interleave / two_launch), rows per block, warps, and persistent programs whose loops
    pipeline their loads (num_stages 3)."""
    C = fnt.FusedNormRopeConfig
    out = [fnt.default_config(T, fp8)]
    if T < 4096:
        out += [C(1, 1, 4), C(1, 1, 2, layout="fused")]          # the old default (split), fewer warps
    elif T < 16384:
        out += [C(2, 2, 4), C(1, 1, 2), C(1, 1, 4, layout="fused"), C(2, 2, 4, layout="fused"),
                C(1, 2, 4, layout="interleave"), C(1, 1, 2, layout="two_launch", q_warps=8)]
    else:
        out += [
            C(2, 2, 4),                                      # the old default (split)
            C(1, 1, 2),                                      # v2's best split launch
            C(2, 2, 4, layout="fused"),                      # v1's best (one program does both parts)
            C(1, 1, 2, layout="fused"),                      # v1's best for fp8
            C(1, 1, 4, layout="fused"),
            C(2, 2, 8, layout="fused"),
            C(4, 4, 8, layout="fused"),
            C(1, 2, 4, layout="interleave"),
            C(2, 2, 4, layout="interleave"),
            C(1, 1, 2, layout="two_launch", q_warps=8),      # the q stream as Triton's layer-norm tutorial runs it
            C(2, 1, 2, layout="two_launch", q_warps=8, q_programs=8 * SMS, num_stages=3),
            C(2, 2, 4, layout="fused", q_programs=8 * SMS, cache_programs=8 * SMS, num_stages=3),
            C(4, 2, 4, layout="interleave", q_programs=4 * SMS, cache_programs=4 * SMS, num_stages=3),
        ]
    if fp8:  # 1-row cache blocks with FP8 caches are refused (they segfaulted Triton: FP8_MIN_CACHE_ROWS)
        out = [dataclasses.replace(c, cache_rows=max(c.cache_rows, fnt.FP8_MIN_CACHE_ROWS)) for c in out]
    return [c for i, c in enumerate(out) if c not in out[:i]]


def q_candidates(T: int) -> list[fnt.FusedNormRopeConfig]:
    """q-only launches (`q_norm_triton`) timed with --ceilings: rows per program, warps, persistent loops."""
    C = fnt.FusedNormRopeConfig
    return [C(1, 1, 4), C(1, 1, 8), C(2, 1, 8), C(4, 1, 8),
            C(2, 1, 8, num_stages=3, q_programs=8 * SMS), C(4, 1, 8, num_stages=3, q_programs=4 * SMS)]


def bytes_per_token(fp8: bool) -> int:
    """Bytes one token must move (module docstring)."""
    mla = f8.mla_row_bytes(R, DR) if fp8 else 2 * (R + DR)
    idx = f8.index_row_bytes(DI) if fp8 else 2 * DI
    return 2 * RQ * 2 + 2 * (R + DR) + mla + 2 * DI + idx + 8


def _cdiv(a, b):
    return -(-a // b)


def make_inputs(T, fp8, reps, seed=0):
    """`reps` distinct input sets of T tokens, the norm weights, and the MLA and indexer caches."""
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)
    n_pages = max(_cdiv(T, PAGE), 64) * 2
    S = n_pages * PAGE
    ks = jax.random.split(key, 8)
    bf = jnp.bfloat16
    sets = []
    for i in range(reps):
        k = jax.random.split(ks[0], reps)[i]
        k1, k2, k3 = jax.random.split(k, 3)
        pages = rng.permutation(n_pages)[:_cdiv(T, PAGE)]
        t = np.arange(T)
        slots = (pages[t // PAGE] * PAGE + t % PAGE).astype(np.int32)
        slots[rng.random(T) < 1 / 16] = -1
        sets.append(dict(
            q_c=jax.random.normal(k1, (T, RQ), bf) * 3,
            kv_c=jax.random.normal(k2, (T, R + DR), bf),
            index_k=jax.random.normal(k3, (T, DI), bf),
            positions=jnp.asarray(rng.integers(0, 100_000, T), jnp.int32),
            slot_mapping=jnp.asarray(slots)))
    weights = dict(q_norm_w=jax.random.normal(ks[1], (RQ,), bf) * 0.1 + 1,
                   kv_norm_w=jax.random.normal(ks[2], (R,), bf) * 0.1 + 1,
                   index_norm_w=jax.random.normal(ks[3], (DI,), bf) * 0.1 + 1,
                   index_norm_b=jax.random.normal(ks[4], (DI,), bf) * 0.1)
    if fp8:
        mla = jax.random.randint(ks[5], (S, f8.mla_row_bytes(R, DR)), 0, 256, jnp.int32).astype(jnp.uint8)
        idx = jax.random.randint(ks[6], (S, f8.index_row_bytes(DI)), 0, 256, jnp.int32).astype(jnp.uint8)
    else:
        mla = jax.random.normal(ks[5], (S, R + DR), bf)
        idx = jax.random.normal(ks[6], (S, DI), bf)
    return sets, weights, mla, idx


def build(impl, options):
    """A jitted runner of the op over every input set, the caches threaded through and donated."""
    @functools.partial(jax.jit, donate_argnums=(2, 3))
    def run(sets, weights, mla, idx):
        qs = []
        for s in sets:  # unrolled: every call reads its own buffers (no slicing copies)
            q, mla, idx, _ = fnr.fused_norm_rope_cache(
                s["q_c"], s["kv_c"], s["positions"], s["slot_mapping"], weights["q_norm_w"], weights["kv_norm_w"],
                mla, rope_theta=1e6, index_k=s["index_k"], index_norm_w=weights["index_norm_w"],
                index_norm_b=weights["index_norm_b"], index_cache=idx, impl=impl, **options)
            qs.append(q)
        return qs, mla, idx
    return run


def time_op(impl, options, data, iters, traced=False):
    """Seconds per op (the median of `iters` runs of `build`'s runner after one warm-up run, / the sets), the
    last run's (q outputs, MLA cache, indexer cache) and, when `traced`, the `harness.TraceTimes` per op (a
    profiler trace of 3 runs, / the sets: the device's time without the executable's host dispatch, which the
    wall figure spreads over the sets) or None."""
    sets, weights = data[0], data[1]
    run = build(impl, options)
    last = []

    def call():  # the donated caches live on in the outputs: each run feeds the next
        qs, data[2], data[3] = run(sets, weights, data[2], data[3])
        last[:] = [qs]
        return qs, data[2], data[3]
    t = median_seconds(call, warmup=1, reps=iters) / len(sets)
    tt = None
    if traced:
        try:
            tt = traced_times(call, runs=3)
            tt = TraceTimes(tt.kernel / len(sets), tt.span / len(sets))
        except Exception as e:  # noqa: BLE001 - no trace (CPU, no profiler): the wall figure stands alone
            print(f"  trace times failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    return t, (last[0], data[2], data[3]), tt  # the traced runs, if any, donated the earlier caches


@jax.jit
def _mismatch(got, want):
    """Fraction of elements outside tolerance: bf16 values beyond 2e-2 (1 + |want|), FP8 cache bytes that differ
    by more than 1 (e4m3 codes within 1 ULP; the GPU oracle's division is not IEEE)."""
    fr = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if g.dtype == jnp.uint8:
            bad = jnp.abs(g.astype(jnp.int32) - w.astype(jnp.int32)) > 1
        else:
            g, w = g.astype(jnp.float32), w.astype(jnp.float32)
            bad = jnp.abs(g - w) > 2e-2 * (1 + jnp.abs(w))
        fr.append(jnp.mean(bad.astype(jnp.float32)))
    return jnp.max(jnp.stack(fr))


def time_sets(fn, sets, iters):
    """Seconds per call of `fn(set)` over the input sets, in one executable (as `time_op`)."""
    run = jax.jit(lambda sets: [fn(s) for s in sets])
    return median_seconds(lambda: run(sets), warmup=1, reps=iters) / len(sets)


def main(argv=None):
    """The command line: every candidate's row per cache format and T, the best printed per (T, cache)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_fused_norm_rope.json")
    ap.add_argument("--tokens", default="1,64,4096,65536")
    ap.add_argument("--caches", default="bfloat16,fp8_ds_mla")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--default-only", action="store_true", help="time only the default launch (no sweep)")
    ap.add_argument("--configs", default=None,
                    help="comma-separated indices into the candidate list of each (T, cache) (0 = the default): "
                         "time only those (e.g. to find the launch that crashes a sweep, one process each)")
    ap.add_argument("--budget", type=float, default=200.0,
                    help="seconds: once spent, the remaining (T, cache) cells time the default launch only and the "
                         "ceilings are skipped (the run stays under about 4 minutes)")
    ap.add_argument("--ceilings", action="store_true",
                    help="at the largest T also time a copy of the same bytes, a copy of q_c and the q part alone")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    peaks = device_peaks(dev)
    print(f"device: {dev.device_kind}, jax {jax.__version__}", flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows, best, failed = [], [], []

    def add(cache, T, impl, config, t, t_xla, nbytes, traced=None, xla_traced=None):
        row = dict(op="fused_norm_rope", cache=cache, T=T, impl=impl,
                   config=None if config is None else dict(dataclasses.asdict(config), label=config.label()),
                   us=t * 1e6, xla_us=None if t_xla is None else t_xla * 1e6, tb_s=nbytes / t / 1e12,
                   **trace_micros(traced), **trace_micros(xla_traced, "xla_"))
        rows.append(row)
        return row

    # the largest T first (the target), both caches, so a spent budget cuts the small-T sweeps
    for T, cache in [(T, c) for T in sorted(tokens, reverse=True) for c in args.caches.split(",")]:
        fp8 = cache == "fp8_ds_mla"
        over = time.perf_counter() - t_start > args.budget
        data = list(make_inputs(T, fp8, REPS.get(T, 4)))
        nbytes = bytes_per_token(fp8) * T
        t_xla, ref, tt_xla = time_op("xla", {}, data, args.iters, traced=True)
        ref = jax.tree.map(jnp.copy, ref)  # the caches are donated to the next run: keep a copy
        add(cache, T, "xla", None, t_xla, t_xla, nbytes, tt_xla, tt_xla)
        measured = []
        cands = candidates(T, fp8)
        if args.configs is not None:
            cands = [cands[int(i)] for i in args.configs.split(",") if int(i) < len(cands)]
        for i, cfg in enumerate(cands[:1] if args.default_only or over else cands):
            try:
                t, out, tt = time_op("triton", {"config": cfg}, data, args.iters, traced=i == 0)
            except Exception as e:  # a launch Triton cannot compile is a result of the sweep, not an error
                failed.append(dict(T=T, cache=cache, config=cfg.label(), error=f"{type(e).__name__}: {str(e)[:500]}"))
                print(f"  T={T} {cache} {cfg.label()}: FAILED {failed[-1]['error'][:200]}", flush=True)
                continue
            row = add(cache, T, "triton", cfg, t, t_xla, nbytes, tt, tt_xla)
            # every run writes the same rows: the final caches and q equal the xla op's (within rounding)
            row["mismatch"] = float(_mismatch(out, ref))
            if row["mismatch"] <= 1e-3:
                measured.append(row)
            dev_us = "" if tt is None else f" (kernels {row['kernel_us']:.1f}, device {row['device_us']:.1f})"
            print(f"  T={T:6d} {cache:10s} {cfg.label():48s} {t * 1e6:9.1f} us{dev_us} {row['tb_s']:.2f} TB/s "
                  f"[{time.perf_counter() - t_start:.0f} s]"
                  + ("" if row["mismatch"] <= 1e-3 else f"  WRONG: {row['mismatch']:.2e} of elements off"), flush=True)
            del out
        if not measured:  # noted, and the other cells still run
            print(f"T={T:6d} {cache:10s} NO Triton launch ran and matched the xla op", flush=True)
            failed.append(dict(T=T, cache=cache, config=None, error="no launch ran and matched the xla op"))
        else:
            b = min(measured, key=lambda r: r["us"])
            best.append(b)
            print(f"T={T:6d} {cache:10s} xla {t_xla * 1e6:9.1f} us  best triton {b['us']:9.1f} us "
                  f"({b['tb_s']:.2f} TB/s, {100 * b['tb_s'] * 1e12 / peaks.hbm_bytes_per_s:.0f}% of "
                  f"{peaks.hbm_bytes_per_s / 1e12:g}) x{t_xla / (b['us'] * 1e-6):.2f}  {b['config']['label']}",
                  flush=True)
        if args.ceilings and T == max(tokens) and not fp8 and not over:
            sets = data[0]
            half = nbytes // 4  # bf16 elements: a copy reads and writes nbytes / 2 each
            xs = [jnp.full((half,), i, jnp.bfloat16) for i in range(len(sets))]
            t = time_sets(lambda x: -x, xs, args.iters)
            add(cache, T, "copy", None, t, None, nbytes)
            print(f"  ceiling: copy of {nbytes / 1e6:.0f} MB moved: {t * 1e6:.1f} us "
                  f"{nbytes / t / 1e12:.2f} TB/s", flush=True)
            del xs
            qsets = [s["q_c"] for s in sets]
            qbytes = 2 * RQ * 2 * T
            t = time_sets(lambda x: -x, qsets, args.iters)
            add(cache, T, "q_copy", None, t, None, qbytes)
            print(f"  ceiling: copy of q_c: {t * 1e6:.1f} us {qbytes / t / 1e12:.2f} TB/s", flush=True)
            w = data[1]["q_norm_w"]
            for cfg in q_candidates(T):
                try:
                    t = time_sets(lambda x, cfg=cfg: fnt.q_norm_triton(x, w, config=cfg), qsets, args.iters)
                except Exception as e:
                    failed.append(dict(T=T, cache=cache, config="q_norm " + cfg.label(),
                                       error=f"{type(e).__name__}: {str(e)[:500]}"))
                    print(f"  q_norm {cfg.label()}: FAILED {failed[-1]['error'][:200]}", flush=True)
                    continue
                add(cache, T, "q_norm_triton", cfg, t, None, qbytes)
                print(f"  q part alone {cfg.label():40s} {t * 1e6:9.1f} us {qbytes / t / 1e12:.2f} TB/s "
                      f"[{time.perf_counter() - t_start:.0f} s]", flush=True)
        del data, ref
    write_json(args.out, record(rows, command=command_line(argv, script=__file__), device=dev,
                                roofline=peaks.name, failed=failed, seconds=time.perf_counter() - t_start))
    print(f"\n| T | cache | xla us | triton us | TB/s | % of {peaks.hbm_bytes_per_s / 1e12:g} TB/s | speed-up "
          "| config |")
    print("|---|---|---|---|---|---|---|---|")
    for b in best:
        print(f"| {b['T']} | {b['cache']} | {b['xla_us']:.1f} | {b['us']:.1f} | {b['tb_s']:.2f} | "
              f"{100 * b['tb_s'] * 1e12 / peaks.hbm_bytes_per_s:.0f}% | {b['xla_us'] / b['us']:.2f}x | "
              f"{b['config']['label']} |")
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
