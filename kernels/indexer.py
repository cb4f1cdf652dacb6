"""Lightning indexer scores and top-k (SPEC §2): which cached tokens each query row attends to.

score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) over the keys of the row's own request, read from the
paged indexer cache through the block table. Row t sees the first `kv_lens[t]` cached positions of its
request (pos(t) + 1 on one device; under DCP, the rank's local tokens at or before pos(t)), so the op
knows nothing of how positions are spread over ranks. The softmax scale 128^-0.5 and 32^-0.5 are folded
into `w` by the caller (both positive, so they commute with relu).
Top-k keeps min(topk, kv_lens[t]) positions: higher score first, then smaller position; the rest are -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import fp8_formats
from .chunking import map_row_chunks

# Top-k stage of impl="triton": "xla" (jax.lax.top_k over the kernel's scores; the default: 148 us for
# B=32 x 32K on the H200) or "triton" (the radix-select kernel of indexer_triton: one CTA per row, exact and
# CPU-tested, but latency-bound at ~330 us per row on the H200 and not yet checked natively there).
TOPK_IMPL = "xla"
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
    scores = scores + 0.0  # -0.0 -> +0.0 so relu's signed zeros tie exactly
    val, idx = jax.lax.top_k(scores, k)  # stable: equal scores keep ascending position order
    keep = jnp.arange(k)[None, :] < jnp.minimum(kv_lens, k)[:, None]
    return jnp.where(keep, idx, -1).astype(jnp.int32), jnp.where(keep, val, -jnp.inf)


def indexer_topk_xla(q, weights, k_cache, token_req, kv_lens, block_tables, *, block_size: int, topk: int,
                     return_scores: bool = False, row_chunk: int = ROW_CHUNK):
    """Reference: scores then top-k, `row_chunk` query rows at a time (never a [T, S] matrix for all T)."""
    q, weights = prepare_queries(q, weights, k_cache)

    def rows(q_, w_, r_, n_):
        s = indexer_scores_xla(q_, w_, k_cache, r_, n_, block_tables, block_size=block_size)
        return topk_positions(s, n_, topk)

    pos, val = map_row_chunks(rows, (q, weights, token_req, kv_lens), row_chunk)
    return (pos, val) if return_scores else pos


def indexer_topk_triton(q, weights, k_cache, token_req, kv_lens, block_tables, *, block_size: int, topk: int,
                        return_scores: bool = False, row_chunk: int | None = None, interpret: bool = False,
                        topk_impl: str = TOPK_IMPL, **kernel_options):
    """Pallas Triton scores, then `topk_positions`, `row_chunk` query rows at a time (default: as many rows
    as keep the float32 scores under SCORE_BUDGET, rounded down to a power of two), so a 32K x 32K prefill never
    holds [T, S] scores.
    topk_impl: "triton" (radix select + compaction kernel, then a stable sort of the k winners) or "xla"
    (`jax.lax.top_k` over the scores)."""
    from .indexer_triton import SCORE_BUDGET, indexer_scores_triton, topk_triton

    q, weights = prepare_queries(q, weights, k_cache)
    s = block_tables.shape[1] * block_size
    if row_chunk is None:
        # a power of two: prefill chunks (powers of two) then split into whole row chunks, no padded rows
        row_chunk = 1 << max(0, (SCORE_BUDGET // max(s, 1)).bit_length() - 1)

    def rows(q_, w_, r_, n_):
        sc = indexer_scores_triton(q_, w_, k_cache, r_, n_, block_tables, block_size=block_size,
                                   interpret=interpret, **kernel_options)
        if topk_impl == "triton":
            return topk_triton(sc, n_, topk, s, interpret=interpret)
        return topk_positions(sc, n_, topk, width=s)

    pos, val = map_row_chunks(rows, (q, weights, token_req, kv_lens), row_chunk)
    return (pos, val) if return_scores else pos


def indexer_topk(q, weights, k_cache, token_req, kv_lens, block_tables, *, block_size: int, topk: int,
                 return_scores: bool = False, impl: str = "xla", **kernel_options):
    """Top-k positions [T, min(topk, S)] (int32, -1 padded) for indexer queries `q` [T, H, Di] (roped),
    head weights `weights` [T, H] (scales folded in), the paged key cache `k_cache` [slots, Di], each row's
    request `token_req` [T], its number of visible keys `kv_lens` [T] and `block_tables` [R, pages].
    With `return_scores`, also their float32 scores (-inf where -1): the DCP global top-k merges these.
    `k_cache` is bf16 [slots, Di] or FP8 uint8 [slots, Di + 4] (queries are then quantised per (t, h)).
    impl: "xla" (oracle, CPU default), "triton" (Pallas Triton scores + chunked top-k, the GPU default),
    "triton_interpret" (the same kernel under the Pallas interpreter, for CPU tests); `kernel_options`
    (block_s, num_warps, num_stages, row_chunk) go to the Triton form."""
    if impl == "xla":
        return indexer_topk_xla(q, weights, k_cache, token_req, kv_lens, block_tables, block_size=block_size,
                                topk=topk, return_scores=return_scores)
    if impl in ("triton", "triton_interpret"):
        return indexer_topk_triton(q, weights, k_cache, token_req, kv_lens, block_tables, block_size=block_size,
                                   topk=topk, return_scores=return_scores, interpret=impl == "triton_interpret",
                                   **kernel_options)
    raise ValueError(f"indexer_topk: unknown impl {impl!r} (available: 'xla', 'triton', 'triton_interpret')")
