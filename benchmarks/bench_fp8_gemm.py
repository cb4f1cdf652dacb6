"""FP8 block-scaled GEMMs on the GPU: bf16 weights vs FP8 weights (W8A16 and W8A8) of the same random model.

Linear layers at GLM-5.2 TP = 8 shapes (kernels/fp8_linear/; weights [N, K]): q_a 6144 -> 2048 (replicated),
q_b 2048 -> 16384 / 8, o_proj 16384 / 8 -> 6144. The bf16 baseline is XLA's matmul (cuBLAS) on the same weights
dequantised to bf16; "xla_fp8" is the FP8 op's xla impl (the float32 reference). Routed experts
(kernels/moe/): 256 experts, hidden 6144, width 2048 (--moe_dims), top-8, uniform random routing: the bf16
grouped-GEMM kernel vs the FP8 W8A16 one, the xla form beside them (FP8 xla only up to 128 rows: it
dequantises every expert to float32).

Rows T in --batches (decode 1, 32, 128; prefill 8192). Each row: device time of one op (harness.op_device_time:
the op looped in one executable, so dispatch costs cancel), TB/s over the weight bytes read (the experts actually
used for the MoE; FP8: the e4m3 bytes plus scales) and % of the HBM peak, TFLOP/s, and the speed-up of each FP8
form over bf16. The Triton FP8 linear kernel runs its default config and a small budgeted config sweep (--budget_s
per shape and form; 0: defaults only); the best is reported with its config. MoE form "w8a8_nk": W8A8 over K-major
stacks (each expert [out, in], the scale grids in the same orientation: the model's stored form). Prints one
JSON line per measurement and writes the record to --out.

    PYTHONPATH=. python benchmarks/bench_fp8_gemm.py --out bench_fp8_gemm.json        # over 5 min on one H200
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/bench_fp8_gemm.py --impl triton_interpret --batches 1,16 \\
        --linear 256x384 --moe_dims 256,128,8 --iters 1 --budget_s 0                   # CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import budgeted_sweep, command_line, device_peaks, op_device_time, record, write_json
from kernels import fp8_formats, fp8_linear, moe
from kernels.fp8_linear import triton as fp8_linear_triton

LINEAR = {"q_a": (2048, 6144), "q_b": (2048, 2048), "o_proj": (6144, 2048)}  # name: (N, K) at TP = 8
K_TOP = 8


def random_fp8(key, shape):
    """Random finite e4m3 weights (no NaN codes) [..., rows, cols] and float32 block scales around 1e-3."""
    kq, kb, ks = jax.random.split(key, 3)
    bits = jax.random.randint(kq, shape, 0, 0x7F, jnp.uint8) | (jax.random.randint(kb, shape, 0, 2, jnp.uint8) << 7)
    grid = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    return (jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn),
            jax.random.uniform(ks, grid, jnp.float32, 0.5e-3, 2e-3))


def linear_configs(t: int):
    """Launch configs of the FP8 linear kernel to try at T rows, beside the default."""
    if t <= 128:
        bm = max(16, 1 << (t - 1).bit_length())
        for bn, ks, bk, w, st in itertools.product((64, 128, 256), (1, 4, 8, 16), (64, 128), (4, 8), (3, 5)):
            yield dict(bm=bm, bn=bn, k_split=ks, bk=bk, num_warps=w, num_stages=st)
    else:
        for bm, bn, bk, w, st in itertools.product((64, 128), (128, 256), (64, 128), (4, 8), (3, 4)):
            yield dict(bm=bm, bn=bn, bk=bk, k_split=1, num_warps=w, num_stages=st)


def moe_configs(t: int):
    """Grouped-GEMM launch configs to try for FP8 experts at T rows (both kernels take the same blocks), the
    likeliest first: decode streams weights (wide column blocks, deep pipelines, split-K for a few rows),
    prefill feeds the tensor cores from 64-128-row tiles."""
    tile = moe.tile_rows(t, K_TOP, 256)
    if tile >= 64:
        grid = itertools.product((128, 256), (128, 64), (8, 4), (3, 4), (1,))
    else:
        grid = itertools.product((128, 256, 64), (128, 64), (4, 8), (4, 3, 6), (1, 2, 4) if t <= 8 else (1,))
    cfgs = [dict(bn_up=bn, bn_down=bn, bk_up=bk, bk_down=bk, num_warps=w, num_stages=st, k_split=ks)
            for bn, bk, w, st, ks in grid]
    # breadth first over the leading choices: vary one field at a time away from the first before combining
    return sorted(cfgs, key=lambda c: sum(c[f] != cfgs[0][f] for f in c))


def moe_untied_configs(t: int):
    """Decode launch configs whose up and down kernels take different blocks (the up kernel streams D-long K
    loops, the down kernel I-long ones), around the K-major W8A8 default (128 x 128 blocks, 4 warps, 4 stages)."""
    grid = itertools.product((128, 64, 256), (128,), (128, 256, 64), (128, 64), (4, 8), (4, 3))
    cfgs = [dict(bn_up=bu, bk_up=ku, bn_down=bd, bk_down=kd, num_warps=w, num_stages=st, k_split=1)
            for bu, ku, bd, kd, w, st in grid]
    return sorted(cfgs, key=lambda c: sum(c[f] != cfgs[0][f] for f in c))


def _rates(res, s, wbytes, flops, peaks):
    return dict(us=1e6 * s, tb_s=wbytes / s / 1e12, pct_hbm=100 * wbytes / s / peaks.hbm_bytes_per_s,
                tflops=flops / s / 1e12)


def bench_linear(args, peaks, rows):
    """bf16 (XLA) vs FP8 W8A16 / W8A8 (Triton, xla reference) per linear shape and T, the FP8 weight in the
    model's [K, N] layout (w_layout "kn") unless --w-layout nk."""
    for name, (n, k) in args.linear.items():
        w_q, w_s = random_fp8(jax.random.key(n + k), (n, k))
        w_bf16 = fp8_formats.dequantize_weight_blocks(w_q, w_s, dtype=jnp.bfloat16).T  # [K, N], our bf16 layout
        if args.w_layout == "kn":
            w_q, w_s = w_q.T, w_s.T
        fp8_bytes = n * k + 4 * w_s.size
        for t in args.batches:
            x = jax.random.normal(jax.random.key(t), (t, k), jnp.bfloat16)
            flops = 2 * t * n * k
            base = op_device_time(jnp.matmul, x, w_bf16, iters=args.iters)
            res = {"op": "linear", "name": name, "N": n, "K": k, "T": t,
                   "bf16_xla": _rates({}, base, 2 * n * k, flops, peaks)}
            for form in fp8_linear.FORMS:
                def run(impl, **opts):
                    f = functools.partial(fp8_linear.fp8_linear, form=form, impl=impl, w_layout=args.w_layout, **opts)
                    return op_device_time(f, x, w_q, w_s, iters=args.iters)

                best = {"config": "default", "s": run(args.impl)}
                if args.budget_s > 0:
                    sweep = budgeted_sweep(linear_configs(t), lambda cfg: run(args.impl, **cfg), args.budget_s,
                                           min_measured=0, label=f"{name} T={t} {form}")
                    if sweep.measured and sweep.best()[1] < best["s"]:
                        best = {"config": sweep.best()[0], "s": sweep.best()[1]}
                cfg = fp8_linear_triton.default_config(t, n, k, form)
                res[form] = {**_rates({}, best["s"], fp8_bytes, flops, peaks), "config": best["config"],
                             "default": vars(cfg), "speedup_vs_bf16": base / best["s"]}
                res[f"xla_fp8_{form}"] = _rates({}, run("xla"), fp8_bytes, flops, peaks)
            print(json.dumps(res), flush=True)
            rows.append(res)


