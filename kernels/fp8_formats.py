"""FP8 cache formats (docs/math.md §3): jnp reference quantisers / dequantisers, byte layouts as uint8 rows.

MLA cache, format ``fp8_ds_mla`` — one row per token slot, ``uint8 [slots, mla_row_bytes(R, Dr)]``:

    bytes [0, R)                      kv latent, R x float8_e4m3fn (kv / scale of its tile)
    bytes [R, R + 4 * n_tiles)        n_tiles x float32 scale, ``scale = max(amax_tile / 448, 1.1754944e-38)``
    bytes [R + 4 * n_tiles, +2 * Dr)  k_pe, Dr x bfloat16 (not quantised)

Tiles are 128 consecutive kv values (R = 512 -> 4 tiles, 512 + 16 + 128 = 656 bytes). When R is not a
multiple of 128 (the tiny test configs have R = 32..64) the whole latent is ONE tile (tile = R), so
n_tiles = 1. ``mla_tile(R)`` states the rule.

Indexer key cache — ``uint8 [slots, index_row_bytes(Di)]``: Di x float8_e4m3fn, then one float32 scale,
UE8M0 (a power of two): ``s = 2^ceil(log2(max(amax, 1e-4) / 448))`` (Di = 128 -> 132 bytes). Queries
are quantised per (t, h) with the same rule (``quantize_index_queries``); the indexer folds ``s_q``
into its head weights. ``ue8m0_scale`` computes it exactly from the float32 bits (no division, no log).

Value -> e4m3: ``(x / scale)`` in float32 (true IEEE division on the CPU: see ``exact_div``; XLA on the
GPU may round the MLA scale and quotients differently in the last bit, the Triton kernel uses div.rn),
clipped to +-448, round-to-nearest-even (the same as the GPU's ``cvt.rn.satfinite``): ``to_e4m3``. The
Pallas kernels call these same helpers (``to_e4m3``, ``e4m3_bits``, ``decode_e4m3_bits``,
``ue8m0_scale_and_inverse``, ``mla_tile_scale``). Values are read as float32 before quantising; kernels that
normalise in bf16 must round to bf16 first, as the xla oracle does. Byte order is little-endian (bitcasts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8 = jnp.float8_e4m3fn
_E4M3_F32 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # NaN at 0x7f/0xff
FP8_MAX = 448.0
MLA_SCALE_MIN = 1.1754944e-38  # float32 smallest normal
INDEX_AMAX_MIN = 1e-4
MLA_TILE = 128


def mla_tile(kv_lora_rank: int) -> int:
    """Tile width of the kv scales: 128, or the whole latent when R is not a multiple of 128."""
    return MLA_TILE if kv_lora_rank % MLA_TILE == 0 else kv_lora_rank


def mla_num_tiles(kv_lora_rank: int) -> int:
    return kv_lora_rank // mla_tile(kv_lora_rank)


def mla_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one fp8_ds_mla row: R e4m3 + 4 per tile scale + 2 * Dr bf16 (656 for 512 + 64)."""
    return kv_lora_rank + 4 * mla_num_tiles(kv_lora_rank) + 2 * rope_dim


def index_row_bytes(index_dim: int) -> int:
    """Bytes of one FP8 indexer-key row: Di e4m3 + one float32 scale (132 for Di = 128)."""
    return index_dim + 4


def cache_dtype_of(kv_cache_dtype) -> str:
    """'fp8_ds_mla' for uint8 caches, else 'bfloat16'-style (the cache's own dtype)."""
    return "fp8_ds_mla" if jnp.dtype(kv_cache_dtype) == jnp.uint8 else str(jnp.dtype(kv_cache_dtype))


# ---------------------------------------------------------------------------------------- bitcasts

