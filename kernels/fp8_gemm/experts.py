"""Routed SwiGLU experts through the W8A8 grouped GEMM (SPEC §11), registry-free, for the MoE layer to call.

y[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = experts[t, j], with x quantised per row per 128
channels once (before the gather, so T rows are quantised, not T x k), the (token, expert) pairs placed in
tile-aligned groups (`reference.group_layout`), gate+up by one GEMM with the SwiGLU epilogue (the config's
swiglu) over `interleave_gate_up` weights, h quantised per row per 128 channels (from its bf16 value), the down
GEMM in float32 and the weighted combine in XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import Fp8GemmConfig
from .reference import FP8, group_layout, quantize_rows


def pair_layout(experts, n_experts: int, tile_m: int):
    """(dest int32 [T k], tile_group int32 [n_tiles]): the row of each (token, j) pair (flattened row-major) in the
    tile-aligned grouped layout, and each tile's group. n_tiles = ceil(T k / tile_m) + n_experts - 1 (static)."""
    flat = experts.reshape(-1).astype(jnp.int32)
    pairs = flat.shape[0]
    n_tiles = -(-pairs // tile_m) + n_experts - 1
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    starts, tile_group = group_layout(sizes, tile_m, n_tiles)
    order = jnp.argsort(flat, stable=True)
    first = jnp.cumsum(sizes) - sizes  # each group's first position in sorted order
    rank = jnp.arange(pairs, dtype=jnp.int32) - first[flat[order]]
    dest = jnp.zeros((pairs,), jnp.int32).at[order].set(starts[flat[order]] + rank)
    return dest, tile_group


def routed_experts_w8a8(x, experts, weights, w_gate_up, s_gate_up, w_down, s_down, *, up_config: Fp8GemmConfig,
                        down_config: Fp8GemmConfig, impl: str = "mosaic"):
    """float32 [T, D]. x [T, D] (float); experts int [T, k], weights [T, k]; w_gate_up e4m3 [E, 2I, D] with scales
    [E, 2I/128, D/128] in `interleave_gate_up`'s order; w_down e4m3 [E, D, I] with scales [E, D/128, I/128] (each
    expert in the release's [out, in] form). up_config must be a swiglu config; both configs share tile_m.
    impl: "mosaic", "mosaic_interpret" or "xla" (`fp8_gemm.grouped_matmul`)."""
    from . import grouped_matmul
    if not up_config.swiglu or down_config.swiglu or up_config.tile_m != down_config.tile_m:
        raise ValueError(f"routed_experts_w8a8: up_config must be swiglu, down_config not, with one tile_m; got "
                         f"{up_config}, {down_config}")
    t, k = experts.shape
    n_exp, d = w_gate_up.shape[0], x.shape[1]
    tm = up_config.tile_m
    dest, tile_group = pair_layout(experts, n_exp, tm)
    rows = tile_group.shape[0] * tm
    a_q, s_a = quantize_rows(x)
    token = jnp.arange(t * k, dtype=jnp.int32) // k
    a_rows = jnp.zeros((rows, d), FP8).at[dest].set(a_q[token])
    s_rows = jnp.ones((rows, s_a.shape[1]), jnp.float32).at[dest].set(s_a[token])
    h = grouped_matmul(a_rows, s_rows, w_gate_up, s_gate_up, tile_group, impl=impl, config=up_config,
                       out_dtype=jnp.bfloat16)
    h_q, h_s = quantize_rows(h)
    y = grouped_matmul(h_q, h_s, w_down, s_down, tile_group, impl=impl, config=down_config, out_dtype=jnp.float32)
    return (y[dest] * weights.reshape(-1, 1).astype(jnp.float32)).reshape(t, k, d).sum(axis=1)
