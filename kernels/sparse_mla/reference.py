"""The sparse MLA oracle (impl "xla"): gather the selected cache rows and attend, in plain jnp (docs/math.md §5)."""

from __future__ import annotations

import jax.numpy as jnp

from ..common import fp8_formats
from ..common.chunking import map_row_chunks

ROW_CHUNK = 64  # query rows per chunk in the xla form: bounds the gathered [chunk, K, R + Dr] workspace


def _gather_rows(cache, slots, kv_lora_rank, rope_dim):
    """Cache rows at `slots` as [..., R + Dr]: bf16 rows as stored; fp8_ds_mla rows by SPEC.md §3's read rule, the
    one every impl follows: kv as bf16(float32(e4m3) x scale) (the value a bf16 MMA sees), k_pe as stored, both
    held in float32 for the float32 accumulation."""
    rows = cache[slots]
    if cache.dtype != jnp.uint8:
        return rows
    kv, k_pe = fp8_formats.dequantize_mla_rows(rows, kv_lora_rank, rope_dim)
    kv = kv.astype(jnp.bfloat16).astype(jnp.float32)  # one rounding to bf16, as the kernels' tiles hold it
    return jnp.concatenate([kv, k_pe.astype(jnp.float32)], axis=-1)


def _sparse_mla_rows(q, cache, indices, scale, kv_lora_rank):
    valid = indices >= 0
    rows = _gather_rows(cache, jnp.where(valid, indices, 0), kv_lora_rank, q.shape[-1] - kv_lora_rank)
    s = jnp.einsum("thd,tkd->thk", q, rows, preferred_element_type=jnp.float32) * scale
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1)
    o = jnp.einsum("thk,tkr->thr", p, rows[..., :kv_lora_rank].astype(jnp.float32))
    has = denom > 0
    o = o / jnp.where(has, denom, 1.0)[..., None]
    lse = jnp.where(has, m[..., 0] + jnp.log(jnp.where(has, denom, 1.0)), -jnp.inf)
    return o, lse


def sparse_mla_xla(q, cache, indices, *, scale: float, kv_lora_rank: int, row_chunk: int = ROW_CHUNK):
    """Reference: gather the selected rows and attend, `row_chunk` query rows at a time."""
    if cache.dtype == jnp.uint8:  # fp8_ds_mla
        want = fp8_formats.mla_row_bytes(kv_lora_rank, q.shape[-1] - kv_lora_rank)
        if cache.shape[-1] != want:
            raise ValueError(f"sparse_mla: fp8_ds_mla row of {cache.shape[-1]} bytes != {want}")
        q = q.astype(jnp.float32)
    elif q.shape[-1] != cache.shape[-1]:
        raise ValueError(f"sparse_mla: query row width {q.shape[-1]} != cache row width {cache.shape[-1]}")
    else:
        q = q.astype(cache.dtype)
    if indices.shape[0] != q.shape[0]:
        raise ValueError(f"sparse_mla: indices rows {indices.shape[0]} != query rows {q.shape[0]}")
    return map_row_chunks(lambda q_, i_: _sparse_mla_rows(q_, cache, i_, scale, kv_lora_rank), (q, indices), row_chunk)