def _to_bytes(x):
    """[..., n] of a 2- or 4-byte (or 1-byte) dtype -> uint8 [..., n * itemsize]."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return b.reshape(*x.shape[:-1], -1) if b.ndim > x.ndim else b


def _from_bytes(b, dtype):
    """uint8 [..., n * itemsize] -> dtype [..., n]."""
    size = jnp.dtype(dtype).itemsize
    if size == 1:
        return jax.lax.bitcast_convert_type(b, dtype)
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, size), dtype)


def exact_div(a, b):
    """IEEE ``a / b`` elementwise. XLA rewrites ``A / broadcast(b)`` as ``A * broadcast(1/b)`` (not exact,
    differs in the last bit for ~half the inputs); dividing by a same-shape operand behind an
    optimization barrier keeps the true division, which numpy and Triton's ``/`` (div.rn) compute."""
    b = jnp.broadcast_to(jnp.asarray(b, jnp.float32), a.shape)
    return a / jax.lax.optimization_barrier(b)


def to_e4m3(x):
    """float32 -> e4m3, saturated to +-448, round to nearest even (the GPU's ``cvt.rn.satfinite``). Plain jnp
    ops: the xla forms and the Pallas kernels quantise through this one function."""
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(FP8)


def e4m3_bits(x):
    """float32 -> the uint8 bits of `to_e4m3(x)` (what a uint8 cache stores)."""
    return jax.lax.bitcast_convert_type(to_e4m3(x), jnp.uint8)


def decode_e4m3_bits(b, dtype=jnp.float32):
    """uint8 e4m3 bits -> `dtype` (exact for float32 and bfloat16) by a bitcast and a convert. For kernels, where
    XLA cannot fold the convert away; XLA graphs take `e4m3_to_f32` (a table) instead."""
    return jax.lax.bitcast_convert_type(b, FP8).astype(dtype)


# ---------------------------------------------------------------------------------------- scales

def ue8m0_scale(amax):
    """``2^ceil(log2(max(amax, 1e-4) / 448))`` exactly, float32, with integer ops only (no division, so
    every backend agrees bit for bit). With m = max(amax, 1e-4) = f * 2^e, f in [1, 2), 448 = 1.75 * 2^8:
    m / 448 = (f / 1.75) * 2^(e - 8), and ceil(log2(.)) = e - 8 + (f > 1.75). This equals the IEEE
    quotient's ceil(log2) too: the f32 neighbour above 1.75 * 2^j lies 1.14 * 2^-24 above, relatively,
    so its quotient never rounds down onto the power of two."""
    return ue8m0_scale_and_inverse(amax)[0]


def ue8m0_scale_and_inverse(amax):
    """(s, 1 / s) of `ue8m0_scale`, both exact powers of two built from the exponent bits (also in kernels)."""
    m = jnp.maximum(amax.astype(jnp.float32), INDEX_AMAX_MIN)  # normal, positive
    bits = jax.lax.bitcast_convert_type(m, jnp.int32)
    e = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)  # biased exponent of s
    return (jax.lax.bitcast_convert_type(e << 23, jnp.float32),
            jax.lax.bitcast_convert_type((254 - e) << 23, jnp.float32))


def mla_tile_scale(amax, div=exact_div):
    """``max(amax / 448, 1.1754944e-38)`` per tile, float32. `div`: an IEEE division (`exact_div` here; the
    Triton kernel passes its div.rn)."""
    return jnp.maximum(div(amax.astype(jnp.float32), FP8_MAX), MLA_SCALE_MIN)


# ---------------------------------------------------------------------------------------- MLA rows

