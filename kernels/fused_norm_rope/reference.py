"""The fused norm/RoPE/cache-write oracle (impl "xla"), in plain jnp (docs/math.md §4)."""

from __future__ import annotations

import jax.numpy as jnp

from ..common import fp8_formats
from ..common.norms import layer_norm, rms_norm
from ..common.rope import apply_rope, rope_cos_sin

QKV_NORM_EPS = 1e-6  # q_a_layernorm, kv_a_layernorm and the indexer LayerNorm


def _scatter_rows(cache, slots, rows, block_size=None):
    """cache[slots] = rows, dropping rows whose slot is negative (or past the cache).

    cache: [slots, pitch] (slot = row) or [pages, page_rows, pitch] with slot = page * block_size + offset
    (block_size defaults to page_rows; page_rows > block_size is a padded page stride). Rows narrower than
    the pitch fill its first columns; padding is left as it is."""
    shape = cache.shape
    if cache.ndim == 3:
        pages, page_rows, pitch = shape
        bs = page_rows if block_size is None else block_size
        logical, phys = pages * bs, (slots // bs) * page_rows + slots % bs
        flat = cache.reshape(pages * page_rows, pitch)
    else:
        logical, phys, flat = shape[0], slots, cache
    idx = jnp.where((slots < 0) | (slots >= logical), flat.shape[0], phys)  # out of range -> dropped
    rows = rows.astype(cache.dtype)
    if rows.shape[-1] == flat.shape[-1]:
        flat = flat.at[idx].set(rows, mode="drop")
    else:
        flat = flat.at[idx, :rows.shape[-1]].set(rows, mode="drop")
    return flat.reshape(shape)


def fused_norm_rope_cache_xla(q_c, kv_c, positions, slot_mapping, q_norm_w, kv_norm_w, mla_cache, *,
                              rope_theta, rope_interleave: bool = True, eps: float = QKV_NORM_EPS,
                              index_k=None, index_norm_w=None, index_norm_b=None, index_cache=None,
                              index_slot_mapping=None, index_rope_interleave: bool = True, topk_buf=None,
                              block_size=None):
    """Reference form; see `fused_norm_rope_cache`."""
    kv_lora_rank = kv_norm_w.shape[0]
    rope_dim = kv_c.shape[-1] - kv_lora_rank
    q_n = rms_norm(q_c, q_norm_w, eps)  # (a): before, and independent of, any slot test
    cos, sin = rope_cos_sin(positions, rope_dim, rope_theta)
    kv = rms_norm(kv_c[:, :kv_lora_rank], kv_norm_w, eps)
    k_pe = apply_rope(kv_c[:, kv_lora_rank:], cos, sin, interleave=rope_interleave)
    if mla_cache.dtype == jnp.uint8:  # fp8_ds_mla bytes
        row = fp8_formats.quantize_mla_rows(kv, k_pe)
    else:
        row = jnp.concatenate([kv.astype(mla_cache.dtype), k_pe.astype(mla_cache.dtype)], axis=-1)
    mla_cache = _scatter_rows(mla_cache, slot_mapping, row, block_size)  # (b) + (c)
    if index_cache is not None:
        k = layer_norm(index_k, index_norm_w, index_norm_b, eps)
        k_rot = apply_rope(k[:, :rope_dim], cos, sin, interleave=index_rope_interleave)
        k = jnp.concatenate([k_rot, k[:, rope_dim:]], axis=-1)
        islots = slot_mapping if index_slot_mapping is None else index_slot_mapping
        if index_cache.dtype == jnp.uint8:  # FP8 keys + UE8M0 scale
            k = fp8_formats.quantize_index_rows(k)
        index_cache = _scatter_rows(index_cache, jnp.where(slot_mapping < 0, -1, islots), k, block_size)  # (b)+(d)
        if topk_buf is not None:
            topk_buf = jnp.full_like(topk_buf, -1)  # (e)
    return q_n, mla_cache, index_cache, topk_buf
