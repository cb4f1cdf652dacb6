"""Fused q/kv norm + RoPE + paged cache write (docs/math.md §4) on the GPU: Pallas Triton kernel vs the xla op.

GLM-5 dims: q_lora 2048, kv 512 + 64, indexer key 128; a full layer (indexer key written too, no top-k
buffer, as the model calls it); bf16 and fp8_ds_mla caches (the fp8 run uses the FP8 indexer cache too).
Slots: whole 64-token pages in random page order, 1 row in 16 has slot -1. Each timing is one jitted
executable that runs the op `reps` times on distinct input sets (so the inputs of one call are not in
the 60 MB L2 from the previous one, except at small T), the caches threaded through and donated; the
median over `iters` runs, divided by reps.

Bytes that must move per token: read q_c (2 * 2048), write q (2 * 2048), read kv_c (2 * 576), write the
MLA row (1152 bf16 / 656 fp8), read the indexer key (2 * 128), write its row (256 / 132), read position
and slot (8). Achieved bandwidth = those bytes / time; % of the device's HBM peak (`benchmarks.harness.device_peaks`:
4.8 TB/s, the H200 HBM3e datasheet).

    PYTHONPATH=. python3 benchmarks/bench_fused_norm_rope.py --out bench_fused_norm_rope.json [--sweep]
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import budgeted_sweep, command_line, device_peaks, median_seconds, record, write_json
from kernels import fp8_formats as f8
from kernels import fused_norm_rope as fnr

RQ, R, DR, DI = 2048, 512, 64, 128
PAGE = 64
REPS = {1: 64, 64: 32, 4096: 16, 65536: 3}
# launch options swept besides the default (kernels.fused_norm_rope_triton.default_config)
SWEEP = {
    4096: [dict(q_rows=2, cache_rows=2, num_warps=4)],
    65536: [dict(q_rows=1, cache_rows=1, num_warps=2),
            dict(q_rows=2, cache_rows=2, num_warps=4)],
}


def bytes_per_token(fp8: bool) -> int:
    """Bytes one token must move (module docstring)."""
    mla = f8.mla_row_bytes(R, DR) if fp8 else 2 * (R + DR)
    idx = f8.index_row_bytes(DI) if fp8 else 2 * DI
    return 2 * RQ * 2 + 2 * (R + DR) + mla + 2 * DI + idx + 8


def make_inputs(T, fp8, reps, seed=0):
    """`reps` distinct input sets of T tokens, the norm weights, and the MLA and indexer caches."""
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)
    n_pages = max(pl_cdiv(T, PAGE), 64) * 2
    S = n_pages * PAGE
    ks = jax.random.split(key, 8)
    bf = jnp.bfloat16
    sets = []
    for i in range(reps):
        k = jax.random.split(ks[0], reps)[i]
        k1, k2, k3 = jax.random.split(k, 3)
        pages = rng.permutation(n_pages)[:pl_cdiv(T, PAGE)]
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


def pl_cdiv(a, b):
    return -(-a // b)


def build(impl, reps, options):
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


def time_impl(impl, T, fp8, iters, options, data):
    """Seconds per op: the median of `iters` runs of `build`'s runner after one warm-up run, / the sets."""
    sets, weights = data[0], data[1]
    run = build(impl, len(sets), options)

    def call():  # the donated caches live on in the outputs: each run feeds the next
        qs, data[2], data[3] = run(sets, weights, data[2], data[3])
        return qs, data[2], data[3]
    return median_seconds(call, warmup=1, reps=iters) / len(sets)


def main(argv=None):
    """The command line: the best options' row per cache format and T (and each swept option's row)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_fused_norm_rope.json")
    ap.add_argument("--tokens", default="1,64,4096,65536")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="sweep (q_rows, cache_rows, num_warps) at --sweep-tokens")
    ap.add_argument("--sweep-tokens", default="4096,65536")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    peaks = device_peaks(dev)
    print(f"device: {dev.device_kind}, jax {jax.__version__}", flush=True)
    results = []
    for fp8 in (False, True):
        for T in [int(t) for t in args.tokens.split(",")]:
            reps = REPS.get(T, 4)
            data = list(make_inputs(T, fp8, reps))
            nbytes = bytes_per_token(fp8) * T
            t_xla = time_impl("xla", T, fp8, args.iters, {}, data)
            configs = [{}]
            if args.sweep and str(T) in args.sweep_tokens.split(","):
                configs += SWEEP.get(T, [])
            best = None
            # no time budget: every option runs; one Triton cannot compile is noted (FAILED) and skipped
            sweep = budgeted_sweep(configs, functools.partial(time_impl, "triton", T, fp8, args.iters, data=data),
                                   math.inf, label=f"T={T} fp8={fp8} FAILED", log=lambda s: print(s, flush=True))
            for opt, t in sweep.measured:
                rec = dict(T=T, cache="fp8_ds_mla" if fp8 else "bfloat16", options=opt, t_triton_us=t * 1e6,
                           t_xla_us=t_xla * 1e6, bytes=nbytes, tbps=nbytes / t / 1e12,
                           pct_peak=100 * nbytes / t / peaks.hbm_bytes_per_s, xla_tbps=nbytes / t_xla / 1e12,
                           speedup=t_xla / t)
                results.append(rec)
                if opt:
                    print(f"  sweep T={T} {rec['cache']} {opt}: {t * 1e6:.1f} us {rec['tbps']:.2f} TB/s", flush=True)
                if best is None or t < best["t_triton_us"] * 1e-6:
                    best = rec
            if best is None:
                raise RuntimeError(f"fused_norm_rope T={T} fp8={fp8}: no Triton launch ran: {sweep.failed}")
            best = dict(best, best=True)
            results.append(best)
            print(f"T={T:6d} {best['cache']:10s} xla {best['t_xla_us']:9.1f} us ({best['xla_tbps']:.2f} TB/s)  "
                  f"triton {best['t_triton_us']:9.1f} us ({best['tbps']:.2f} TB/s, {best['pct_peak']:.0f}% of "
                  f"{peaks.hbm_bytes_per_s / 1e12:g})  "
                  f"x{best['speedup']:.2f}  {best['options'] or 'default'}", flush=True)
            del data
    write_json(args.out, record(results, command=command_line(argv, script=__file__), device=dev,
                                jax=jax.__version__, roofline=peaks.name))
    print(f"\n| T | cache | xla us | triton us | TB/s | % of {peaks.hbm_bytes_per_s / 1e12:g} TB/s | speed-up "
          "| options |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if r.get("best"):
            print(f"| {r['T']} | {r['cache']} | {r['t_xla_us']:.1f} | {r['t_triton_us']:.1f} | {r['tbps']:.2f} | "
                  f"{r['pct_peak']:.0f}% | {r['speedup']:.2f}x | {r['options'] or 'default'} |")


if __name__ == "__main__":
    sys.exit(main())
