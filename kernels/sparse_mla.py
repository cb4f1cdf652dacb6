"""Sparse MLA attention (SPEC §5): absorbed query rows against selected rows of the paged MLA cache.

q [T, H, R + Dr] attends cache rows [kv (R) | k_pe (Dr)] at `indices` [T, K] (physical slots, -1 = none);
the value of a row is its kv latent. Returns o [T, H, R] float32 and lse [T, H] (natural log), with
(0, -inf) for a row that has no valid index: the identity of `merge_partials`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .chunking import map_row_chunks

ROW_CHUNK = 64  # query rows per chunk in the xla form: bounds the gathered [chunk, K, R + Dr] workspace


def _sparse_mla_rows(q, cache, indices, scale, kv_lora_rank):
    valid = indices >= 0
    rows = cache[jnp.where(valid, indices, 0)]  # [T, K, R + Dr]
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
    if q.shape[-1] != cache.shape[-1]:
        raise ValueError(f"sparse_mla: query row width {q.shape[-1]} != cache row width {cache.shape[-1]}")
    if indices.shape[0] != q.shape[0]:
        raise ValueError(f"sparse_mla: indices rows {indices.shape[0]} != query rows {q.shape[0]}")
    q = q.astype(cache.dtype)
    return map_row_chunks(lambda q_, i_: _sparse_mla_rows(q_, cache, i_, scale, kv_lora_rank), (q, indices), row_chunk)


def sparse_mla(q, cache, indices, *, scale: float, kv_lora_rank: int, impl: str = "xla"):
    """Dispatch to the implementation named by `impl` ("xla" today)."""
    if impl == "xla":
        return sparse_mla_xla(q, cache, indices, scale=scale, kv_lora_rank=kv_lora_rank)
    raise ValueError(f"sparse_mla: unknown impl {impl!r} (available: 'xla')")
