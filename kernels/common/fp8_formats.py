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

Block-scaled weights (docs/math.md §11, the FP8 releases): e4m3 [rows, cols] with float32 scales per 128 x 128 block,
``scale = amax / 448`` (1.0 for an all-zero block), ``q = e4m3(w / scale)``: the one codec of the repository, on the
device (``quantize_weight_blocks``, ``dequantize_weight_blocks``; a TP shard's slice may start mid-block:
``block_index``, ``block_count``) and on the host in numpy (``quantize_blocks_np``, ``dequantize_blocks_np``, the
checkpoint writers' and the tests' reference; the same bits). Also W8A8's per-token 1 x 128 activation scales
(``quantize_activation_blocks``).
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


# ---------------------------------------------------------------------------------------- block-scaled weights

WEIGHT_BLOCK = 128  # the FP8 releases' weight_block_size [128, 128] (docs/math.md §11)


def block_count(n: int, offset=0, block: int = WEIGHT_BLOCK) -> int:
    """Scale blocks covering `n` consecutive rows (or columns) whose first one sits at `offset` (0 <= offset <
    block) inside its block: ``ceil((offset + n) / block)``. A traced `offset` counts as the worst case,
    ``block - 1``."""
    off = offset if isinstance(offset, int) else block - 1
    return -(-(off + n) // block)


def block_index(n: int, offset=0, block: int = WEIGHT_BLOCK):
    """int32 [n]: the scale block of each of `n` local rows (columns) whose first sits at `offset` (an int or a
    traced int32 scalar) inside its block."""
    return ((offset + jnp.arange(n, dtype=jnp.int32)) // block).astype(jnp.int32)


def quantize_weight_blocks(w, block: int = WEIGHT_BLOCK):
    """w [..., rows, cols] (any float) -> (e4m3 [..., rows, cols], float32 scales [..., ceil(rows / block),
    ceil(cols / block)]), one scale per block x block tile of the last two axes, edge tiles ragged:
    ``scale = amax / 448`` (1.0 for an all-zero tile), ``q = e4m3(w / scale)``, as the FP8 releases store them
    (``quantize_blocks_np`` is the host form). Leading axes (stacked experts) are kept."""
    w = jnp.asarray(w, jnp.float32)
    *lead, rows, cols = w.shape
    rb, cb = -(-rows // block), -(-cols // block)
    padded = jnp.pad(jnp.abs(w), [(0, 0)] * len(lead) + [(0, rb * block - rows), (0, cb * block - cols)])
    amax = padded.reshape(*lead, rb, block, cb, block).max(axis=(-3, -1))
    scale = jnp.where(amax > 0, exact_div(amax, FP8_MAX), 1.0).astype(jnp.float32)  # IEEE, as numpy
    full = jnp.repeat(jnp.repeat(scale, block, axis=-2), block, axis=-1)[..., :rows, :cols]
    return to_e4m3(exact_div(w, full)), scale


E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)  # FP8 weights on the host (numpy)


def quantize_blocks_np(w: np.ndarray, block: int = WEIGHT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Host form of `quantize_weight_blocks` for a 2-D weight: (e4m3 values, float32 scale_inv per block), with
    ``scale = amax(block) / 448`` (1.0 for an all-zero block), so that ``dequantize_blocks_np(*quantize_blocks_np(w))
    ~= w``; numpy's IEEE arithmetic, the same bits as the device form."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_blocks: a 2-D weight is needed, got shape {list(w.shape)}")
    rows, cols = w.shape
    rb, cb = -(-rows // block), -(-cols // block)
    padded = np.zeros((rb * block, cb * block), np.float32)
    padded[:rows, :cols] = np.abs(w)
    amax = padded.reshape(rb, block, cb, block).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, block, axis=0), block, axis=1)[:rows, :cols]
    return (w / full).astype(E4M3), scale


def dequantize_blocks_np(w: np.ndarray, scale_inv: np.ndarray, block: int = WEIGHT_BLOCK) -> np.ndarray:
    """Host reference: ``w * scale_inv`` per block of a 2-D weight, in float32 (edge blocks ragged)."""
    full = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block, axis=0), block, axis=1)
    return np.asarray(w).astype(np.float32) * full[: w.shape[0], : w.shape[1]]


def dequantize_weight_blocks(q, scale, row_offset=0, col_offset=0, dtype=jnp.float32, block: int = WEIGHT_BLOCK,
                             convert: bool = False):
    """e4m3 [..., rows, cols] and its scale grid [..., row_blocks, col_blocks] -> ``q * scale`` in `dtype`
    (float32: exact). The local rows (columns) start at `row_offset` (`col_offset`) inside the grid's first block
    (a TP shard that starts mid-block); offsets may be traced int32 scalars. The e4m3 values are decoded through
    a table (`e4m3_to_f32`), which XLA cannot fold into a reduced-precision FP8 GEMM when the result feeds a dot;
    `convert`: XLA's convert instead, one fused elementwise pass, for weights that go to a Pallas kernel."""
    rows, cols = q.shape[-2:]
    s = jnp.take(jnp.take(scale, block_index(rows, row_offset, block), axis=-2), block_index(cols, col_offset, block),
                 axis=-1)
    return ((q.astype(jnp.float32) if convert else e4m3_to_f32(q)) * s).astype(dtype)


def quantize_activation_blocks(x, col_offset=0, n_blocks: int | None = None, block: int = WEIGHT_BLOCK):
    """Dynamic per-token 1 x 128 activation quantisation of W8A8 (docs/math.md §11): x [T, K] -> (e4m3 [T, K],
    float32 s_a [T, n_blocks]) with ``s_a = max(amax / 448, 1.1754944e-38)`` over each row's columns in one
    weight K-block and ``a_q = e4m3(x / s_a)`` (IEEE division). The groups follow the weight's blocks: local
    column j is in block ``(col_offset + j) // 128``. `n_blocks` (default `block_count(K, col_offset)`) is the
    weight grid's K extent; blocks holding no local column get the minimum scale."""
    t, k = x.shape
    nb = block_count(k, col_offset, block) if n_blocks is None else n_blocks
    xf = jnp.asarray(x, jnp.float32)
    if isinstance(col_offset, int) and col_offset == 0 and k == nb * block:
        amax = jnp.max(jnp.abs(xf).reshape(t, nb, block), axis=-1)
        kb = block_index(k, 0, block)
    else:
        kb = block_index(k, col_offset, block)
        amax = jnp.zeros((t, nb), jnp.float32).at[:, kb].max(jnp.abs(xf), mode="drop")
    s_a = mla_tile_scale(amax)
    return to_e4m3(exact_div(xf, jnp.take(s_a, kb, axis=1))), s_a


def load_e4m3(ref, lead, rows, cols, n_rows: int, n_cols: int, dtype=None):
    """In-kernel (Pallas): ref[*lead, rows, cols] of an e4m3 ref with out-of-range rows/columns read clamped (real,
    finite weights) and, when `dtype` is given, converted to it (exact) with those entries zeroed. Pallas Triton
    cannot build a masked e4m3 load's fill value (`other`), hence clamped indices instead of a mask."""
    rc, cc = jnp.clip(rows, 0, n_rows - 1), jnp.clip(cols, 0, n_cols - 1)
    x = ref[(*lead, rc[:, None], cc[None, :])]
    if dtype is None:
        return x
    ok = ((rows >= 0) & (rows < n_rows))[:, None] & ((cols >= 0) & (cols < n_cols))[None, :]
    return jnp.where(ok, x.astype(dtype), jnp.zeros((), dtype))
