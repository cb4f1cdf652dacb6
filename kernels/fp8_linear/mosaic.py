"""The FP8 linear (and the SwiGLU pair gate/up) through the Mosaic GPU W8A8 grouped GEMM (`kernels.fp8_gemm`) with
one group: the impls "mosaic" / "mosaic_interpret" of the ops "fp8_linear" and "fp8_swiglu" (`kernels.fp8_linear`
registers them; this module knows nothing of the registry).

y = x @ W^T by the W8A8 rule (SPEC §11): x quantised per row per 128 columns (`fp8_gemm.quantize_rows`), each 128-K
block's e4m3 x e4m3 partial promoted to float32 and scaled by s_a[t, kb] * s_w[n // 128, kb], stored in x's dtype.

Layouts (`layout`, as the rule "fp8_linear.mosaic_layout" picks them): "grouped" (prefill: 128-row tiles of x on
wgmma's M side; one group, so every tile is group 0) and "swap_ab" (decode: the weight rows on wgmma's M side, 8-64
rows of x on its N side; the kernel writes y^T).

The kernel takes K-major weights ([N, K], the release's [out, in]) of whole tiles. What this wrapper does to fit:
  w_layout "kn" (the model's [in, out] layout): the e4m3 weight and its grid are transposed per call (Hopper's fp8
    wgmma reads only K-major operands), one pass over the weight's bytes (and its write) before the GEMM;
  K not a multiple of 128: x and the weight padded with zero columns to the grid's whole blocks (zeros change
    neither a block's amax nor its sum);
  N not a multiple of the tile's weight rows (128; 256 for a 256-wide prefill tile): zero weight rows (scale 1)
    appended, their output columns cut off (kv_a's 576 = 512 + 64 outputs run as 640);
  rows: padded with zero rows to whole row tiles, cut off after.
A padded or transposed weight is a copy of it per call; the model's [in, out] weights always take the transpose, in
the same pass. TP shards must start on a block boundary (offsets 0): the rule falls back to the existing forms for
the others (`kernels.fp8_linear.mosaic_supports`).
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import registry
from ..common.mosaic_common import round_up
from ..fp8_gemm import grouped_matmul, quantize_rows
from ..fp8_gemm.config import BLOCK, Fp8GemmConfig

LAYOUTS = ("grouped", "swap_ab")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def linear_config(layout: str, t: int, swiglu: bool = False) -> Fp8GemmConfig:
    """The launch config of a dense FP8 linear (`swiglu`: the gate/up pair) at `t` rows.

    grouped: 128-row tiles, 128 weight rows a tile in 4 stages (swiglu: 128 gate + 128 up rows in 3). swap_ab: a
    tile of the rows rounded up to a power of two in [8, 64], 128 weight rows a tile in 6 stages (swiglu: 64 gate +
    64 up rows per compute warpgroup in 4). All fit float32 outputs."""
    if layout == "grouped":
        return (Fp8GemmConfig(tile_m=128, tile_n=256, stages=3, swiglu=True) if swiglu
                else Fp8GemmConfig(tile_m=128, tile_n=128, stages=4))
    if layout != "swap_ab":
        raise ValueError(f"fp8_linear mosaic: layout {layout!r} is not one of {LAYOUTS}")
    tm = min(64, max(8, _pow2_at_least(max(1, t))))
    if swiglu:
        return Fp8GemmConfig(tile_m=tm, tile_n=256, stages=4, swap_ab=True, swiglu=True)
    return Fp8GemmConfig(tile_m=tm, tile_n=128, stages=6, swap_ab=True)


def _rows(x, k_pad: int, tile_m: int):
    """(e4m3 rows [M, k_pad], float32 scales [M, k_pad / 128], tile_group int32 [M / tile_m]): x padded with zero
    columns to k_pad and zero rows to whole tiles, quantised per row per 128 columns; every tile is group 0."""
    t, k = x.shape
    m = round_up(max(t, 1), tile_m)
    if (m, k_pad) != (t, k):
        x = jnp.pad(x, ((0, m - t), (0, k_pad - k)))
    a_q, s_a = quantize_rows(x)
    return a_q, s_a, jnp.zeros((m // tile_m,), jnp.int32)


def _weight(w_q, w_scale, w_layout: str, n_mult: int):
    """(e4m3 [1, N_pad, K_pad], float32 [1, N_pad / 128, K_pad / 128], N): the weight K-major ([N, K]; "kn" weights
    transposed with their grid), zero-padded to whole 128-column blocks of K and to N_pad rows (a multiple of
    `n_mult`, itself a multiple of 128), the grid padded with scales 1.0 to match."""
    if w_layout == "kn":
        w_q, w_scale = w_q.T, w_scale.T
    n, k = w_q.shape
    nb, kb = w_scale.shape
    n_pad, k_pad = round_up(n, n_mult), kb * BLOCK
    if (n_pad, k_pad) != (n, k):
        w_q = jnp.pad(w_q, ((0, n_pad - n), (0, k_pad - k)))
    if n_pad // BLOCK != nb:
        w_scale = jnp.pad(w_scale, ((0, n_pad // BLOCK - nb), (0, 0)), constant_values=1.0)
    return w_q[None], w_scale.astype(jnp.float32)[None], n


def _config(layout: str, t: int, config_rows, config, swiglu: bool) -> Fp8GemmConfig:
    cfg = config or linear_config(layout, t if config_rows is None else config_rows, swiglu)
    registry.launch("fp8_linear_mosaic", cfg)
    if not isinstance(cfg, Fp8GemmConfig) or cfg.swiglu != swiglu:
        raise ValueError(f"fp8_linear mosaic: config must be an Fp8GemmConfig with swiglu={swiglu}, got {cfg!r}")
    return cfg


def fp8_matmul(x, w_q, w_scale, *, form: str = "w8a8", n_offset=0, k_offset=0, w_layout: str = "nk",
               layout: str = "grouped", config: Fp8GemmConfig | None = None, config_rows: int | None = None,
               interpret: bool = False):
    """x.dtype [T, N]: the W8A8 product of rows x [T, K] with the block-scaled e4m3 weight (`w_layout` "nk": w_q
    [N, K], w_scale [ceil(N/128), ceil(K/128)]; "kn": both transposed), by the grouped GEMM with one group.
    `layout` "grouped" / "swap_ab"; `config` overrides `linear_config(layout, config_rows or T)`; `interpret`: the
    Mosaic GPU interpreter. Offsets must be 0 and `form` "w8a8" (`kernels.fp8_linear.mosaic_supports`, which the
    registry checks before the call)."""
    del form, n_offset, k_offset  # checked by the registry's supports: "w8a8", 0, 0
    t = x.shape[0]
    cfg = _config(layout, t, config_rows, config, swiglu=False)
    w, s, n = _weight(w_q, w_scale, w_layout, max(BLOCK, cfg.operand_rows))
    a_q, s_a, tile_group = _rows(x, w.shape[2], cfg.tile_m)
    y = grouped_matmul(a_q, s_a, w, s, tile_group, impl="mosaic_interpret" if interpret else "mosaic", config=cfg,
                       out_dtype=x.dtype)
    return y[:t, :n]


def fp8_swiglu(x, w_gate, w_up, gate_scale, up_scale, *, n_offset=0, k_offset=0, w_layout: str = "nk",
               layout: str = "grouped", config: Fp8GemmConfig | None = None, config_rows: int | None = None,
               interpret: bool = False):
    """x.dtype [T, N]: silu(x @ Wg^T) * (x @ Wu^T), both products by the W8A8 rule in one grouped GEMM with the
    SwiGLU epilogue (float32 accumulators, the epilogue in float32, one rounding to x's dtype). Weights as for
    `fp8_matmul`, gate and up alike; `config` must be a swiglu config."""
    del n_offset, k_offset  # checked by the registry's supports: 0, 0
    t = x.shape[0]
    cfg = _config(layout, t, config_rows, config, swiglu=True)
    n_mult = max(BLOCK, cfg.operand_rows)
    wg, sg, n = _weight(w_gate, gate_scale, w_layout, n_mult)
    wu, su, _ = _weight(w_up, up_scale, w_layout, n_mult)
    a_q, s_a, tile_group = _rows(x, wg.shape[2], cfg.tile_m)
    y = grouped_matmul(a_q, s_a, (wg, wu), (sg, su), tile_group, impl="mosaic_interpret" if interpret else "mosaic",
                       config=cfg, out_dtype=x.dtype)
    return y[:t, :n]
