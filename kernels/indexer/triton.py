"""Pallas Triton indexer scores (docs/math.md §2): score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) over the paged
indexer cache, then the top-k with the tie rule of docs/math.md §2: the select kernel (indexer/topk_triton.py, op
"topk") where it takes the row width, else `kernels.indexer.topk_positions` (`indexer_topk_triton`, the op's
"triton" impl; `topk_select_impl` is the rule). Both give the same positions and scores.

Decode (per-row, bf16 and FP8 caches): grid (T, S / block_n). Program (t, j) reads row t's request and its visible
length n = kv_lens[t], loads the queries once (FP8: e4m3 bits, no decode), then loops over block_n / block_s key
tiles (Triton pipelines the loop's loads, `num_stages`): per tile, the pages of its positions from the block table,
the key rows gathered from the cache (bf16 [slots, Di], or FP8 uint8 [slots, Di + 4]: e4m3 + a float32 UE8M0
scale, kernels/common/fp8_formats.py), one dot [block_s, Di] x [Di, H] (FP8: e4m3 x e4m3 on the tensor cores, float32
accumulation, with `fp8_dot`; else keys decoded to bf16), relu, the head weights, the key scales; block_s float32
scores written (-inf at s >= n; tiles wholly past n read nothing). `loop_block_n` sizes block_n so that a small
batch still fills the GPU. `block_n=0` (and float32 caches) take the one-tile kernel: grid (T, S / block_s), the
queries reloaded per tile. The top-k runs over query rows in chunks (`row_chunk`), so a long prefill never holds a
[T, S] float32 matrix.

Prefill has a row-block form (`block_t` > 1, chosen when T >= ROW_BLOCK_MIN_T): grid (T / block_t,
S / block_s), program (i, j) scores query rows [i * block_t, +block_t) against the same block_s keys. A
prefill chunk's rows are contiguous per request, so a block's rows nearly always share one request: the
key tile is then gathered once and reused by all block_t rows, cutting the cache reads block_t-fold (per
row, a 32K prefill re-reads every key 32K times). Blocks whose rows span requests (a request boundary,
decode rows) gather per row in the same program.
Launch configs are `IndexerConfig`s (`default_config` picks one per shape).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import registry
from ..common import fp8_formats
from . import ROW_BLOCK, ROW_BLOCK_MIN_T, takes_row_blocks  # noqa: F401
from .stages import SCORE_BUDGET, SELECT_MIN_ROWS, scores_then_topk, topk_select_impl  # noqa: F401
from ..common.triton_common import check_addressable, col_range, dot, gather, is_pow2, u8_words, with_options
from .config import FLOAT32_BLOCK_S, LOOP_PROGRAMS, IndexerConfig, default_config, loop_block_n  # noqa: F401


def _key_tile(bt_ref, k_ref, req, pos, vis, *, page, di, fp8, interpret):
    """Key rows of request `req` at positions `pos` [bs] (not read where not `vis`): (k [bs, Di] in the dot
    dtype, s_k [bs] float32 per-key scales or None for a bf16 cache)."""
    pcol = pos // page
    if interpret:
        pg = jnp.where(vis, bt_ref[req, pcol], 0)
    else:
        pg = plgpu.load(bt_ref.at[req, pcol], mask=vis, other=0)
    slot = jnp.maximum(pg, 0) * page + pos % page
    k = gather(k_ref, slot, col_range(0, di), vis, interpret)  # [bs, Di]
    if not fp8:
        return k, None
    k = fp8_formats.decode_e4m3_bits(k, jnp.bfloat16)
    s_k = jax.lax.bitcast_convert_type(u8_words(gather(k_ref, slot, col_range(di, 4), vis, interpret))[0],
                                       jnp.float32)  # [bs, 1]
    return k, jnp.sum(s_k, axis=1)  # [bs] (a sum of one term: exact; Triton has no cheap reshape)


def _row_scores(q, w, k, s_k):
    """sum_h w[h] relu(q[h] . k[s]) (* s_k[s]): q [H, Di] (e4m3 bits as uint8 for an FP8 cache), w [H],
    k [bs, Di] -> [bs] float32."""
    if q.dtype == jnp.uint8:
        q = fp8_formats.decode_e4m3_bits(q, jnp.bfloat16)
    logits = dot(q, k, trans_b=True)  # [H, bs] f32
    sc = jnp.sum(w[:, None] * jnp.maximum(logits, 0.0), axis=0)
    return sc if s_k is None else sc * s_k


def _scores_kernel(req_ref, len_ref, q_ref, w_ref, bt_ref, k_ref, o_ref, *, block_s, page, di, fp8, interpret):
    j = pl.program_id(1)
    req = req_ref[0]
    n = len_ref[0]
    start = j * block_s

    @pl.when(start < n)
    def _():
        pos = start + jax.lax.iota(jnp.int32, block_s)
        vis = pos < n
        k, s_k = _key_tile(bt_ref, k_ref, req, pos, vis, page=page, di=di, fp8=fp8, interpret=interpret)
        o_ref[...] = jnp.where(vis, _row_scores(q_ref[...], w_ref[...], k, s_k), -jnp.inf)

    @pl.when(start >= n)
    def _():
        o_ref[...] = jnp.full((block_s,), -jnp.inf, jnp.float32)


def _loop_queries(q_ref, fp8, fp8_dot):
    """The looped kernels' queries, read once per program: [H, Di] in the dot's dtype (FP8: the e4m3 bits as e4m3,
    or decoded to bf16 without `fp8_dot`)."""
    q = q_ref[...]
    if fp8:
        q = jax.lax.bitcast_convert_type(q, fp8_formats.FP8)
        if not fp8_dot:
            q = q.astype(jnp.bfloat16)
    return q


def _loop_pages(bt_ref, req, pos, page):
    """Page of each position `pos` [bs] of request `req` (clamped to the block table's width)."""
    return bt_ref[req, jnp.minimum(pos // page, bt_ref.shape[1] - 1)]


def _loop_keys(k_ref, pos, pg, n, *, page, di, fp8):
    """Key rows at positions `pos` [bs] on pages `pg`: (k [bs, Di] as stored, FP8 per-key scales [bs] float32 or
    None for a bf16 cache); invisible keys (pos >= n) read row 0."""
    slot = jnp.where(pos < n, jnp.maximum(pg, 0) * page + pos % page, 0)
    k = k_ref[slot[:, None], col_range(0, di)[None, :]]  # [bs, Di]
    if not fp8:
        return k, None
    return k, jnp.sum(jax.lax.bitcast_convert_type(u8_words(k_ref[slot[:, None], col_range(di, 4)[None, :]])[0],
                                                   jnp.float32), axis=1)  # [bs]


def _loop_tile_scores(k, s_k, q, w, *, fp8, fp8_dot):
    """sum_h w[h] relu(k[s] . q[h]) (* s_k[s]) of one key tile as `_loop_keys` read it: [bs] float32. The FP8
    tile becomes e4m3 in registers (a bitcast: free)."""
    if fp8:
        k = jax.lax.bitcast_convert_type(k, fp8_formats.FP8)
        if not fp8_dot:
            k = k.astype(jnp.bfloat16)
    logits = dot(k, q, trans_b=True)  # [bs, H] float32
    sc = jnp.sum(jnp.maximum(logits, 0.0) * w[None, :], axis=1)
    return sc * s_k if fp8 else sc


def _blank_tiles(o_ref, busy, tiles, block_s):
    """-inf in the output tiles [busy, tiles) of a looped program (tiles wholly past n read nothing)."""
    def blank(i, carry):
        o_ref[pl.ds(pl.multiple_of(i * block_s, block_s), block_s)] = jnp.full((block_s,), -jnp.inf, jnp.float32)
        return carry
    jax.lax.fori_loop(busy, tiles, blank, 0)


def _scores_loop_kernel(req_ref, len_ref, q_ref, w_ref, bt_ref, k_ref, o_ref, *, block_s, page, di, fp8, fp8_dot,
                        interpret):
    """Row t, keys [j * block_n, +block_n) in `block_n / block_s` tiles of a loop (Triton pipelines its loads). The
    queries are loaded (and, for a bf16 dot, decoded) once per program. FP8 with `fp8_dot`: the e4m3 key tile goes
    straight to an e4m3 x e4m3 tensor-core dot (float32 accumulation) against the e4m3 queries; else keys decode to
    bf16. Tiles wholly past n read nothing and write -inf; the last tile reads row 0 for its invisible keys. The
    FP8 cache stays uint8 (a bitcast of it in XLA may copy it) and its tiles become e4m3 in registers."""
    req = req_ref[0]
    n = len_ref[0]
    tiles = o_ref.shape[0] // block_s
    start = pl.program_id(1) * o_ref.shape[0]
    q = _loop_queries(q_ref, fp8, fp8_dot)  # [H, Di]
    w = w_ref[...]
    busy = jnp.clip((n - start + block_s - 1) // block_s, 0, tiles)  # tiles holding a visible key

    def tile(i, carry):
        pos = start + i * block_s + jax.lax.iota(jnp.int32, block_s)
        k, s_k = _loop_keys(k_ref, pos, _loop_pages(bt_ref, req, pos, page), n, page=page, di=di, fp8=fp8)
        sc = _loop_tile_scores(k, s_k, q, w, fp8=fp8, fp8_dot=fp8_dot)
        o_ref[pl.ds(pl.multiple_of(i * block_s, block_s), block_s)] = jnp.where(pos < n, sc, -jnp.inf)
        return carry

    jax.lax.fori_loop(0, busy, tile, 0)
    _blank_tiles(o_ref, busy, tiles, block_s)


def _scores_rows_kernel(req_ref, len_ref, q_ref, w_ref, bt_ref, k_ref, o_ref, *, block_s, page, di, fp8,
                        interpret):
    """Rows [i * block_t, +block_t) x keys [j * block_s, +block_s): one key-tile gather when the rows share a
    request, else one per row. Rows past T (padding) have kv_len 0 and write -inf."""
    block_t = o_ref.shape[0]
    start = pl.program_id(1) * block_s
    reqs = req_ref[...]
    lens = len_ref[...]
    n_max = jnp.max(lens)
    shared = jnp.min(reqs) == jnp.max(reqs)
    pos = start + jax.lax.iota(jnp.int32, block_s)
    tile = {"page": page, "di": di, "fp8": fp8, "interpret": interpret}

    @pl.when((start < n_max) & shared)
    def _():
        k, s_k = _key_tile(bt_ref, k_ref, req_ref[0], pos, pos < n_max, **tile)
        for r in range(block_t):  # static: block_t dots reuse the one tile
            o_ref[r, :] = jnp.where(pos < len_ref[r], _row_scores(q_ref[r], w_ref[r], k, s_k), -jnp.inf)

    @pl.when((start < n_max) & jnp.logical_not(shared))
    def _():
        for r in range(block_t):  # masked loads: a row with no visible key here reads nothing
            vis = pos < len_ref[r]
            k, s_k = _key_tile(bt_ref, k_ref, req_ref[r], pos, vis, **tile)
            o_ref[r, :] = jnp.where(vis, _row_scores(q_ref[r], w_ref[r], k, s_k), -jnp.inf)

    @pl.when(start >= n_max)
    def _():
        o_ref[...] = jnp.full((block_t, block_s), -jnp.inf, jnp.float32)


def supports(q, weights, k_cache, *_, **__) -> str | None:
    """Why the kernel cannot take these shapes (None: it can): its tiles are powers of two, so the key width Di
    must be a power of two >= 16 (the narrowest dot) and the head count H at most 16 (padded) or a power of
    two."""
    t, h, di = q.shape
    if not (is_pow2(di) and di >= 16):
        return f"indexer key width Di {di} must be a power of two >= 16"
    if h > 16 and not is_pow2(h):
        return f"indexer heads H {h} must be <= 16 or a power of two"
    return None


def indexer_scores_triton(q, weights, k_cache, token_req, kv_lens, block_tables, *, block_size: int,
                          config: IndexerConfig | None = None, interpret: bool = False, **overrides):
    """Scores [T, S_pad] float32 (S_pad = S rounded up to block_s; -inf at s >= kv_lens[t]).

    q [T, H, Di]: bf16 queries for a bf16 cache; for an FP8 (uint8) cache, e4m3 values (any float dtype
    holding them exactly) with s_q already folded into `weights` [T, H].
    `config` (default `default_config`); `overrides` replace fields of it by name (block_s, block_t,
    num_warps, num_stages; None keeps the field); block_s is clamped to S rounded up to a power of two.
    `interpret`: run under the Pallas interpreter."""
    t, h, di = q.shape
    s = block_tables.shape[1] * block_size
    rows = registry.config_rows(t)  # the op's rows, or a batch-invariant decode step's fixed count at every bucket
    cfg = config or default_config(rows, s, k_cache.dtype)
    # an option given as None keeps the config's value
    cfg = with_options(cfg, {k: v for k, v in overrides.items() if v is not None}, "indexer")
    block_t = cfg.block_t
    fp8 = k_cache.dtype == jnp.uint8
    if not interpret:
        check_addressable(k_cache, "indexer cache")
    f32 = k_cache.dtype == jnp.float32
    block_s = min(cfg.block_s, max(16, pl.next_power_of_2(s)))
    n_blk = -(-s // block_s)
    h_pad = max(16, h)
    if fp8:
        # The e4m3 bits go in as bytes and become bf16 inside the kernel. An XLA convert e4m3 -> bf16 here would
        # meet the quantising convert f32 -> e4m3 of `prepare_queries` in one program, and XLA's GPU pipeline
        # (SimplifyFPConversions, on under its default xla_allow_excess_precision) folds such a chain into one
        # f32 -> bf16 convert: the kernel would score unquantised queries (the H200 test saw 0.6-2.4%).
        q = jax.lax.bitcast_convert_type(q.astype(jnp.float8_e4m3fn), jnp.uint8)
    else:
        q = q.astype(k_cache.dtype)
    weights = weights.astype(jnp.float32)
    token_req = token_req.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    if h_pad != h:  # zero weights: padded heads add nothing
        q = jnp.pad(q, ((0, 0), (0, h_pad - h), (0, 0)))
        weights = jnp.pad(weights, ((0, 0), (0, h_pad - h)))
    name = "indexer_scores_fp8" if fp8 else "indexer_scores_bf16"
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    opts = {"block_s": block_s, "page": block_size, "di": di, "fp8": fp8, "interpret": interpret}
    call = functools.partial(_scores_call, block_tables=block_tables, k_cache=k_cache, params=params,
                             interpret=interpret)

    def per_row(token_req, kv_lens, q, weights):
        if cfg.block_n == 0 or f32:
            registry.launch("indexer_scores", (cfg, block_s, 0))
            return call(functools.partial(_scores_kernel, **opts), token_req, kv_lens, q, weights, rows=None,
                        width=block_s, n_prog=n_blk, name=name)
        block_n = min(cfg.block_n or loop_block_n(rows, s, block_s), n_blk * block_s)
        registry.launch("indexer_scores", (cfg, block_s, block_n))
        return call(functools.partial(_scores_loop_kernel, fp8_dot=cfg.fp8_dot, **opts), token_req, kv_lens, q,
                    weights, rows=None, width=block_n, n_prog=-(-s // block_n), name=name + "_loop")

    def row_block(token_req, kv_lens, q, weights, block_t):
        rows = q.shape[0]
        t_pad = -(-rows // block_t) * block_t
        if t_pad != rows:  # padding rows: the last row's request (keeps its block shared), kv_len 0 (write -inf)
            pad = t_pad - rows
            token_req = jnp.concatenate([token_req, jnp.broadcast_to(token_req[-1:], (pad,))])
            kv_lens = jnp.pad(kv_lens, (0, pad))
            q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
            weights = jnp.pad(weights, ((0, pad), (0, 0)))
        registry.launch("indexer_scores_rows", (cfg, block_s, block_t))
        out = call(functools.partial(_scores_rows_kernel, **opts), token_req, kv_lens, q, weights, rows=block_t,
                   width=block_s, n_prog=n_blk, name=name + "_rows")
        return out if t_pad == rows else out[:rows]

    args = (token_req, kv_lens, q, weights)
    if block_t == 1:
        return per_row(*args)
    if block_t is not None:
        return row_block(*args, block_t)
    # Decided from static shapes (the rule "indexer.scores_form"), not by a `lax.cond` on the rows: a conditional's
    # predicate is read back by the host on a GPU, which stalls the dispatch of every step behind the previous one.
    if registry.decide("indexer.scores_form", t, block_tables.shape[0], f32) == "row_block":
        return row_block(*args, ROW_BLOCK)
    return per_row(*args)


def _scores_call(kernel, token_req, kv_lens, q, weights, *, block_tables, k_cache, rows, width, n_prog, params,
                 interpret, name):
    """One launch of a scores kernel on grid (T / rows, n_prog): program (i, j) scores query rows [i * rows, +rows)
    (`rows` None: one row, its axis squeezed from the kernel's view of q, weights and the output) against positions
    [j * width, +width), into float32 [T, n_prog * width]."""
    t, h_pad, di = q.shape
    r = 1 if rows is None else rows
    return pl.pallas_call(
        kernel,
        grid=(t // r, n_prog),
        in_specs=[
            pl.BlockSpec((r,), lambda i, j: (i,)),
            pl.BlockSpec((r,), lambda i, j: (i,)),
            pl.BlockSpec((rows, h_pad, di), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((rows, h_pad), lambda i, j: (i, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((rows, width), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((t, n_prog * width), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name=name,
    )(token_req, kv_lens, q, weights, block_tables.astype(jnp.int32), k_cache)


def indexer_topk_triton(q, weights, k_cache, token_req, kv_lens, block_tables, *, block_size: int, topk: int,
                        return_scores: bool = False, ordered: bool = True, row_chunk: int | None = None,
                        interpret: bool = False, topk_impl: str | None = None, topk_config=None, **kernel_options):
    """The "triton" impl of `kernels.indexer.indexer_topk`: Pallas Triton scores (`indexer_scores_triton`, with
    `kernel_options`: config, block_s, block_t, num_warps, num_stages, block_n, fp8_dot), then the top-k
    (`kernels.indexer.stages.scores_then_topk`: `topk_impl`, `topk_config`, `ordered`, `row_chunk`)."""
    def scores(q_, w_, r_, n_):
        return indexer_scores_triton(q_, w_, k_cache, r_, n_, block_tables, block_size=block_size,
                                     interpret=interpret, **kernel_options)
    return scores_then_topk(scores, q, weights, k_cache, token_req, kv_lens, block_tables, block_size=block_size,
                            topk=topk, return_scores=return_scores, ordered=ordered, row_chunk=row_chunk,
                            interpret=interpret, topk_impl=topk_impl, topk_config=topk_config, name="triton")
