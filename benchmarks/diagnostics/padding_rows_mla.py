"""What padding rows cost sparse MLA (the Mosaic kernel and its merge) in a batch-invariant decode step: B real rows
alone against the same rows among padding rows (every index -1) in a fixed 256-row step, GLM-5 dims (H 64, rows
512 + 64, top-k 2048 of a 32K context), fp8_ds_mla and bf16 caches. Rows printed per cache:

- alone_default: B rows, the default launch config for B rows (what the default mode runs);
- alone_inv: B rows with the batch-invariant decode step's config (`INVARIANT_CONFIG_ROWS` rows: 2 splits);
- padded_inv: the B rows plus 256 - B padding rows, the invariant config, empty splits skipped (the product);
- padded_inv_noskip: the same with every split run in full (the kernel before it skipped empty splits).

Device time per op from a profiler trace (`harness.per_op_traced_times`: reps ops in one executable, minus one op),
the kernel and its Triton merge together; wall-clock per op where the trace fails. The real rows' outputs are
checked bit for bit between alone_inv and padded_inv (and padded_inv_noskip).

    PYTHONPATH=. python3 benchmarks/diagnostics/padding_rows_mla.py --rows 32 --step-rows 256
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import traced_times_or_none
from kernels import fp8_formats, registry
from kernels.sparse_mla import mosaic

H, R, DR, K, CTX = 64, 512, 64, 2048, 32768
SCALE = (192 + 64) ** -0.5


def _case(b, step_rows, fp8, reps, seed=0):
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    regions = min(b, 16)
    n = regions * CTX
    if fp8:
        cache = jax.jit(fp8_formats.quantize_mla_rows)(jax.random.normal(k1, (n, R), jnp.bfloat16),
                                                       jax.random.normal(k2, (n, DR), jnp.bfloat16))
    else:
        cache = jax.random.normal(k1, (n, R + DR), jnp.bfloat16)
    qs = tuple(jax.random.normal(jax.random.fold_in(k3, i), (step_rows, H, R + DR), jnp.bfloat16) for i in range(reps))
    a = 2 * jax.random.randint(k4, (b, 1), 0, CTX // 2) + 1  # distinct positions per row: (a j + c) mod 32K, a odd
    pos = (a * jnp.arange(K)[None, :] + 7 * jnp.arange(b)[:, None]) % CTX
    idx = ((jnp.arange(b)[:, None] % regions) * CTX + pos).astype(jnp.int32)
    idx = jnp.concatenate([idx, jnp.full((step_rows - b, K), -1, jnp.int32)])
    jax.block_until_ready((cache, qs, idx))
    return cache, qs, idx


def _op(rows, config, skip_empty):
    def f(q, cache, idx):
        return mosaic._run(q[:rows], cache, idx[:rows], scale=SCALE, kv_lora_rank=R, config=config, interpret=False,
                           return_partials=False, hooks=mosaic.Hooks(), skip_empty=skip_empty)
    return f


def _time(op, cache, qs, idx, reps):
    def make(n):
        return jax.jit(lambda qs_, c, i: [op(qs_[j], c, i) for j in range(n)])
    tt = traced_times_or_none(make, (qs, cache, idx), reps)
    if tt is not None:
        return tt.kernel * 1e6, tt.span * 1e6
    f = make(reps)
    jax.block_until_ready(f(qs, cache, idx))
    t0 = time.perf_counter()
    for _ in range(5):
        jax.block_until_ready(f(qs, cache, idx))
    return None, (time.perf_counter() - t0) / 5 / reps * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--step-rows", type=int, default=256)
    ap.add_argument("--caches", default="fp8_ds_mla,bf16")
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args(argv)
    b, t = args.rows, args.step_rows
    inv_rows = registry.INVARIANT_CONFIG_ROWS
    for name in args.caches.split(","):
        fp8 = name == "fp8_ds_mla"
        cache, qs, idx = _case(b, t, fp8, args.reps)
        inv = mosaic.default_config(inv_rows, K, fp8)
        cases = {"alone_default": (b, mosaic.default_config(b, K, fp8), True),
                 "alone_inv": (b, inv, True), "padded_inv": (t, inv, True), "padded_inv_noskip": (t, inv, False)}
        outs = {}
        for case, (rows, cfg, skip) in cases.items():
            op = _op(rows, cfg, skip)
            o, lse = jax.jit(op)(qs[0], cache, idx)
            outs[case] = (np.asarray(o[:b]), np.asarray(lse[:b]))
            kern, span = _time(op, cache, qs, idx, args.reps)
            kern_s = f"{kern:8.1f}" if kern is not None else "       —"
            print(f"{name:10s} B={b:3d} rows={rows:3d} n_split={cfg.n_split} {case:18s} kernel_us {kern_s}  "
                  f"device_us {span:8.1f}", flush=True)
        for case in ("padded_inv", "padded_inv_noskip"):
            same = all(np.array_equal(x.view(np.uint32), y.view(np.uint32))
                       for x, y in zip(outs[case], outs["alone_inv"]))
            print(f"{name:10s} real rows of {case} bit for bit alone_inv: {same}", flush=True)


if __name__ == "__main__":
    main()
