"""Routed experts (kernels/moe/) on the GPU: the Pallas Triton grouped GEMMs against the xla forms.

GLM-5.2 widths: hidden 6144, expert width 2048, 256 experts, top-8, bf16 weights (19.3 GB), uniform random
routing. T in {1, 8, 32, 128} (decode) and a prefill chunk (8192 rows). Reports time (median of `iters`
calls of one jitted op, after a warm-up), effective TB/s over the weight bytes of the experts actually
used (the bytes a decode step must read; % of the device's HBM peak, `benchmarks.harness.device_peaks`),
TFLOP/s over the routed matmuls, and the speed-up over xla (the xla form rule "moe.xla_form" picks, and any extra
forms named in --xla_modes). The config sweep (--sweep 1) stops at each T's time budget and says what it skipped.

    PYTHONPATH=. python3 benchmarks/bench_moe.py --out bench_moe.json [--sweep 1]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import budgeted_sweep, command_line, device_peaks, record, timeit, write_json
from kernels import moe

D, I, E, K = 6144, 2048, 256, 8


def sweep_configs(t, e):
    """Kernel launch configs to try at T rows and E experts, beside the default."""
    tile = moe.tile_rows(t, K, e)
    tiles = sorted({tile, max(16, tile // 2), min(128, tile * 2)})
    splits = (1, 4, 8) if t <= 8 else (1,)  # split-K of the up projection when there are few tiles
    for ks, tl, bn, bk, w, s in itertools.product(splits, tiles, (64, 128), (64, 128), (4, 8), (3, 4)):
        yield dict(tile=tl, bn_up=bn, bk_up=bk, bn_down=bn, bk_down=bk, num_warps=w, num_stages=s, k_split=ks)


def main(argv=None):
    """The command line: one row per T."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,128,8192")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sweep", type=int, default=0, help="1: sweep kernel configs at each T")
    ap.add_argument("--budget_s", type=float, default=60.0, help="sweep time budget per T")
    ap.add_argument("--xla_modes", default="", help="extra xla forms to time, e.g. tiles,dense")
    ap.add_argument("--dims", default=f"{D},{I},{E}", help="hidden, expert width, experts (CPU smoke runs)")
    ap.add_argument("--impl", default="triton", help="triton_interpret for a CPU smoke run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    d, i, e = (int(v) for v in args.dims.split(","))
    peaks = device_peaks()

    key = jax.random.key(0)
    kg, ku, kd, kx = jax.random.split(key, 4)
    init = jax.jit(lambda k, s: (jax.random.normal(k, s, jnp.float32) * 0.02).astype(jnp.bfloat16),
                   static_argnums=1)
    wg, wu, wd = init(kg, (e, d, i)), init(ku, (e, d, i)), init(kd, (e, i, d))
    rng = np.random.default_rng(0)
    rows = []
    for t in (int(b) for b in args.batches.split(",")):
        x = init(kx, (t, d))
        experts = jnp.asarray(np.stack([rng.choice(e, K, replace=False) for _ in range(t)]), jnp.int32)
        w = jnp.asarray(rng.uniform(0.1, 1.0, (t, K)), jnp.float32)
        used = len(np.unique(np.asarray(experts)))
        wbytes = used * 3 * d * i * 2
        flops = 2 * 3 * t * K * d * i
        res = {"T": t, "experts_used": used, "weight_bytes": wbytes}

        def run(impl, mode=None, **opts):
            f = jax.jit(functools.partial(moe.routed_experts, impl=impl, mode=mode, **opts))
            return timeit(f, x, experts, w, wg, wu, wd, warmup=1, reps=args.iters)

        xla_mode = moe.pick_mode(t, K, e)
        res["xla"] = {xla_mode: run("xla")}
        for m in filter(None, args.xla_modes.split(",")):
            if m != xla_mode and not (m == "dense" and t > moe.DENSE_MAX_TOKENS):
                try:
                    res["xla"][m] = run("xla", m)
                except Exception as err:  # e.g. out of memory for dense at large T
                    res["xla"][m] = f"failed: {type(err).__name__}"
        best = {"config": "default", "s": run(args.impl)}
        if args.sweep:  # a budget per T, started after the default config ran
            sweep = budgeted_sweep(sweep_configs(t, e), lambda cfg: run(args.impl, **cfg), args.budget_s,
                                   min_measured=0, label=f"T={t}")
            if sweep.measured and sweep.best()[1] < best["s"]:
                best = {"config": sweep.best()[0], "s": sweep.best()[1]}
            res["sweep"] = {"measured": len(sweep.measured), "failed": len(sweep.failed),
                            "skipped": len(sweep.skipped)}
        res["triton"] = best
        xs = min(v for v in res["xla"].values() if isinstance(v, float))
        s = best["s"]
        res.update(us=1e6 * s, tb_s=wbytes / s / 1e12, pct_hbm=100 * wbytes / s / peaks.hbm_bytes_per_s,
                   tflops=flops / s / 1e12, speedup=xs / s, xla_us=1e6 * xs)
        print(json.dumps(res), flush=True)
        rows.append(res)
    if args.out:
        write_json(args.out, record(rows, command=command_line(argv, script=__file__), roofline=peaks.name))


if __name__ == "__main__":
    main()
