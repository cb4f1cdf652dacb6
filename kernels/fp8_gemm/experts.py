"""Routed SwiGLU experts through the W8A8 grouped GEMM (SPEC §11): the MoE impls "mosaic" / "mosaic_interpret" and
the FP8 form "w8a8_mosaic" of `kernels.moe` (which registers them; this module knows nothing of the registry).

y[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = experts[t, j]. A pair whose expert id is outside
[0, E) (a padding row's sentinel) is placed in no group (`pair_rows`), so neither GEMM computes it; it adds 0.

Steps, and why each is as it is (bytes at 8192 rows of GLM-5.2, TP = 1: P = 65536 pairs, R = 98176 grouped rows of
767 tiles, the static bound ceil(P / 128) + E - 1; about 640 tiles are used):
  `pair_rows`: one stable sort of the P pair ids (unrouted last), the tile layout (`reference.group_layout`: a
    broadcast compare, no search loop), dest [P] by one scatter of int32, src [R] (the pair at each row) by gathers;
    a few MB.
  x quantised per row per 128 channels at its T rows, before any gather (T rows, not T k): 0.1 GB bf16 read.
  `group_rows`: one gather each of the e4m3 rows (R x 6144 bytes written, 0.6 GB) and their scales into the grouped
    layout; a row holding no pair gets zeros with scale 1, the values the layout has always had there. It was a
    zero-filled buffer scattered into: 2.2 GB moved in two passes, the scatter 1 byte an element.
  gate and up by one GEMM with the SwiGLU epilogue (the config's swiglu: gate and up read as stored); h [R, I] in x's
    dtype, quantised per row per 128 channels (R rows: the static layout's; 0.4 GB bf16 read); the down GEMM, y
    [R, D] in x's dtype.
  `combine`: per token the k pair rows of y gathered, weighted and added in j order in float32, one fused pass
    (0.8 GB read, 0.2 GB written); it was a reduce over a [P, D] float32 product, which a compiler may materialise
    (the CPU's did: 1.6 GB) and whose order is the backend's.

Layouts (`layout`): "grouped" (prefill: 128-row tiles of one expert, the rows on wgmma's M side) and "swap_ab"
(decode: 8-64-row tiles, the weights on wgmma's M side); `kernels.moe` picks one per shape (its rule
"moe.mosaic_layout") and `expert_configs` gives the launch configs of each.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import registry
from ..moe.tiles import sort_pairs
from .config import BLOCK, EXPERTS_PREFILL_DOWN, EXPERTS_PREFILL_UP, Fp8GemmConfig
from .reference import FP8, group_layout, quantize_rows

LAYOUTS = ("grouped", "swap_ab")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def expert_configs(layout: str, t: int, k: int, n_exp: int) -> tuple[Fp8GemmConfig, Fp8GemmConfig]:
    """(up config, down config) of the routed experts at T rows of k experts among n_exp.

    grouped: `config.EXPERTS_PREFILL_UP` (64 gate + 64 up rows a tile in 4 stages, its two 64 x 64 wgmmas waited
    for once) and `config.EXPERTS_PREFILL_DOWN` (128-column tiles in 4 stages), each CTA's tiles chained; both fit
    float32 outputs and were the fastest of benchmarks/diagnostics/fp8_gemm_configs.py's sweep (BENCHMARKS.md). The
    128 + 128 gate+up tile (`config.PREFILL_SWIGLU`) gives the same bits. swap_ab: tiles of about the mean rows per
    expert (a power of two in [8, 64]); gate+up 64 gate + 64 up rows per compute warpgroup
    in 4 stages, down 128 rows a tile in 6 (the pipeline takes no more stages than K blocks)."""
    if layout == "grouped":
        return EXPERTS_PREFILL_UP, EXPERTS_PREFILL_DOWN
    if layout != "swap_ab":
        raise ValueError(f"fp8_gemm experts: layout {layout!r} is not one of {LAYOUTS}")
    tm = min(64, max(8, _pow2_at_least(max(1, t * k // n_exp))))
    return (Fp8GemmConfig(tile_m=tm, tile_n=256, stages=4, swap_ab=True, swiglu=True),
            Fp8GemmConfig(tile_m=tm, tile_n=128, stages=6, swap_ab=True))


class PairRows(NamedTuple):
    """The grouped layout of the (token, j) pairs (flattened row-major, P = T k of them) in n_tiles tiles of tile_m
    rows: dest int32 [P], each pair's row (n_tiles * tile_m, one past the last, for an unrouted pair); src int32
    [n_tiles * tile_m], the pair at each row (-1 for a row that holds none: a tile's padding, an unused tile);
    tile_group int32 [n_tiles], each tile's group (-1 past the last used tile)."""
    dest: jax.Array
    src: jax.Array
    tile_group: jax.Array


def pair_rows(experts, n_experts: int, tile_m: int) -> PairRows:
    """`PairRows` of `experts` [T, k]: n_tiles = ceil(T k / tile_m) + n_experts - 1 (static). A pair whose expert id
    is outside [0, n_experts) (a padding row's sentinel) is in no group: no row's src names it, its dest is one past
    the last row.

    One sort of the pairs (`tiles.sort_pairs`); src by gathers from it (row r of group g = tile_group[r // tile_m] at
    rank r - starts[g] holds the pair order[first[g] + rank] when that rank is below the group's size), so the rows'
    map costs no zero-fill and no scatter; dest by one scatter of P int32 (the sorted positions inverted)."""
    pairs = experts.size
    n_tiles = -(-pairs // tile_m) + n_experts - 1
    key, order, sizes = sort_pairs(experts.astype(jnp.int32), n_experts)  # unrouted pairs last, in no group
    order = order.astype(jnp.int32)
    starts, tile_group = group_layout(sizes, tile_m, n_tiles)
    first = jnp.cumsum(sizes) - sizes  # each group's first position in sorted order
    sorted_key = key[order]
    group = jnp.minimum(sorted_key, n_experts - 1)  # clamped for the gathers; unrouted pairs replaced below
    rank = jnp.arange(pairs, dtype=jnp.int32) - first[group]
    row = jnp.where(sorted_key < n_experts, starts[group] + rank, n_tiles * tile_m)
    dest = jnp.zeros((pairs,), jnp.int32).at[order].set(row)
    r = jnp.arange(n_tiles * tile_m, dtype=jnp.int32)
    g = jnp.repeat(tile_group, tile_m)
    gc = jnp.maximum(g, 0)
    rank_r = r - starts[gc]
    held = (g >= 0) & (rank_r < sizes[gc])
    src = jnp.where(held, order[jnp.clip(first[gc] + rank_r, 0, pairs - 1)], -1)
    return PairRows(dest, src, tile_group)


def group_rows(a_q, s_a, src, k: int):
    """(e4m3 [R, K], float32 [R, K / 128]): the quantised rows of x and their scales at the grouped layout's rows
    (`PairRows.src`, R of them): row r holds token src[r] // k's row, or zeros with scales 1 where src[r] is -1.

    One gather per operand, each row written once: no zero-filled buffer scattered into (which wrote every row twice
    and read the gathered pairs once more: 2.2 GB against 1.0 GB at 8192 rows of GLM-5.2). Rows holding no pair are
    the values the layout always had there (zeros, scale 1), so the GEMMs compute the same bits everywhere: a padding
    row's h is 0 and its quantised h 0 with the smallest scale."""
    held = (src >= 0)[:, None]
    token = jnp.where(src >= 0, src // k, 0)
    a_rows = jnp.where(held, a_q[token], jnp.zeros((), FP8))
    s_rows = jnp.where(held, s_a[token], jnp.float32(1.0))
    return a_rows, s_rows


def combine(y, dest, weights):
    """float32 [T, D]: sum_j weights[t, j] * y[dest[t, j]] over each token's k pairs, in j order (one fused pass: k
    gathers of whole rows, each converted, weighted and added to a float32 running sum), 0 for a pair with dest past
    the last row (unrouted: selected away, so a NaN there adds nothing).

    The k terms as an explicit left-to-right chain, not a reduce over a [T, k, D] product: the order is fixed (and
    batch-invariant) whatever a backend's reduction emitter does, and no [T k, D] float32 intermediate exists for XLA
    to materialise (the CPU's compiler wrote one: 1.6 GB at 8192 rows of GLM-5.2)."""
    rows = y.shape[0]
    w = weights.astype(jnp.float32)
    acc = None
    for j in range(dest.shape[1]):
        dj = dest[:, j]
        part = jnp.where((dj < rows)[:, None], y[jnp.minimum(dj, rows - 1)].astype(jnp.float32) * w[:, j:j + 1], 0.0)
        acc = part if acc is None else acc + part
    return acc


def routed_experts_w8a8(x, experts, weights, w_gate, w_up, s_gate, s_up, w_down, s_down, *,
                        up_config: Fp8GemmConfig, down_config: Fp8GemmConfig, impl: str = "mosaic"):
    """float32 [T, D]. x [T, D] (float); experts int [T, k], weights [T, k]; w_gate, w_up e4m3 [E, I, D] with scales
    [E, I/128, D/128]; w_down e4m3 [E, D, I] with scales [E, D/128, I/128] (each expert in the release's [out, in]
    form). up_config must be a swiglu config; both configs share tile_m. h and each pair's down output are stored
    in x's dtype (as the Triton kernels store them: half the bytes of float32 for bf16 rows), the weighted sum over
    a token's experts is float32. impl: "mosaic", "mosaic_interpret" or "xla" (`fp8_gemm.grouped_matmul`).

    Steps (module docstring): `pair_rows` (one sort of the pairs), x quantised at its T rows, `group_rows` (one
    gather each of the quantised rows and their scales into the grouped layout), the gate+up GEMM, h quantised, the
    down GEMM, `combine`."""
    from . import grouped_matmul
    if not up_config.swiglu or down_config.swiglu or up_config.tile_m != down_config.tile_m:
        raise ValueError(f"routed_experts_w8a8: up_config must be swiglu, down_config not, with one tile_m; got "
                         f"{up_config}, {down_config}")
    t, k = experts.shape
    n_exp = w_gate.shape[0]
    dest, src, tile_group = pair_rows(experts, n_exp, up_config.tile_m)
    a_q, s_a = quantize_rows(x)
    a_rows, s_rows = group_rows(a_q, s_a, src, k)
    h_dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
    h = grouped_matmul(a_rows, s_rows, (w_gate, w_up), (s_gate, s_up), tile_group, impl=impl, config=up_config,
                       out_dtype=h_dtype)
    h_q, h_s = quantize_rows(h)
    y = grouped_matmul(h_q, h_s, w_down, s_down, tile_group, impl=impl, config=down_config, out_dtype=h_dtype)
    return combine(y, dest.reshape(t, k), weights.reshape(t, k))


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
    registry.launch("moe_mosaic", (layout, up_config or up, down_config or down))
    return routed_experts_w8a8(x, experts, weights, wg, wu, wg_scale, wu_scale, wd, wd_scale,
                               up_config=up_config or up, down_config=down_config or down,
                               impl="mosaic_interpret" if interpret else "mosaic")
