"""Sparse MLA (docs/math.md §5) on the GPU: the Pallas Triton kernel against the xla op, GLM-5 dims.

H=64 heads, rows [512 | 64], top-k 2048 indices per query row into a 32K-token context per request,
B in {1, 8, 32, 128} decode rows, bf16 and fp8_ds_mla caches. Each timing is one jitted executable that
runs the op `reps` times on different inputs (each rep reads its own cache region, so the data is
several times the 60 MB L2), median over `iters` runs / reps (`benchmarks.harness.per_op_time`). Reports
time, effective TB/s = bytes that must be read and written (gathered cache rows + q + o/lse) / time, % of the
device's HBM peak (`harness.device_peaks`: 4.8 TB/s on the H200), speed-up over xla.

    PYTHONPATH=. python3 benchmarks/bench_sparse_mla.py --out bench_sparse_mla.json [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp

from benchmarks.harness import Budget, budgeted_sweep, command_line, device_peaks, per_op_time, record, timeit
from benchmarks.harness import write_json
from kernels import fp8_formats, sparse_mla, sparse_mla_triton

H, R, DR, K, CTX = 64, 512, 64, 2048, 32768


def make_case(b, fp8, reps, seed=0):
    regions = max(b, 16)  # 32K-token regions: row r of rep i reads region (i * b + r) % regions; >= 16 (> L2)
    if fp8:  # a uint8 cache must stay under 2 GiB (triton_common.check_addressable): at most 99 regions
        regions = min(regions, (2**31 - 1) // (CTX * fp8_formats.mla_row_bytes(R, DR)))
    key = jax.random.PRNGKey(seed)
    k1, k2, k3, k4 = jax.random.split(key, 4)
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
    return cache, q, idx


def bytes_moved(b, fp8):
    row = fp8_formats.mla_row_bytes(R, DR) if fp8 else 2 * (R + DR)
    return b * K * row + b * H * (R + DR) * 2 + b * H * (R + 1) * 4 + b * K * 4


def make_runner(impl, reps, **opts):
    """A jitted runner of `reps` sparse MLA ops, op i on query set i (`make(n)` of `harness.per_op_time`)."""
    op = functools.partial(sparse_mla.sparse_mla, scale=(192 + 64) ** -0.5, kv_lora_rank=R, impl=impl, **opts)

    @jax.jit
    def run(cache, q, idx):
        return [op(q[i], cache, idx[i]) for i in range(reps)]

    return run


def sweep_configs(b, fp8, level):
    """Configs to try beside the default: level 0 none, 1 a focused grid, 2 a few candidates."""
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
    """The command line: one best-config row per format and B (and each swept config's amortised time)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--formats", default="bf16,fp8")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sweep", type=int, default=0,
                    help="0 none, 1 a grid, 2 a few candidates")
    ap.add_argument("--budget_s", type=float, default=150.0)
    ap.add_argument("--out", default="bench_sparse_mla.json")
    args = ap.parse_args(argv)
    budget = Budget(args.budget_s)  # one budget for the whole run: later B get the default config only
    results, skipped = [], []
    peaks = device_peaks()
    dev = jax.devices()[0].device_kind
    for fmt in args.formats.split(","):
        fp8 = fmt == "fp8"
        for b in [int(x) for x in args.batches.split(",")]:
            cache, q, idx = make_case(b, fp8, args.reps)
            nbytes = bytes_moved(b, fp8)
            data = (cache, q, idx)
            t_xla, _ = per_op_time(lambda n: make_runner("xla", n), data, args.reps, args.iters)
            default = sparse_mla_triton.default_config(b, H, K, fp8)  # a SparseMLAConfig: as keyword options
            default = dataclasses.asdict(default) if dataclasses.is_dataclass(default) else dict(default)
            configs = [default] + sweep_configs(b, fp8, args.sweep)
            # rank by the amortised time of `reps` ops (the same fixed cost for all)
            sweep = budgeted_sweep(configs, lambda cfg, data=data: timeit(
                make_runner("triton", args.reps, **cfg), *data, warmup=1, reps=args.iters) / args.reps,
                budget, label=f"{fmt} B={b}")
            results += [dict(op="sparse_mla", fmt=fmt, B=b, cfg=cfg, amortised_us=raw * 1e6)
                        for cfg, raw in sweep.measured]
            if sweep.skipped:
                skipped.append(dict(op="sparse_mla", fmt=fmt, B=b, configs=sweep.skipped))
            best = sweep.best()[0] if sweep.measured else None
            if best is not None:
                t, _ = per_op_time(lambda n: make_runner("triton", n, **best), data, args.reps, args.iters)
                best = dict(op="sparse_mla", fmt=fmt, B=b, cfg=best, t_us=t * 1e6, xla_us=t_xla * 1e6,
                            tbps=nbytes / t / 1e12, pct=100 * nbytes / t / peaks.hbm_bytes_per_s, speedup=t_xla / t,
                            bytes=nbytes, device=dev, best=True)
                results.append(best)
                print(f"sparse_mla {fmt:5s} B={b:4d}  triton {best['t_us']:8.1f} us  {best['tbps']:5.2f} TB/s "
                      f"({best['pct']:4.1f}%)  xla {best['xla_us']:8.1f} us  x{best['speedup']:.1f}  {best['cfg']}",
                      flush=True)
            del cache, q, idx
            write_json(args.out, record(results, command=command_line(argv, script=__file__), skipped=skipped,
                                        roofline=peaks.name))


if __name__ == "__main__":
    main()