def bench_moe(args, peaks, rows):
    """bf16 vs FP8 grouped-GEMM routed experts (each form of --moe_forms), the xla forms beside them."""
    d, i, e = args.moe_dims
    keys = jax.random.split(jax.random.key(1), 3)
    fp8 = [random_fp8(kk, shape) for kk, shape in zip(keys, ((e, d, i), (e, d, i), (e, i, d)))]
    bf16 = [fp8_formats.dequantize_weight_blocks(q, s, dtype=jnp.bfloat16) for q, s in fp8]
    stacks = {"kn": [q for q, _ in fp8]}
    scales = dict(wg_scale=fp8[0][1], wu_scale=fp8[1][1], wd_scale=fp8[2][1])
    if "w8a8_nk" in args.moe_forms:  # K-major copies of the same bytes and their grids (the stored form), made once
        stacks["nk"] = [jnp.swapaxes(q, 1, 2) for q in stacks["kn"]]
        nk_scales = {n: jnp.swapaxes(s, 1, 2) for n, s in scales.items()}
    # force the uint16-word form on or off (the kernels' option; the xla forms take none)
    word_form = {} if args.moe_packed == "auto" else {"packed": args.moe_packed == "1"}
    rng = np.random.default_rng(0)
    for t in args.batches:
        x = jax.random.normal(jax.random.key(t), (t, d), jnp.bfloat16)
        experts = jnp.asarray(np.stack([rng.choice(e, K_TOP, replace=False) for _ in range(t)]), jnp.int32)
        w = jnp.asarray(rng.uniform(0.1, 1.0, (t, K_TOP)), jnp.float32)
        used = len(np.unique(np.asarray(experts)))
        flops = 2 * 3 * t * K_TOP * d * i
        res = {"op": "moe", "T": t, "experts_used": used, "dims": [d, i, e], "packed": args.moe_packed}

        def run(impl, ws, **kw):
            if kw.get("form") == "w8a8_nk":  # the W8A8 kernels over K-major stacks, grids in the same orientation
                f = functools.partial(moe.routed_experts, impl=impl,
                                      **dict(kw, form="w8a8", w_layout="nk", **nk_scales))
                ws = stacks["nk"]
            else:
                f = functools.partial(moe.routed_experts, impl=impl, **kw)
            return op_device_time(lambda xx, e, ww, *a: f(xx, e, ww, *a), x, experts, w, *ws, iters=args.iters)

        base = run(args.impl, bf16)
        res["bf16"] = _rates({}, base, used * 3 * d * i * 2, flops, peaks)
        if not args.no_xla:
            res["bf16_xla"] = _rates({}, run("xla", bf16), used * 3 * d * i * 2, flops, peaks)
        fp8_bytes = used * 3 * (d * i + 4 * fp8[0][1][0].size)
        for form in args.moe_forms:
            default_s = run(args.impl, stacks["kn"], form=form, **scales, **word_form)
            best = {"config": "default", "s": default_s}
            if args.moe_budget_s > 0:
                configs = moe_untied_configs(t) if args.moe_untied else moe_configs(t)
                sweep = budgeted_sweep(configs, lambda cfg: run(args.impl, stacks["kn"], form=form, **scales,
                                                                **word_form, **cfg),
                                       args.moe_budget_s, label=f"moe {form} T={t}")
                if sweep.measured and sweep.best()[1] < best["s"]:
                    best = {"config": sweep.best()[0], "s": sweep.best()[1]}
                best["measured"] = [[cfg, round(1e6 * s, 1)] for cfg, s in sweep.measured]  # [config, us]
            res[form] = {**_rates({}, best["s"], fp8_bytes, flops, peaks), "speedup_vs_bf16": base / best["s"],
                         "config": best["config"], "default_us": 1e6 * default_s,
                         **({"configs_measured": best["measured"]} if "measured" in best else {})}
        if t <= 128 and not args.no_xla:
            res["xla_fp8"] = _rates({}, run("xla", stacks["kn"], **scales), fp8_bytes, flops, peaks)
        print(json.dumps(res), flush=True)
        rows.append(res)


