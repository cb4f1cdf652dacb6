"""The Mosaic GPU W8A8 grouped GEMM (kernels/fp8_gemm) at GLM-5.2 widths against its baselines, in one run.

Shapes (256 experts, top-8, hidden 6144, expert width 2048; uniform random routing):
  prefill, TP = 1, 8192 tokens (65536 routed rows): gate+up [rows, 6144] x [4096, 6144]^T per expert, and down
    [rows, 2048] x [6144, 2048]^T;
  decode, TP = 8 shard (width 256), T = 32 and 128: gate+up N = 512, K = 6144; down N = 6144, K = 256.
Each grouped GEMM runs a few configs; the rows name each. Baselines in the same process: XLA's bf16 matmul of the
same FLOPs (prefill: one dense [rows, K] x [K, N]; decode: `jax.lax.ragged_dot` in bf16 at the same groups), XLA's
e4m3 x e4m3 dot (per-tensor, no block scales) where it compiles, the activation quantisation (`quantize_rows`) alone,
and the repo's Triton W8A8 MoE (kernels/moe.py impl "triton", form "w8a8", K-major experts: gate/up and down
together, against the sum of our two GEMMs).

Times are device time from CUPTI (`jax.experimental.mosaic.gpu.profiler.measure`), the median of --iters calls:
device_us sums every kernel of the call (the kernel plus the wrapper's small scale transposes), kernel_us the
longest kernel alone. TF/s count the real rows (not the tile padding); hbm_fraction is the bytes the op must read
(the used experts' e4m3 weights and scales, the e4m3 rows) over the time, over 4.8 TB/s.
Writes moe.json-schema rows (DESIGN.md) to --out.

    PYTHONPATH=. python benchmarks/bench_fp8_gemm_mosaic.py --out fp8_gemm_mosaic.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from kernels import fp8_gemm
from kernels.fp8_gemm import Fp8GemmConfig

E, TOPK, D, I = 256, 8, 6144, 2048
HBM = 4.8e12
E4M3 = jnp.float8_e4m3fn
ROWS = []
RECORD = {}


def emit(**row):
    """Print the row and rewrite the record with it, so a run cut short still leaves its rows."""
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    if RECORD.get("path"):
        with open(RECORD["path"], "w") as fh:
            json.dump({k: v for k, v in RECORD.items() if k != "path"} | {"rows": ROWS}, fh, indent=1)


def measure(f, *args, iters):
    """(median device seconds of all kernels, median seconds of the longest kernel) over `iters` calls."""
    from jax.experimental.mosaic.gpu import profiler
    jax.block_until_ready(f(*args))
    _, per = profiler.measure(f, aggregate=False, iterations=iters)(*args)
    total = statistics.median(sum(t for _, t in it) for it in per) * 1e-3
    longest = statistics.median(max(t for _, t in it) for it in per) * 1e-3
    return total, longest


def name(cfg):
    return (f"tm{cfg.tile_m}_tn{cfg.tile_n}_s{cfg.stages}" + ("_swap" if cfg.swap_ab else "")
            + ("_swiglu" if cfg.swiglu else "") + (f"_msub{cfg.m_sub}" if cfg.m_sub > 1 else ""))


def random_e4m3(key, shape):
    """Random e4m3 bytes (NaN codes replaced), drawn as uint32 words: uint8 draws build a 4x larger array first,
    which for the 6.4 GB gate/up stack ran out of memory on an H100."""
    *lead, last = shape
    b = jax.lax.bitcast_convert_type(jax.random.bits(key, (*lead, last // 4), jnp.uint32), jnp.uint8)
    b = b.reshape(shape)
    return jax.lax.bitcast_convert_type(jnp.where((b & 0x7F) == 0x7F, b ^ 0x01, b), E4M3)


def routing(key, t):
    """experts [t, 8] distinct per row, uniform; group sizes [E]."""
    experts = jnp.argsort(jax.random.uniform(key, (t, E)), axis=1)[:, :TOPK].astype(jnp.int32)
    return experts, jnp.bincount(experts.reshape(-1), length=E).astype(jnp.int32)


def grouped_case(tag, stage, sizes, n, k, configs, *, tp, iters, key, check):
    """Our kernel at each config on rows grouped by `sizes`; returns the best device seconds."""
    rows = int(np.asarray(sizes).sum())
    ks = jax.random.split(key, 3)
    w_q = random_e4m3(ks[0], (E, n, k))
    w_s = jax.random.uniform(ks[1], (E, n // 128, k // 128), jnp.float32, 2.0 ** -12, 2.0 ** -6)
    used = int((np.asarray(sizes) > 0).sum())
    flops = 2.0 * rows * n * k
    best = None
    for cfg in configs:
        try:
            m_tiles = -(-rows // cfg.tile_m) + E - 1
            _, tg = fp8_gemm.group_layout(sizes, cfg.tile_m, m_tiles)
            x = jax.random.normal(ks[2], (m_tiles * cfg.tile_m, k), jnp.bfloat16)
            a_q, s_a = jax.jit(fp8_gemm.quantize_rows)(x)
            del x
            f = jax.jit(lambda a, sa, w, sw, t, cfg=cfg: fp8_gemm.grouped_matmul(a, sa, w, sw, t, impl="mosaic",
                                                                               config=cfg))
            if check:
                out = np.asarray(f(a_q, s_a, w_q, w_s, tg)[:cfg.tile_m * 2].astype(jnp.float32), np.float64)
                rg = np.asarray(fp8_gemm.row_groups(tg, cfg.tile_m))[:cfg.tile_m * 2]
                ref = fp8_gemm.oracle(a_q[:cfg.tile_m * 2], s_a[:cfg.tile_m * 2], w_q, w_s, rg)
                if cfg.swiglu:
                    ref = fp8_gemm.swiglu_interleaved(ref)
                err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            else:
                err = None
            t, kt = measure(f, a_q, s_a, w_q, w_s, tg, iters=iters)
            read = used * n * k * (1 + 4 / 128 / 128) + rows * k * (1 + 4 / 128)
            emit(op=f"fp8_grouped_gemm_{tag}", stage=stage, weights="fp8", rows=rows, tp=tp, impl="mosaic",
                 config=name(cfg), N=n, K=k, device_us=t * 1e6, kernel_us=kt * 1e6, tflops=flops / t / 1e12,
                 hbm_fraction=read / t / HBM, rel_err_first_tiles=err)
            if best is None or t < best:
                best = t
            del a_q, s_a
        except Exception as e:  # a config that fails to compile or run is reported, not fatal
            traceback.print_exc()
            emit(op=f"fp8_grouped_gemm_{tag}", stage=stage, impl="mosaic", error=repr(e)[:300], config=name(cfg))
    return best


def baselines_dense(tag, rows, n, k, *, iters, key):
    ks = jax.random.split(key, 2)
    x = jax.random.normal(ks[0], (rows, k), jnp.bfloat16)
    w = jax.random.normal(ks[1], (k, n), jnp.bfloat16)
    t, _ = measure(jax.jit(lambda a, b: a @ b), x, w, iters=iters)
    emit(op=f"dense_gemm_{tag}", weights="bf16", rows=rows, impl="xla_bf16_dense", N=n, K=k, device_us=t * 1e6,
         tflops=2.0 * rows * n * k / t / 1e12)
    t, _ = measure(jax.jit(fp8_gemm.quantize_rows), x, iters=iters)
    emit(op=f"quantize_rows_{tag}", rows=rows, K=k, impl="xla", device_us=t * 1e6,
         hbm_fraction=rows * k * (2 + 1 + 4 / 128) / t / HBM)
    try:
        xq = x.astype(E4M3)
        wq = w.T.astype(E4M3)
        f = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                     preferred_element_type=jnp.bfloat16))
        t, _ = measure(f, xq, wq, iters=iters)
        emit(op=f"dense_gemm_{tag}", weights="fp8_per_tensor", rows=rows, impl="xla_e4m3_dense", N=n, K=k,
             device_us=t * 1e6, tflops=2.0 * rows * n * k / t / 1e12)
    except Exception as e:
        emit(op=f"dense_gemm_{tag}", impl="xla_e4m3_dense", error=repr(e)[:300])


def ragged_bf16(tag, sizes, n, k, *, iters, key):
    try:
        rows = int(np.asarray(sizes).sum())
        ks = jax.random.split(key, 2)
        x = jax.random.normal(ks[0], (rows, k), jnp.bfloat16)
        w = jax.random.normal(ks[1], (E, k, n), jnp.bfloat16)
        f = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g))
        t, _ = measure(f, x, w, sizes, iters=iters)
        used = int((np.asarray(sizes) > 0).sum())
        emit(op=f"ragged_dot_{tag}", weights="bf16", rows=rows, impl="xla_bf16_ragged_dot", N=n, K=k,
             device_us=t * 1e6, tflops=2.0 * rows * n * k / t / 1e12,
             hbm_fraction=(used * n * k * 2 + rows * k * 2) / t / HBM)
    except Exception as e:
        emit(op=f"ragged_dot_{tag}", impl="xla_bf16_ragged_dot", error=repr(e)[:300])


def triton_moe(t_rows, width, tp, *, iters, key, op):
    """The repo's Triton W8A8 MoE (gate/up + SwiGLU + down + combine) at this shape."""
    try:
        from kernels import moe
        ks = jax.random.split(key, 8)
        experts, sizes = routing(ks[0], t_rows)
        weights = jax.random.uniform(ks[1], (t_rows, TOPK), jnp.float32)
        x = jax.random.normal(ks[2], (t_rows, D), jnp.bfloat16)
        wg, wu = random_e4m3(ks[3], (E, width, D)), random_e4m3(ks[4], (E, width, D))
        wd = random_e4m3(ks[5], (E, D, width))
        sg = jax.random.uniform(ks[6], (E, width // 128, D // 128), jnp.float32, 2.0 ** -12, 2.0 ** -6)
        sd = jax.random.uniform(ks[7], (E, D // 128, width // 128), jnp.float32, 2.0 ** -12, 2.0 ** -6)
        f = jax.jit(lambda x, ex, w, a, b, c, s1, s2, s3: moe.routed_experts(
            x, ex, w, a, b, c, impl="triton", wg_scale=s1, wu_scale=s2, wd_scale=s3, w_layout="nk", form="w8a8"))
        t, _ = measure(f, x, experts, weights, wg, wu, wd, sg, sg, sd, iters=iters)
        used = int((np.asarray(sizes) > 0).sum())
        read = used * 3 * width * D * (1 + 4 / 128 / 128)
        emit(op=op, weights="fp8", rows=t_rows, tp=tp, impl="triton_w8a8", device_us=t * 1e6,
             tflops=2.0 * t_rows * TOPK * 3 * width * D / t / 1e12, hbm_fraction=read / t / HBM)
        return t
    except Exception as e:
        traceback.print_exc()
        emit(op=op, impl="triton_w8a8", error=repr(e)[:300])
        return None


def decode(args, key, t0):
    """Decode rows at the TP = 8 shard: our two GEMMs, XLA's bf16 ragged_dot, the Triton W8A8 MoE."""
    width = I // 8
    for t_rows in (32,) if args.quick else (32, 128):
        _, sizes = routing(jax.random.fold_in(key, t_rows), t_rows)
        tms = ((8,) if args.quick else (8, 16)) if t_rows == 32 else (16, 32)
        up = grouped_case("gate_up", "decode", sizes, 2 * width, D,
                          [Fp8GemmConfig(tile_m=tm, tile_n=128, stages=s, swap_ab=True)
                           for tm in tms for s in (8,)],
                          tp=8, iters=args.iters, key=key, check=True)
        down = grouped_case("down", "decode", sizes, D, width,
                            [Fp8GemmConfig(tile_m=tm, tile_n=128, stages=2, swap_ab=True) for tm in tms],
                            tp=8, iters=args.iters, key=key, check=True)
        ragged_bf16("gate_up", sizes, 2 * width, D, iters=args.iters, key=key)
        if up and down:
            used = int((np.asarray(sizes) > 0).sum())
            read = used * 3 * width * D * (1 + 4 / 128 / 128)
            emit(op="moe_decode", weights="fp8", rows=t_rows, tp=8, impl="mosaic_gemms_only",
                 device_us=(up + down) * 1e6, hbm_fraction=read / (up + down) / HBM)
        print("elapsed", time.time() - t0, flush=True)


def triton_baselines(args, key, t0, parts):
    """The Triton W8A8 MoE at the decode and prefill shapes (last: its compiles are the slowest part)."""
    if "decode" in parts:
        for t_rows in (32, 128):
            triton_moe(t_rows, I // 8, 8, iters=args.iters, key=key, op="moe_decode")
            print("elapsed", time.time() - t0, flush=True)
    if "prefill" in parts:
        triton_moe(8192, I, 1, iters=args.iters, key=key, op="moe_prefill")
        print("elapsed", time.time() - t0, flush=True)


def main(argv: list[str] | None = None):
    """Time the W8A8 grouped GEMM and its baselines at GLM-5.2 widths; write the rows to --out."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="fp8_gemm_mosaic.json")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--only", default="prefill,decode")
    p.add_argument("--quick", action="store_true", help="one config per GEMM, decode at T = 32 only, no Triton")
    args = p.parse_args(argv)
    key = jax.random.key(0)
    dev = jax.devices()[0].device_kind
    print("device", dev, "jax", jax.__version__, flush=True)
    parts = args.only.split(",")
    RECORD.update(path=args.out, date=time.strftime("%Y-%m-%d"), device=dev, jax=jax.__version__,
                  command="python benchmarks/bench_fp8_gemm_mosaic.py " + " ".join(
                      f"--{k} {v}" for k, v in vars(args).items() if k != "out"))
    t0 = time.time()
    if "prefill" in parts:
        t_rows = 8192
        _, sizes = routing(jax.random.fold_in(key, t_rows), t_rows)
        up = grouped_case("gate_up", "prefill", sizes, 2 * I, D,
                          [Fp8GemmConfig(tile_n=128, stages=4), Fp8GemmConfig(tile_n=256, stages=3, swiglu=True),
                           Fp8GemmConfig(tile_m=256, tile_n=128, stages=3, m_sub=2)][:2 if args.quick else 3],
                          tp=1, iters=args.iters, key=key, check=True)
        down = None if args.quick else grouped_case("down", "prefill", sizes, D, I,
                            [Fp8GemmConfig(tile_n=128, stages=4)],
                            tp=1, iters=args.iters, key=key, check=True)
        print("elapsed", time.time() - t0, flush=True)
        baselines_dense("gate_up", t_rows * TOPK, 2 * I, D, iters=args.iters, key=key)
        if up and down:
            emit(op="moe_prefill", weights="fp8", rows=t_rows, tp=1, impl="mosaic_gemms_only",
                 device_us=(up + down) * 1e6, tflops=2.0 * t_rows * TOPK * 3 * I * D / (up + down) / 1e12)
    if "decode" in parts:
        decode(args, key, t0)
    if not args.quick:
        triton_baselines(args, key, t0, parts)
    print("done", time.time() - t0, flush=True)


if __name__ == "__main__":
    main()
