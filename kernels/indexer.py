"""Lightning indexer scores and top-k (SPEC §2): which cached tokens each query row attends to.

score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]), causal (s <= pos(t)), over the keys of the row's own
request, read from the paged indexer cache through the block table. The softmax scale 128^-0.5 and
32^-0.5 are folded into `w` by the caller (both positive, so they commute with relu).
Top-k keeps min(topk, pos(t) + 1) positions: higher score first, then smaller position; the rest are -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .chunking import map_row_chunks

ROW_CHUNK = 16  # query rows per chunk: bounds the [chunk, S, Di] key gather and [chunk, H, S] logits


def request_slots(block_tables, block_size: int):
    """Physical slot of every position of every request: [R, P * block_size] (clamped to >= 0)."""
    pages = jnp.maximum(block_tables, 0).astype(jnp.int32)
    offs = jnp.arange(block_size, dtype=jnp.int32)
    return (pages[:, :, None] * block_size + offs).reshape(block_tables.shape[0], -1)


def indexer_scores_xla(q, weights, k_cache, token_req, positions, block_tables, *, block_size: int):
    """Causal scores [T, S] (float32, -inf where s > pos(t)); S = block-table width * block_size."""
    slots = request_slots(block_tables, block_size)
    keys = k_cache[slots[token_req]]  # [T, S, Di]
    logits = jnp.einsum("thd,tsd->ths", q, keys, preferred_element_type=jnp.float32)
    scores = jnp.einsum("th,ths->ts", weights.astype(jnp.float32), jax.nn.relu(logits))
    causal = jnp.arange(slots.shape[1])[None, :] <= positions[:, None]
    return jnp.where(causal, scores, -jnp.inf)


def topk_positions(scores, positions, topk: int):
    """Top-k positions of causal `scores` [T, S] with the tie rule; entries past pos(t)+1 are -1."""
    k = min(topk, scores.shape[-1])
    scores = scores + 0.0  # -0.0 -> +0.0 so relu's signed zeros tie exactly
    _, idx = jax.lax.top_k(scores, k)  # stable: equal scores keep ascending position order
    n_valid = jnp.minimum(positions + 1, k)
    return jnp.where(jnp.arange(k)[None, :] < n_valid[:, None], idx, -1).astype(jnp.int32)


def indexer_topk_xla(q, weights, k_cache, token_req, positions, block_tables, *, block_size: int, topk: int,
                     row_chunk: int = ROW_CHUNK):
    """Reference: scores then top-k, `row_chunk` query rows at a time (never a [T, S] matrix for all T)."""
    q = q.astype(k_cache.dtype)

    def rows(q_, w_, r_, p_):
        s = indexer_scores_xla(q_, w_, k_cache, r_, p_, block_tables, block_size=block_size)
        return topk_positions(s, p_, topk)

    return map_row_chunks(rows, (q, weights, token_req, positions), row_chunk)


def indexer_topk(q, weights, k_cache, token_req, positions, block_tables, *, block_size: int, topk: int,
                 impl: str = "xla"):
    """Top-k positions [T, min(topk, S)] (int32, -1 padded) for indexer queries `q` [T, H, Di] (roped),
    head weights `weights` [T, H] (scales folded in), the paged key cache `k_cache` [slots, Di], each row's
    request `token_req` [T] and position `positions` [T], and `block_tables` [R, pages]."""
    if impl == "xla":
        return indexer_topk_xla(q, weights, k_cache, token_req, positions, block_tables,
                                block_size=block_size, topk=topk)
    raise ValueError(f"indexer_topk: unknown impl {impl!r} (available: 'xla')")