def main(argv=None):
    """The command line: linear rows, then MoE rows."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32,128,8192")
    ap.add_argument("--linear", default=",".join(f"{n}x{k}" for n, k in LINEAR.values()),
                    help="NxK shapes (default q_a, q_b, o_proj at TP = 8); '' for none")
    ap.add_argument("--moe_dims", default="6144,2048,256", help="hidden, expert width, experts; '' for none")
    ap.add_argument("--iters", type=int, default=5, help="timings of each looped executable (harness.device_time)")
    ap.add_argument("--w-layout", default="kn", choices=["kn", "nk"], help="FP8 linear weight layout (model: kn)")
    ap.add_argument("--budget_s", type=float, default=4.0, help="config sweep budget per shape, T and form")
    ap.add_argument("--impl", default="triton", help="triton_interpret for a CPU smoke run")
    ap.add_argument("--moe_forms", default="w8a16,w8a8",
                    help="FP8 expert forms (moe.routed_experts form; w8a8_nk: W8A8 over K-major stacks)")
    ap.add_argument("--moe_budget_s", type=float, default=0.0, help="FP8 expert config sweep budget per T and form")
    ap.add_argument("--no_xla", action="store_true", help="skip the xla rows (slow compiles)")
    ap.add_argument("--moe_untied", action="store_true",
                    help="sweep up and down kernel blocks separately (decode configs, moe_untied_configs)")
    ap.add_argument("--moe_packed", default="auto", choices=["auto", "0", "1"],
                    help="FP8 experts as uint16 words of two columns: auto (stacks of 2**31+ elements), 1, 0")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    names = {f"{n}x{k}": name for name, (n, k) in LINEAR.items()}
    args.linear = {names.get(s, s): tuple(int(v) for v in s.split("x")) for s in filter(None, args.linear.split(","))}
    args.moe_dims = tuple(int(v) for v in args.moe_dims.split(",")) if args.moe_dims else None
    args.moe_forms = [f for f in args.moe_forms.split(",") if f]
    peaks = device_peaks()
    rows = []
    bench_linear(args, peaks, rows)
    if args.moe_dims:
        bench_moe(args, peaks, rows)
    if args.out:
        write_json(args.out, record(rows, command=command_line(argv, script=__file__), roofline=peaks.name))


if __name__ == "__main__":
    main()