def quantize_mla_rows(kv, k_pe):
    """kv [N, R] (any float), k_pe [N, Dr] -> uint8 [N, mla_row_bytes(R, Dr)] (fp8_ds_mla)."""
    n, r = kv.shape
    tile = mla_tile(r)
    x = kv.astype(jnp.float32).reshape(n, r // tile, tile)
    scale = mla_tile_scale(jnp.max(jnp.abs(x), axis=-1))  # [N, tiles]
    q = to_e4m3(exact_div(x, scale[..., None])).reshape(n, r)
    return jnp.concatenate([_to_bytes(q), _to_bytes(scale), _to_bytes(k_pe.astype(jnp.bfloat16))], axis=-1)


def split_mla_rows(rows, kv_lora_rank: int, rope_dim: int):
    """uint8 rows -> (kv e4m3 [N, R], scales float32 [N, tiles], k_pe bf16 [N, Dr]), no arithmetic."""
    r, nt = kv_lora_rank, mla_num_tiles(kv_lora_rank)
    if rows.shape[-1] != mla_row_bytes(r, rope_dim):
        raise ValueError(f"split_mla_rows: rows of {rows.shape[-1]} bytes (shape {rows.shape}) != "
                         f"mla_row_bytes(R={r}, Dr={rope_dim}) = {mla_row_bytes(r, rope_dim)}")
    q = _from_bytes(rows[..., :r], FP8)
    scale = _from_bytes(rows[..., r:r + 4 * nt], jnp.float32)
    k_pe = _from_bytes(rows[..., r + 4 * nt:], jnp.bfloat16)
    return q, scale, k_pe


def e4m3_to_f32(x):
    """e4m3 values -> float32 by a 256-entry table: no convert op, so XLA's GPU GEMM rewriter cannot fuse it
    with the dot that follows into an FP8 cuBLAS GEMM (whose fast accumulation drifts ~1% on long dots)."""
    return jnp.asarray(_E4M3_F32)[jax.lax.bitcast_convert_type(x.astype(FP8), jnp.uint8).astype(jnp.int32)]


def dequantize_mla_rows(rows, kv_lora_rank: int, rope_dim: int):
    """uint8 [..., row_bytes] -> (kv float32 [..., R], k_pe bfloat16 [..., Dr])."""
    q, scale, k_pe = split_mla_rows(rows, kv_lora_rank, rope_dim)
    tile = mla_tile(kv_lora_rank)
    lead = q.shape[:-1]
    kv = e4m3_to_f32(q).reshape(*lead, -1, tile) * scale[..., None]
    return kv.reshape(*lead, kv_lora_rank), k_pe


# ---------------------------------------------------------------------------------------- indexer

def quantize_index_rows(k):
    """k [N, Di] -> uint8 [N, Di + 4]: e4m3(k / s), then s (float32, UE8M0) per row."""
    x = k.astype(jnp.float32)
    s = ue8m0_scale(jnp.max(jnp.abs(x), axis=-1))
    q = to_e4m3(x / s[..., None])  # s is a power of two: multiply-by-reciprocal is exact too
    return jnp.concatenate([_to_bytes(q), _to_bytes(s[..., None])], axis=-1)


def split_index_rows(rows, index_dim: int):
    """uint8 [..., Di + 4] -> (e4m3 [..., Di], scale float32 [...])."""
    if rows.shape[-1] != index_row_bytes(index_dim):
        raise ValueError(f"split_index_rows: rows of {rows.shape[-1]} bytes (shape {rows.shape}) != "
                         f"index_row_bytes(Di={index_dim}) = {index_row_bytes(index_dim)}")
    return _from_bytes(rows[..., :index_dim], FP8), _from_bytes(rows[..., index_dim:], jnp.float32)[..., 0]


def dequantize_index_rows(rows, index_dim: int):
    """uint8 [..., Di + 4] -> float32 [..., Di]."""
    q, s = split_index_rows(rows, index_dim)
    return e4m3_to_f32(q) * s[..., None]


def quantize_index_queries(q):
    """q [..., Di] (e.g. [T, H, Di]) -> (e4m3 [..., Di], s_q float32 [...]), UE8M0 per leading index.

    The indexer uses ``q_fp8 . k_fp8 * s_k`` and folds ``s_q`` into its per-head weight: w'[t,h] = w[t,h] * s_q[t,h]
    (valid because relu(s_q * x) = s_q * relu(x) for s_q > 0).
    """
    x = q.astype(jnp.float32)
    s = ue8m0_scale(jnp.max(jnp.abs(x), axis=-1))
    return to_e4m3(x / s[..., None]), s
