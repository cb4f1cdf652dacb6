"""The W8A8 rule of SPEC §11 for grouped GEMMs, in jnp (the xla form) and as a float64 numpy oracle.

Activations are quantised per row per 128 channels: ``s_a = max(amax / 448, 1.1754944e-38)`` (float32, IEEE
division) and ``a_q = e4m3(a / s_a)``. Weights are e4m3 with one float32 scale per 128 x 128 block. The product is

    y[r, n] = sum_kb s_a[r, kb] * s_w[n // 128, kb] * (sum_{k in kb} a_q[r, k] * w_q[n, k])

with each 128-K partial promoted to float32 before scaling, as Hopper's fp8 wgmma keeps only about 14 mantissa
bits in its accumulator. The kernels and the xla form apply the scale as ``partial * (s_a * s_w)`` (the Triton
W8A8 kernel's order); the oracle sums the same terms in float64.

Grouped layout: rows sit in tiles of `tile_m` rows, each tile wholly inside one group's rows (``tile_group[t]``
is its group, -1 for a tile holding no rows); `group_layout` builds that layout from group sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
SCALE_MIN = 1.1754944e-38  # the smallest normal float32: an all-zero block still divides to zeros


def _ieee_div(a, b):
    """Elementwise IEEE a / b: XLA turns a division by a broadcast into a multiplication by the reciprocal (off by
    one ulp for about half the inputs), so the divisor is materialised at a's shape behind a barrier."""
    b = jnp.broadcast_to(jnp.asarray(b, jnp.float32), a.shape)
    return a / jax.lax.optimization_barrier(b)


