"""The indexer oracle (impl "xla"): scores over the paged key cache and the top-k with the tie rule, in plain
jnp (docs/math.md §2); `prepare_queries` is shared with the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common import fp8_formats
from ..common.chunking import map_row_chunks

ROW_CHUNK = 16  # query rows per chunk: bounds the [chunk, S, Di] key gather and [chunk, H, S] logits


def request_slots(block_tables, block_size: int):
    """Physical slot of every position of every request: [R, P * block_size] (clamped to >= 0)."""
    pages = jnp.maximum(block_tables, 0).astype(jnp.int32)
    offs = jnp.arange(block_size, dtype=jnp.int32)
    return (pages[:, :, None] * block_size + offs).reshape(block_tables.shape[0], -1)


def prepare_queries(q, weights, k_cache):
    """Queries in the cache's arithmetic: bf16-style caches take q in the cache dtype; an FP8 cache (uint8
    [slots, Di + 4]) takes e4m3 queries quantised per (t, h) (UE8M0 scale s_q folded into the weights)."""
    if k_cache.dtype == jnp.uint8:
        q8, s_q = fp8_formats.quantize_index_queries(q)
        return q8, weights.astype(jnp.float32) * s_q
    return q.astype(k_cache.dtype), weights


def indexer_scores_xla(q, weights, k_cache, token_req, kv_lens, block_tables, *, block_size: int):
    """Scores [T, S] (float32, -inf where s >= kv_lens[t]); S = block-table width * block_size.
    For an FP8 cache, q are e4m3 queries and weights carry s_q (`prepare_queries`)."""
    slots = request_slots(block_tables, block_size)
    rows = k_cache[slots[token_req]]  # [T, S, Di] (or [T, S, Di + 4] uint8)
    if k_cache.dtype == jnp.uint8:
        keys, s_k = fp8_formats.split_index_rows(rows, q.shape[-1])
        # e4m3 -> f32 by table, not by convert: a convert + dot becomes an FP8 cuBLAS GEMM on the GPU
        logits = jnp.einsum("thd,tsd->ths", fp8_formats.e4m3_to_f32(q), fp8_formats.e4m3_to_f32(keys))
        scores = jnp.einsum("th,ths->ts", weights.astype(jnp.float32), jax.nn.relu(logits),
                            precision=jax.lax.Precision.HIGHEST) * s_k
    else:
        logits = jnp.einsum("thd,tsd->ths", q, rows, preferred_element_type=jnp.float32)
        scores = jnp.einsum("th,ths->ts", weights.astype(jnp.float32), jax.nn.relu(logits))
    visible = jnp.arange(slots.shape[1])[None, :] < kv_lens[:, None]
    return jnp.where(visible, scores, -jnp.inf)


def topk_positions(scores, kv_lens, topk: int, width: int | None = None):
    """Top-k (positions, scores) of `scores` [T, S] with the tie rule; entries past kv_lens[t] are (-1, -inf).
    `width`: the logical S when `scores` is padded on the right with -inf (k = min(topk, width))."""
    k = min(topk, scores.shape[-1] if width is None else width)
    # -0.0 -> +0.0 so relu's signed zeros tie exactly (a select: XLA folds `scores + 0.0` away, and top_k then
    # ranked -0.0 below +0.0)
    scores = jnp.where(scores == 0.0, 0.0, scores)
    val, idx = jax.lax.top_k(scores, k)  # stable: equal scores keep ascending position order
    keep = jnp.arange(k)[None, :] < jnp.minimum(kv_lens, k)[:, None]
    return jnp.where(keep, idx, -1).astype(jnp.int32), jnp.where(keep, val, -jnp.inf)


def indexer_topk_xla(q, weights, k_cache, token_req, kv_lens, block_tables, *, block_size: int, topk: int,
                     return_scores: bool = False, ordered: bool = True, row_chunk: int = ROW_CHUNK):
    """Reference: scores then top-k, `row_chunk` query rows at a time (never a [T, S] matrix for all T); always in
    `lax.top_k`'s order (`ordered` is the op's permission to return another, unused here)."""
    del ordered
    q, weights = prepare_queries(q, weights, k_cache)

    def rows(q_, w_, r_, n_):
        s = indexer_scores_xla(q_, w_, k_cache, r_, n_, block_tables, block_size=block_size)
        return topk_positions(s, n_, topk)

    pos, val = map_row_chunks(rows, (q, weights, token_req, kv_lens), row_chunk)
    return (pos, val) if return_scores else pos
