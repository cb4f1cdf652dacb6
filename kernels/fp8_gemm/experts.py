"""Routed SwiGLU experts through the W8A8 grouped GEMM (SPEC §11): the MoE impls "mosaic" / "mosaic_interpret" and
the FP8 form "w8a8_mosaic" of `kernels.moe` (which registers them; this module knows nothing of the registry).

y[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = experts[t, j], with x quantised per row per 128
channels once (before the gather, so T rows are quantised, not T x k), the (token, expert) pairs placed in
tile-aligned groups (`reference.group_layout`), gate and up by one GEMM with the SwiGLU epilogue (the config's
swiglu: gate and up read as stored, two operands), h stored in x's dtype and quantised per row per 128 channels,
the down GEMM (stored in x's dtype) and the weighted combine in float32 in XLA. A pair whose expert id is outside
[0, E) (a padding row's sentinel) is placed in no group (`pair_layout`), so neither GEMM computes it; it adds 0.

Layouts (`layout`): "grouped" (prefill: 128-row tiles of one expert, the rows on wgmma's M side) and "swap_ab"
(decode: 8-64-row tiles, the weights on wgmma's M side); `kernels.moe` picks one per shape (its rule
"moe.mosaic_layout") and `expert_configs` gives the launch configs of each.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..moe.tiles import sort_pairs
from .config import BLOCK, Fp8GemmConfig
from .reference import FP8, group_layout, quantize_rows

LAYOUTS = ("grouped", "swap_ab")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def expert_configs(layout: str, t: int, k: int, n_exp: int) -> tuple[Fp8GemmConfig, Fp8GemmConfig]:
    """(up config, down config) of the routed experts at T rows of k experts among n_exp.

    grouped: 128-row tiles; gate+up 128 gate + 128 up rows a tile in 3 stages, down 128-column tiles in 4 stages
    (both fit float32 outputs; the configs the benchmark runs at prefill). swap_ab: tiles of about the mean rows per
    expert (a power of two in [8, 64]); gate+up 64 gate + 64 up rows per compute warpgroup in 4 stages, down 128
    rows a tile in 6 (each CTA's ring runs across its tiles: the down GEMM's 2 K blocks a tile at the TP = 8 shard
    keep all 6 stages busy, 3 tiles ahead)."""
    if layout == "grouped":
        return (Fp8GemmConfig(tile_m=128, tile_n=256, stages=3, swiglu=True),
                Fp8GemmConfig(tile_m=128, tile_n=128, stages=4))
    if layout != "swap_ab":
        raise ValueError(f"fp8_gemm experts: layout {layout!r} is not one of {LAYOUTS}")
    tm = min(64, max(8, _pow2_at_least(max(1, t * k // n_exp))))
    return (Fp8GemmConfig(tile_m=tm, tile_n=256, stages=4, swap_ab=True, swiglu=True),
            Fp8GemmConfig(tile_m=tm, tile_n=128, stages=6, swap_ab=True))


def pair_layout(experts, n_experts: int, tile_m: int):
    """(dest int32 [T k], tile_group int32 [n_tiles]): the row of each (token, j) pair (flattened row-major) in the
    tile-aligned grouped layout, and each tile's group. n_tiles = ceil(T k / tile_m) + n_experts - 1 (static).
    A pair whose expert id is outside [0, n_experts) (a padding row's sentinel) is in no group: its dest is
    n_tiles * tile_m, one past the last row (scatter it with mode "drop", select its result away)."""
    pairs = experts.size
    n_tiles = -(-pairs // tile_m) + n_experts - 1
    key, order, sizes = sort_pairs(experts.astype(jnp.int32), n_experts)  # unrouted pairs last, in no group
    starts, tile_group = group_layout(sizes, tile_m, n_tiles)
    group = jnp.minimum(key[order], n_experts - 1)  # clamped for the gathers; unrouted pairs replaced below
    first = jnp.cumsum(sizes) - sizes  # each group's first position in sorted order
    rank = jnp.arange(pairs, dtype=jnp.int32) - first[group]
    row = jnp.where(key[order] < n_experts, starts[group] + rank, n_tiles * tile_m)
    dest = jnp.zeros((pairs,), jnp.int32).at[order].set(row)
    return dest, tile_group


def routed_experts_w8a8(x, experts, weights, w_gate, w_up, s_gate, s_up, w_down, s_down, *,
                        up_config: Fp8GemmConfig, down_config: Fp8GemmConfig, impl: str = "mosaic"):
    """float32 [T, D]. x [T, D] (float); experts int [T, k], weights [T, k]; w_gate, w_up e4m3 [E, I, D] with scales
    [E, I/128, D/128]; w_down e4m3 [E, D, I] with scales [E, D/128, I/128] (each expert in the release's [out, in]
    form). up_config must be a swiglu config; both configs share tile_m. h and each pair's down output are stored
    in x's dtype (as the Triton kernels store them: half the bytes of float32 for bf16 rows), the weighted sum over
    a token's experts is float32. impl: "mosaic", "mosaic_interpret" or "xla" (`fp8_gemm.grouped_matmul`).

    The Mosaic kernels neither load nor store the layout's unused tiles (group -1: about half the worst-case tiles
    at decode) and leave their rows of h and of the down output undefined; nothing here reads them into a token:
    h is quantised row by row (an unused row gives that row of h_q and h_s alone), the down GEMM reads the rows of
    used tiles only (a swap-AB tile's scale block also loads the next rows' scales, but uses its own tile_m), and
    the combine gathers each routed pair's row, in a used tile; an unrouted pair's clamped gather may read an
    unused row, which the final `where` replaces by 0 (a select: a NaN there does not propagate)."""
    from . import grouped_matmul
    if not up_config.swiglu or down_config.swiglu or up_config.tile_m != down_config.tile_m:
        raise ValueError(f"routed_experts_w8a8: up_config must be swiglu, down_config not, with one tile_m; got "
                         f"{up_config}, {down_config}")
    t, k = experts.shape
    n_exp, d = w_gate.shape[0], x.shape[1]
    tm = up_config.tile_m
    dest, tile_group = pair_layout(experts, n_exp, tm)
    rows = tile_group.shape[0] * tm
    a_q, s_a = quantize_rows(x)
    token = jnp.arange(t * k, dtype=jnp.int32) // k
    # unrouted pairs (dest == rows: a padding row's sentinel expert) are dropped here and selected away below
    a_rows = jnp.zeros((rows, d), FP8).at[dest].set(a_q[token], mode="drop")
    s_rows = jnp.ones((rows, s_a.shape[1]), jnp.float32).at[dest].set(s_a[token], mode="drop")
    h_dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
    h = grouped_matmul(a_rows, s_rows, (w_gate, w_up), (s_gate, s_up), tile_group, impl=impl, config=up_config,
                       out_dtype=h_dtype)
    h_q, h_s = quantize_rows(h)
    y = grouped_matmul(h_q, h_s, w_down, s_down, tile_group, impl=impl, config=down_config, out_dtype=h_dtype)
    y = y[jnp.minimum(dest, rows - 1)].astype(jnp.float32) * weights.reshape(-1, 1).astype(jnp.float32)
    return jnp.where((dest < rows)[:, None], y, 0.0).reshape(t, k, d).sum(axis=1)


def supports(x, experts, weights, wg, wu, wd, *, wg_scale=None, wu_scale=None, wd_scale=None, i_offset=0,
             w_layout: str = "kn", **_) -> str | None:
    """Why the Mosaic W8A8 experts cannot take these inputs (None when they can): FP8 K-major stacks (w_layout
    "nk": the release's [out, in] experts, as the model keeps them) of whole 128-blocks, the shard on a block
    boundary."""
    if jnp.dtype(wg.dtype) != FP8 or wg_scale is None:
        return f"the Mosaic W8A8 experts take FP8 experts (float8_e4m3fn with block scales), got {wg.dtype}"
    if w_layout != "nk":
        return (f"the Mosaic W8A8 experts read K-major stacks (w_layout 'nk', each expert [out, in] as released), "
                f"got w_layout {w_layout!r}")
    _, i, d = wg.shape
    if not (isinstance(i_offset, int) and i_offset == 0) or d % BLOCK or i % BLOCK:
        return (f"the Mosaic W8A8 experts need whole 128-blocks on a block boundary: hidden {d}, width {i}, "
                f"i_offset {i_offset!r}")
    return None


def routed_experts(x, experts, weights, wg, wu, wd, *, wg_scale, wu_scale, wd_scale, i_offset=0,
                   w_layout: str = "nk", layout: str = "grouped", up_config: Fp8GemmConfig | None = None,
                   down_config: Fp8GemmConfig | None = None, config_rows: int | None = None,
                   interpret: bool = False):
    """The MoE impl "mosaic" (`kernels.moe.routed_experts`' arguments for FP8 K-major experts, see `supports`):
    float32 [T, D]. `layout` "grouped" or "swap_ab" (`kernels.moe` passes its rule's choice); `up_config` /
    `down_config` override `expert_configs`, chosen for `config_rows` rows (default T; `kernels.moe` passes the
    registry's `config_rows`, fixed in batch-invariant mode); `interpret` runs the kernels under the Mosaic GPU
    interpreter."""
    why = supports(x, experts, weights, wg, wu, wd, wg_scale=wg_scale, wu_scale=wu_scale, wd_scale=wd_scale,
                   i_offset=i_offset, w_layout=w_layout)
    if why:
        raise ValueError(f"moe: impl 'mosaic' does not support these inputs: {why}")
    t, k = experts.shape
    up, down = expert_configs(layout, t if config_rows is None else config_rows, k, wg.shape[0])
    return routed_experts_w8a8(x, experts, weights, wg, wu, wg_scale, wu_scale, wd, wd_scale,
                               up_config=up_config or up, down_config=down_config or down,
                               impl="mosaic_interpret" if interpret else "mosaic")