def quantize_rows_barrier(x):
    """`quantize_rows` by IEEE float32 divisions with the divisor materialised at x's shape behind an optimisation
    barrier (`_ieee_div`): the same bits, about four passes over x's size in memory (kept to compare against)."""
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"quantize_rows: K = {k} must be a multiple of {BLOCK}")
    xf = jnp.asarray(x, jnp.float32).reshape(m, k // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    s_a = jnp.maximum(_ieee_div(amax, FP8_MAX), SCALE_MIN)
    q = jnp.clip(_ieee_div(xf, s_a[..., None]), -FP8_MAX, FP8_MAX).astype(FP8)
    return q.reshape(m, k), s_a


def quantize_rows(x):
    """x [M, K] (K a multiple of 128; any float dtype, read as float32) -> (e4m3 [M, K], float32 s_a [M, K / 128]):
    per row and 128-channel block, s_a = max(amax / 448, 1.1754944e-38), a_q = e4m3(x / s_a), saturated, with
    IEEE float32 divisions, bit for bit.

    One reduction and one elementwise pass over x, no divisor materialised (`quantize_rows_barrier` materialises
    it): the float32 quotient x / s_a is float32(float64(x) * float64(1 / s_a)), the reciprocal taken once per
    block. That is the IEEE quotient: for float32 x (24-bit significand X, exponent a) and s (S, b), an exact
    quotient that is not a float32 lies at relative distance >= 2^-49 from every float32 rounding midpoint (X 2^a -
    m S 2^b is a nonzero multiple of 2^min(a, b + c) for a midpoint m of 25 bits at 2^c, and b + c - a >= -25),
    while the float64 reciprocal and product are off by <= 2^-52 relative; and a float32 quotient is met within
    2^-52, so it is kept. The argument needs x normal; a subnormal x (|x| < 2^-126) can only reach a quotient
    e4m3 does not round to 0 (>= 2^-11) when s_a < 2^-115, i.e. in blocks whose amax is below about 2^-106, where
    its last float32 bit is not guaranteed (below 448 x 2^-126 the scale is the power of two 2^-126: exact
    again). amax / 448 is float32(float64(amax) / 448), the IEEE quotient (float64 division rounds correctly, and
    53 >= 2 x 24 + 2 bits make the second rounding exact)."""
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"quantize_rows: K = {k} must be a multiple of {BLOCK}")
    xf = jnp.asarray(x, jnp.float32).reshape(m, k // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    with jax.enable_x64(True):
        f64 = jnp.float64
        s_a = jnp.maximum((amax.astype(f64) / FP8_MAX).astype(jnp.float32), jnp.float32(SCALE_MIN))
        inv = 1.0 / s_a.astype(f64)
        q = (xf.astype(f64) * inv[..., None]).astype(jnp.float32)
    q = jnp.clip(q, -FP8_MAX, FP8_MAX).astype(FP8)
    return q.reshape(m, k), s_a


def group_layout(group_sizes, tile_m: int, n_tiles: int):
    """Tile-aligned placement of G groups of rows: (starts int32 [G], tile_group int32 [n_tiles]). Group g's rows
    go to rows starts[g] .. starts[g] + group_sizes[g] - 1 of a buffer of n_tiles * tile_m rows, each group
    starting on a tile boundary; tile_group[t] is the group of tile t, -1 past the last used tile. `n_tiles` is a
    static bound: ceil(M / tile_m) + G - 1 always suffices for M rows in all. Traceable.

    The tiles' owners are one broadcast compare of [n_tiles, G] int32 (`method="compare_all"`: 0.8 MB at 767 tiles of
    256 experts), not jnp's default binary search, a while loop of log2(G) steps (on a GPU ~9 launches of a few
    microseconds each, the same count at decode, where they are most of this layout's time); the same integers."""
    sizes = jnp.asarray(group_sizes, jnp.int32)
    tiles = (sizes + tile_m - 1) // tile_m
    first_tile = jnp.cumsum(tiles) - tiles
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    # the group of tile t: the number of groups whose first tile is <= t, minus one, among non-empty groups
    owner = jnp.searchsorted(jnp.cumsum(tiles), t, side="right", method="compare_all").astype(jnp.int32)
    tile_group = jnp.where(t < jnp.sum(tiles), owner, -1).astype(jnp.int32)
    return (first_tile * tile_m).astype(jnp.int32), tile_group


def row_groups(tile_group, tile_m: int):
    """int32 [n_tiles * tile_m]: the group of each row of the tiled layout (-1 in unused tiles)."""
    return jnp.repeat(jnp.asarray(tile_group, jnp.int32), tile_m)


def silu_mul(gate, up):
    """silu(gate) * up, elementwise; jnp or numpy arrays (numpy: in its own precision)."""
    if isinstance(gate, np.ndarray):
        with np.errstate(over="ignore"):  # exp(-gate) = inf for gate << 0: silu -> -0
            return gate / (1.0 + np.exp(-gate)) * up
    return gate / (1.0 + jnp.exp(-gate)) * up


def _grouped_product(a, a_scale, w_q, w_scale, rg):
    """float32 [M, N]: per 128-K block a float32 partial, scaled by s_a * s_w, summed in float32 in block order."""
    m, k = a.shape
    g, n, _ = w_q.shape
    kb = k // BLOCK
    w = w_q.astype(jnp.float32)[jnp.maximum(rg, 0)].reshape(m, n, kb, BLOCK)  # [M, N, KB, 128]: tests' sizes
    part = jnp.einsum("mbk,mnbk->mbn", a.reshape(m, kb, BLOCK), w, precision=jax.lax.Precision.HIGHEST)
    sw = jnp.repeat(w_scale[jnp.maximum(rg, 0)], BLOCK, axis=1)  # [M, N, KB]
    scale = a_scale[:, :, None] * jnp.swapaxes(sw, 1, 2)  # [M, KB, N]
    acc = jnp.zeros((m, n), jnp.float32)
    for b in range(kb):  # block order, as the kernels add them
        acc = acc + part[:, b] * scale[:, b]
    return acc


def grouped_matmul_xla(a_q, a_scale, w_q, w_scale, tile_group, *, tile_m: int, out_dtype=jnp.bfloat16,
                       swiglu: bool = False):
    """The W8A8 rule in jnp: a_q e4m3 [M, K] with a_scale float32 [M, K/128], w_q e4m3 [G, N, K] with w_scale
    float32 [G, N/128, K/128], tile_group int32 [M / tile_m] -> out_dtype [M, N] (zeros in rows of tiles with
    group -1). Per 128-K block a float32 partial, scaled by s_a * s_w, summed in float32 in block order.
    swiglu: w_q and w_scale are pairs (gate, up), and the result is silu(gate product) * up product."""
    rg = row_groups(tile_group, tile_m)
    a = a_q.astype(jnp.float32)
    if swiglu:
        acc = silu_mul(*(_grouped_product(a, a_scale, w, s, rg) for w, s in zip(w_q, w_scale)))
    else:
        acc = _grouped_product(a, a_scale, w_q, w_scale, rg)
    return jnp.where((rg >= 0)[:, None], acc, 0.0).astype(out_dtype)


def oracle(a_q, a_scale, w_q, w_scale, row_group):
    """float64 numpy y[r, n] of the W8A8 rule for rows of group row_group[r] (0 where it is -1): every term
    sum_kb s_a[r, kb] * s_w[g, n // 128, kb] * sum_{k in kb} a_q[r, k] * w_q[g, n, k] in float64."""
    a = np.asarray(jnp.asarray(a_q).astype(jnp.float32), np.float64)
    w = np.asarray(jnp.asarray(w_q).astype(jnp.float32), np.float64)
    sa = np.asarray(a_scale, np.float64)
    sw = np.asarray(w_scale, np.float64)
    rg = np.asarray(row_group)
    m, k = a.shape
    n = w.shape[1]
    kb = k // BLOCK
    out = np.zeros((m, n), np.float64)
    for gi in np.unique(rg[rg >= 0]):
        rows = np.nonzero(rg == gi)[0]
        ab = a[rows].reshape(-1, kb, BLOCK).transpose(1, 0, 2)  # [KB, r, 128]
        wb = w[gi].reshape(n, kb, BLOCK).transpose(1, 2, 0)  # [KB, 128, N]
        part = np.matmul(ab, wb)  # [KB, r, N]: one float64 partial per K block
        scale = sa[rows].T[:, :, None] * np.repeat(sw[gi], BLOCK, axis=0).T[:, None, :]
        out[rows] = (part * scale).sum(0)
    return out
