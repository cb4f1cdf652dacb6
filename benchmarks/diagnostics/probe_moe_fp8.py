"""Probe of the FP8 routed-expert kernels at decode: correctness of each launch variant against the float32
reference, device time per variant, and (under Nsight Compute) each kernel's own time and DRAM traffic.

The experts are K-major FP8 stacks (the model's stored form: gate/up [E, I, D], down [E, D, I], each expert the
release's [out, in]) with random e4m3 bytes and block scales; the bf16 kernel runs over the same experts
dequantised, as the baseline. `--variants` is a JSON object {name: kernel overrides} (MoEConfig fields, `form`,
`swap_ab`); "bf16" is the bf16 kernel and "default" the FP8 default.

    PYTHONPATH=. python3 benchmarks/diagnostics/probe_moe_fp8.py --dims 6144,256,256 --batches 1,32,128      # times + checks
    ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        python3 benchmarks/diagnostics/probe_moe_fp8.py --dims 6144,256,256 --batches 32 --ncu default          # per kernel
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/diagnostics/probe_moe_fp8.py --dims 256,128,8 --batches 4 \\
        --impl triton_interpret --iters 1 --reps 2                                                   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_fp8_gemm import random_fp8
from benchmarks.harness import command_line, cu_profiler, device_peaks, op_device_time, record, write_json
from kernels import fp8_formats, moe

K_TOP = 8
DEFAULT_VARIANTS = {"bf16": {}, "default": {}}


def make_case(d: int, i: int, e: int, t: int, seed: int = 0, with_bf16: bool = True):
    """(x, experts, weights, nk stacks, nk scale keywords, bf16 [E, K, N] stacks or None) for T rows."""
    keys = jax.random.split(jax.random.key(seed), 3)
    fp8 = [random_fp8(kk, shape) for kk, shape in zip(keys, ((e, i, d), (e, i, d), (e, d, i)))]  # K-major
    stacks = [q for q, _ in fp8]
    scales = dict(wg_scale=fp8[0][1], wu_scale=fp8[1][1], wd_scale=fp8[2][1])
    bf16 = [jnp.swapaxes(fp8_formats.dequantize_weight_blocks(q, s, dtype=jnp.bfloat16), 1, 2)
            for q, s in fp8] if with_bf16 else None
    rng = np.random.default_rng(seed + t)
    x = jax.random.normal(jax.random.key(seed + 7 * t), (t, d), jnp.bfloat16)
    experts = jnp.asarray(np.stack([rng.choice(e, K_TOP, replace=False) for _ in range(t)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (t, K_TOP)), jnp.float32)
    return x, experts, w, stacks, scales, bf16


def runner(name: str, opts: dict, impl: str):
    """f(x, experts, weights, stacks, scales, bf16) running variant `name`; the weights are arguments (captured as
    constants, a 2.4 GB stack is embedded in the program and its compile takes minutes)."""
    opts = dict(opts)
    if name != "bf16":
        opts.setdefault("form", "w8a8")

    def f(x, experts, w, stacks, scales, bf16):
        if name == "bf16":
            return moe.routed_experts(x, experts, w, *bf16, impl=impl, **opts)
        return moe.routed_experts(x, experts, w, *stacks, impl=impl, w_layout="nk", **scales, **opts)
    return f


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="6144,256,256", help="hidden, expert width (this shard's), experts")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--variants", default=None, help="JSON {name: overrides}; default: bf16 and the FP8 default")
    ap.add_argument("--impl", default="triton")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ncu", default=None, help="run only this variant, once warm and once inside the ncu capture")
    ap.add_argument("--no-ref", action="store_true",
                    help="skip the float32 reference (it dequantises every expert: out of memory at TP = 1 widths)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    d, i, e = (int(v) for v in args.dims.split(","))
    variants = json.loads(args.variants) if args.variants else DEFAULT_VARIANTS
    batches = [int(v) for v in args.batches.split(",")]
    if args.ncu:
        for t in batches:
            case = make_case(d, i, e, t, with_bf16=args.ncu == "bf16")
            f = jax.jit(runner(args.ncu, variants.get(args.ncu, {}), args.impl))
            jax.block_until_ready(f(*case))
            jax.block_until_ready(f(*case))
            cu_profiler(True)
            jax.block_until_ready(f(*case))
            cu_profiler(False)
            print(f"ncu: variant {args.ncu} T={t} captured", flush=True)
        return
    peaks = device_peaks()
    rows = []
    for t in batches:
        case = make_case(d, i, e, t, with_bf16="bf16" in variants)  # 19 GB more at TP = 1: leave it out there
        x = case[0]
        used = len(np.unique(np.asarray(case[1])))
        want = None if args.no_ref else moe.routed_experts(x, case[1], case[2], *case[3], impl="xla", w_layout="nk",
                                                            **case[4])
        fp8_bytes = used * 3 * (d * i + 4 * (d // 128) * (i // 128))
        ref_default = None
        for name, opts in variants.items():
            row = {"T": t, "dims": [d, i, e], "experts_used": used, "variant": name, "overrides": opts}
            try:
                f = runner(name, opts, args.impl)
                args_ = case
                got = jax.jit(f)(*args_)
                row["rel_err"] = float("nan") if want is None else rel_err(got, want)
                if name == "default":
                    ref_default = got
                elif name != "bf16" and ref_default is not None:  # the same W8A8 arithmetic: ~0 apart
                    row["rel_err_vs_default"] = rel_err(got, ref_default)
                s = op_device_time(f, *args_, reps=args.reps, iters=args.iters)
                wbytes = fp8_bytes if name != "bf16" else used * 3 * d * i * 2
                row.update(us=round(1e6 * s, 2), tb_s=round(wbytes / s / 1e12, 3),
                           pct_hbm=round(100 * wbytes / s / peaks.hbm_bytes_per_s, 1))
            except Exception as exc:  # a variant that does not lower is that variant's row
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"{'T':>5} {'variant':<24} {'us':>9} {'TB/s':>6} {'%HBM':>5} {'rel_err':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['T']:>5} {r['variant']:<24} {r['error'][:80]}")
        else:
            print(f"{r['T']:>5} {r['variant']:<24} {r['us']:>9.1f} {r['tb_s']:>6.2f} {r['pct_hbm']:>5.1f} "
                  f"{r['rel_err']:>9.2e} {r.get('rel_err_vs_default', float('nan')):>9.2e}")
    if args.out:
        write_json(args.out, record(rows, command=command_line(argv, "benchmarks/diagnostics/probe_moe_fp8.py")))


if __name__ == "__main__":
    main()
