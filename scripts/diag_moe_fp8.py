"""GPU diagnostic: the FP8 grouped-GEMM MoE against its bf16 kernel on the dequantised experts, over expert stacks of
growing size and a few launch options, printing the NaN fraction and relative error of each (or the error it hit).
It located the int32 offset overflow of 2-4 GB e4m3 stacks (BENCHMARKS.md, "FP8 weights").

    PYTHONPATH=. python3 scripts/diag_moe_fp8.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels import fp8_formats
from kernels.moe import triton as moe_triton


def case(n_exp, d, i, k, t, seed=0, **opts):
    """One stack of `n_exp` random e4m3 experts (d x i), T rows routed to k each."""
    keys = jax.random.split(jax.random.key(seed), 6)
    qs, ss = [], []
    for j, shape in enumerate(((n_exp, d, i), (n_exp, d, i), (n_exp, i, d))):
        bits = jax.random.randint(keys[j], shape, 0, 0x7F, jnp.uint8) | jnp.uint8(0x80 * (j % 2))
        qs.append(jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn))
        grid = (n_exp, -(-shape[1] // 128), -(-shape[2] // 128))
        ss.append(jax.random.uniform(keys[3 + j], grid, jnp.float32, 0.5e-4, 2e-4))
    rng = np.random.default_rng(seed)
    experts = jnp.asarray(np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
    x = jax.random.normal(keys[5], (t, d), jnp.bfloat16)
    run = jax.jit(functools.partial(moe_triton.grouped_swiglu, **opts))
    got = run(x, experts, w, *qs, wg_scale=ss[0], wu_scale=ss[1], wd_scale=ss[2])
    deq = [fp8_formats.dequantize_weight_blocks(q, s, dtype=jnp.bfloat16) for q, s in zip(qs, ss)]
    ref = jax.jit(moe_triton.grouped_swiglu)(x, experts, w, *deq)
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    rel = np.linalg.norm(np.nan_to_num(got) - ref) / np.linalg.norm(ref)
    print(dict(n_exp=n_exp, d=d, i=i, k=k, t=t, **opts), "nan_frac", round(float(np.isnan(got).mean()), 3),
          "rel", float(rel), flush=True)


if __name__ == "__main__":
    for shape in [(8, 256, 256, 2, 1), (16, 512, 256, 4, 4), (256, 6144, 2048, 8, 1), (256, 6144, 2048, 8, 32)]:
        for opts in ({}, {"num_stages": 1}, {"bk_up": 64, "bk_down": 64}, {"k_split": 2}):
            try:
                case(*shape, **opts)
            except Exception as e:  # a kernel fault: say which case and go on
                print(shape, opts, "ERROR", type(e).__name__, str(e)[:300], flush=True)
