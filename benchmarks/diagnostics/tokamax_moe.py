"""The routed FP8 experts through tokamax's `ragged_dot` (the library weighed against our grouped-GEMM kernel):
the same function as `kernels.moe.routed_experts` over K-major FP8 stacks,
built from tokamax calls, for `probe_moe_fp8.py --variants '{"tokamax": {...}}'`.

tokamax (0.0.17) takes quantised weights as a `qwix.QArray`. On Hopper its Mosaic GPU kernel
(`pallas_mosaic_gpu_kernel_sm90_quant`) dequantises the weight tile in registers (W8A16: bf16 activations) and
accepts only per-output-column scales repeated over K-tiles of the block size (scale tile (1, bk, 1)); ours are
128 x 128 blocks. So `column_scales` expands each block scale over its 128 output columns, once, outside the timed op (a
load-time layout: 1/64 more bytes than the e4m3 weights in a 16-bit scale dtype, which is the dtype the kernel
dequantises and multiplies in). On the H200 (jax 0.11.2) the kernel cannot dequantise e4m3 to bf16 (Mosaic GPU:
"only cast from f8E4M3FN to f16 is supported" with this ptxas), so the working form is float16 scales and float16
activations (`dtype="float16"`): a float16 x and h differ from our bf16 ones by rounding, and overflow past 65504.

The op: sort the (token, expert) pairs by expert, gather x, gate and up as two ragged dots, SwiGLU in float32,
down as a third, then the weighted scatter-add, every step but the ragged dots in XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

def column_scales(stacks, scales, dtype=jnp.bfloat16):
    """The scales of the K-major stacks (gate/up [E, I, D], down [E, D, I]) as tokamax's kernel reads them: each
    128 x 128 block scale repeated over its 128 output columns, [E, K / 128, N] in `dtype` (one array a stack)."""
    out = []
    for w, s in zip(stacks, (scales["wg_scale"], scales["wu_scale"], scales["wd_scale"])):
        e, n, k = w.shape
        if n % 128 or k % 128:
            raise ValueError(f"tokamax_moe: stack {w.shape} is not whole 128-blocks")
        out.append(jnp.swapaxes(jnp.repeat(s, 128, axis=1), 1, 2).astype(dtype))
    return out


def qarray(w, col_scale):
    """A qwix QArray [E, K, N] over the K-major stack w [E, N, K]: the kernel reads its qvalue transposed back, so
    XLA folds the two transposes and the bytes are read as stored."""
    import qwix

    return qwix.QArray(qvalue=jnp.swapaxes(w, 1, 2), scale=col_scale, qtype=w.dtype)


def ragged_op(implementation: str = "mosaic_gpu", dtype: str = "bfloat16", **config):
    """A ragged dot [M, K] x QArray [G, K, N] -> [M, N] in `dtype` (the activations' and the scales' dtype: the
    result has it too) through tokamax: `implementation` one of its names
    ("mosaic_gpu", "triton", "xla"); `config` fields of its Mosaic GPU `Config` (block_m, block_n, block_k,
    num_stages, persistent, grid_minor_dim "m"/"n", grid_tile_width); none given: tokamax's heuristics."""
    import tokamax
    from tokamax._src.ops.ragged_dot import api

    impl = implementation
    if config:
        from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu, pallas_mosaic_gpu_common as common

        if implementation != "mosaic_gpu":
            raise ValueError(f"tokamax_moe: a config is for the mosaic_gpu implementation, not {implementation!r}")
        cfg = dict(block_m=64, block_n=64, block_k=128, num_stages=2, split_k=1, persistent=True,
                   grid_minor_dim="m", grid_tile_width=1)
        cfg.update(config)
        cfg["grid_minor_dim"] = {"m": common.MatmulDimension.M, "n": common.MatmulDimension.N}[cfg["grid_minor_dim"]]
        impl = pallas_mosaic_gpu.PallasMosaicGpuRaggedDot(config=common.Config(**cfg))
    elif implementation not in api.IMPLEMENTATIONS:
        raise ValueError(f"tokamax_moe: tokamax {tokamax.__version__} has no ragged_dot implementation "
                         f"{implementation!r} ({', '.join(api.IMPLEMENTATIONS)})")

    def dot(lhs, rhs, sizes):
        return tokamax.ragged_dot(lhs.astype(dtype), rhs, sizes, preferred_element_type=dtype,
                                  implementation=[impl])
    dot.dtype = jnp.dtype(dtype)
    return dot


def routed_experts(x, experts, weights, stacks, col_scales, dot):
    """float32 [T, D]: y[t] = sum_j w[t, j] down_e(silu(x gate_e) * x up_e), e = experts[t, j], with the three
    projections as `dot` (`ragged_op`) over the K-major stacks and their `column_scales`."""
    qg, qu, qd = (qarray(w, s) for w, s in zip(stacks, col_scales))
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=qg.shape[0]).astype(jnp.int32)
    xs = x.astype(dot.dtype)[token]
    g = dot(xs, qg, sizes).astype(jnp.float32)
    u = dot(xs, qu, sizes).astype(jnp.float32)
    h = (jax.nn.silu(g) * u).astype(dot.dtype)
    y = dot(h, qd, sizes).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((t, x.shape[1]), jnp.float32).at[token].add(y)
