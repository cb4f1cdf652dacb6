"""Pallas Triton indexer scores (SPEC §2): score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) over the paged
indexer cache, then the top-k with the SPEC tie rule by `kernels.indexer.topk_positions`.

Grid (T, S / block_s). Program (t, j) reads row t's request, its visible length n = kv_lens[t], the pages of
positions [j * block_s, +block_s) from the block table, gathers those key rows from the cache (bf16
[slots, Di], or FP8 uint8 [slots, Di + 4]: e4m3 + a float32 UE8M0 scale, kernels/fp8_formats.py), and
writes block_s float32 scores (-inf at s >= n; blocks wholly past n read nothing). The top-k runs over
query rows in chunks (`row_chunk`), so a long prefill never holds a [T, S] float32 matrix.

Prefill has a row-block form (`block_t` > 1, chosen when T >= ROW_BLOCK_MIN_T): grid (T / block_t,
S / block_s), program (i, j) scores query rows [i * block_t, +block_t) against the same block_s keys. A
prefill chunk's rows are contiguous per request, so a block's rows nearly always share one request: the
key tile is then gathered once and reused by all block_t rows, cutting the cache reads block_t-fold (per
row, a 32K prefill re-reads every key 32K times). Blocks whose rows span requests (a request boundary,
decode rows) gather per row in the same program.
Everything Triton-specific lives in this module and sparse_mla_triton.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .sparse_mla_triton import check_addressable, col_range, dot, gather, u8_words

SCORE_BUDGET = 1 << 25  # float32 scores held at once by the top-k stage (128 MiB)
ROW_BLOCK_MIN_T = 64  # rows from which indexer_scores_triton takes the row-block form
ROW_BLOCK = 16  # its query rows per program: block_t unrolled [H, Di] x [Di, block_s] dots
# float32 keys (the reference dtype): Triton runs an IEEE float32 dot on the FMA units, unrolled per thread
# ([64, 128] x [128, 128] is 8K FMAs a thread, x16 rows x2 branches in the row-block form), which ptxas took
# minutes to compile at GLM shapes. So float32 takes 32-key tiles and the per-row kernel only.
FLOAT32_BLOCK_S = 32


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
    k = _e4m3_bits_to_bf16(k)
    s_k = jax.lax.bitcast_convert_type(u8_words(gather(k_ref, slot, col_range(di, 4), vis, interpret))[0],
                                       jnp.float32)  # [bs, 1]
    return k, jnp.sum(s_k, axis=1)  # [bs] (a sum of one term: exact; Triton has no cheap reshape)


def _e4m3_bits_to_bf16(b):
    """uint8 e4m3 bits -> bf16 values (exact), inside a kernel, where XLA cannot fold the decode away."""
    return jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.bfloat16)


def _row_scores(q, w, k, s_k):
    """sum_h w[h] relu(q[h] . k[s]) (* s_k[s]): q [H, Di] (e4m3 bits as uint8 for an FP8 cache), w [H],
    k [bs, Di] -> [bs] float32."""
    if q.dtype == jnp.uint8:
        q = _e4m3_bits_to_bf16(q)
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


def indexer_scores_triton(q, weights, k_cache, token_req, kv_lens, block_tables, *, block_size: int,
                          block_s: int | None = None, block_t: int | None = None, num_warps: int = 4,
                          num_stages: int = 1, interpret: bool = False):
    """Scores [T, S_pad] float32 (S_pad = S rounded up to block_s; -inf at s >= kv_lens[t]).

    q [T, H, Di]: bf16 queries for a bf16 cache; for an FP8 (uint8) cache, e4m3 values (any float dtype
    holding them exactly) with s_q already folded into `weights` [T, H].
    block_t: query rows per program; 1 is the per-row kernel (decode), a power of two > 1 the row-block
    kernel (prefill: one key gather per block of rows of one request). None: the per-row kernel below
    ROW_BLOCK_MIN_T rows; from there both are compiled and the rows pick at run time (`lax.cond`): the
    row-block kernel when requests run for ROW_BLOCK rows on average (prefill chunks), else per row
    (a large decode batch, every row its own request); a float32 cache always takes the per-row kernel.
    block_s: keys per program (None: 128, or FLOAT32_BLOCK_S for a float32 cache)."""
    t, h, di = q.shape
    fp8 = k_cache.dtype == jnp.uint8
    if not interpret:
        check_addressable(k_cache, "indexer cache")
    f32 = k_cache.dtype == jnp.float32
    s = block_tables.shape[1] * block_size
    block_s = block_s or (FLOAT32_BLOCK_S if f32 else 128)
    block_s = min(block_s, max(16, pl.next_power_of_2(s)))
    n_blk = -(-s // block_s)
    h_pad = max(16, h)
    if block_t is not None and (block_t < 1 or block_t & (block_t - 1)):
        raise ValueError(f"indexer_scores_triton: block_t {block_t} must be a power of two")
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
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    opts = {"block_s": block_s, "page": block_size, "di": di, "fp8": fp8, "interpret": interpret}
    bt_cache = [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]

    def per_row(token_req, kv_lens, q, weights):
        return pl.pallas_call(
            functools.partial(_scores_kernel, **opts),
            grid=(t, n_blk),
            in_specs=[
                pl.BlockSpec((1,), lambda i, j: (i,)),
                pl.BlockSpec((1,), lambda i, j: (i,)),
                pl.BlockSpec((None, h_pad, di), lambda i, j: (i, 0, 0)),
                pl.BlockSpec((None, h_pad), lambda i, j: (i, 0)),
                *bt_cache,
            ],
            out_specs=pl.BlockSpec((None, block_s), lambda i, j: (i, j)),
            out_shape=jax.ShapeDtypeStruct((t, n_blk * block_s), jnp.float32),
            compiler_params=params,
            interpret=interpret,
            name=name,
        )(token_req, kv_lens, q, weights, block_tables.astype(jnp.int32), k_cache)

    def row_block(token_req, kv_lens, q, weights, block_t):
        return _row_block_call(token_req, kv_lens, q, weights, block_tables, k_cache, block_t=block_t, n_blk=n_blk,
                               params=params, name=name + "_rows", opts=opts)

    args = (token_req, kv_lens, q, weights)
    if block_t == 1 or (block_t is None and (t < ROW_BLOCK_MIN_T or f32)):
        return per_row(*args)
    if block_t is not None:
        return row_block(*args, block_t)
    changes = jnp.sum((token_req[1:] != token_req[:-1]).astype(jnp.int32))
    return jax.lax.cond(changes * ROW_BLOCK <= t, lambda *a: row_block(*a, ROW_BLOCK), per_row, *args)


def _row_block_call(token_req, kv_lens, q, weights, block_tables, k_cache, *, block_t, n_blk, params, name, opts):
    t, h_pad, di = q.shape
    block_s = opts["block_s"]
    t_pad = -(-t // block_t) * block_t
    if t_pad != t:  # padding rows: the last row's request (keeps its block shared), kv_len 0 (write -inf)
        pad = t_pad - t
        token_req = jnp.concatenate([token_req, jnp.broadcast_to(token_req[-1:], (pad,))])
        kv_lens = jnp.pad(kv_lens, (0, pad))
        q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_scores_rows_kernel, **opts),
        grid=(t_pad // block_t, n_blk),
        in_specs=[
            pl.BlockSpec((block_t,), lambda i, j: (i,)),
            pl.BlockSpec((block_t,), lambda i, j: (i,)),
            pl.BlockSpec((block_t, h_pad, di), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((block_t, h_pad), lambda i, j: (i, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((block_t, block_s), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((t_pad, n_blk * block_s), jnp.float32),
        compiler_params=params,
        interpret=opts["interpret"],
        name=name,
    )(token_req, kv_lens, q, weights, block_tables.astype(jnp.int32), k_cache)
    return out if t_pad == t else out[:t]


def _float_order_key(x):
    """float32 -> uint32 whose unsigned order is the float order (+0 and -0 equal)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    neg = (bits >> 31) == 1
    u = jnp.where(neg, ~bits, bits | jnp.uint32(0x80000000))
    return jnp.where(x == 0.0, jnp.uint32(0x80000000), u)


def _topk_kernel(len_ref, sc_ref, pos_ref, val_ref, *, k, chunk, radix_bits, interpret):
    """One query row: radix-select the k-th largest score key, then compact in position order.

    Writes the min(k, n) selected (position, score) pairs in ascending position order to slots [0, min(k, n))
    and (-1, -inf) after them: the SPEC tie rule (equal scores: smaller positions first) decides which keys
    equal to the threshold are kept; the final score order is one stable sort outside."""
    n = len_ref[0]
    ke = jnp.minimum(n, k)
    n_chunks = (n + chunk - 1) // chunk
    k_pad = pos_ref.shape[0]
    n_cand = 1 << radix_bits

    slots = jax.lax.iota(jnp.int32, k_pad)
    fill = slots >= ke
    if interpret:
        pos_ref[...] = jnp.where(fill, -1, pos_ref[...])
        val_ref[...] = jnp.where(fill, -jnp.inf, val_ref[...])
    else:
        plgpu.store(pos_ref, jnp.full((k_pad,), -1, jnp.int32), mask=fill)
        plgpu.store(val_ref, jnp.full((k_pad,), -jnp.inf, jnp.float32), mask=fill)

    def keys(c):
        x = sc_ref[pl.ds(c * chunk, chunk)]
        return x, _float_order_key(x)

    cand_j = jax.lax.iota(jnp.uint32, n_cand)
    tau = jnp.uint32(0)
    for p in range(32 // radix_bits):
        shift = 32 - radix_bits * (p + 1)
        cand = tau | (cand_j << shift)

        def count(c, acc, cand=cand):
            _, u = keys(c)
            return acc + jnp.sum((u[None, :] >= cand[:, None]).astype(jnp.int32), axis=1)

        cnt = jax.lax.fori_loop(0, n_chunks, count, jnp.zeros((n_cand,), jnp.int32))
        j = jnp.sum((cnt >= ke).astype(jnp.int32)) - 1  # counts fall with j; cnt[0] >= ke always
        tau = tau | (j.astype(jnp.uint32) << shift)

    def count_gt(c, acc):
        _, u = keys(c)
        return acc + jnp.sum((u > tau).astype(jnp.int32))

    need_eq = ke - jax.lax.fori_loop(0, n_chunks, count_gt, jnp.int32(0))

    def compact(c, carry):
        sel_before, eq_before = carry
        x, u = keys(c)
        pos = c * chunk + jax.lax.iota(jnp.int32, chunk)
        eq = (u == tau).astype(jnp.int32)
        eq_rank = eq_before + jnp.cumsum(eq) - eq
        sel = ((u > tau) | ((eq == 1) & (eq_rank < need_eq))) & (pos < n)
        sel_i = sel.astype(jnp.int32)
        slot = sel_before + jnp.cumsum(sel_i) - sel_i
        if interpret:
            tgt = jnp.where(sel, slot, k_pad)  # out of range: dropped
            pos_ref[...] = pos_ref[...].at[tgt].set(pos, mode="drop")
            val_ref[...] = val_ref[...].at[tgt].set(x, mode="drop")
        else:
            plgpu.store(pos_ref.at[slot], pos, mask=sel)
            plgpu.store(val_ref.at[slot], x, mask=sel)
        return sel_before + jnp.sum(sel_i), eq_before + jnp.sum(eq)

    jax.lax.fori_loop(0, n_chunks, compact, (jnp.int32(0), jnp.int32(0)))


def topk_triton(scores, kv_lens, topk: int, width: int, *, chunk: int = 1024, radix_bits: int = 4,
                num_warps: int = 8, interpret: bool = False):
    """Top-k (positions int32, scores float32) [T, min(topk, width)] of `scores` [T, S_pad] (-inf past
    kv_lens[t]) with the SPEC order: higher score first, then smaller position; (-1, -inf) padding."""
    t, s_pad = scores.shape
    k = min(topk, width)
    k_pad = pl.next_power_of_2(k)
    chunk = min(chunk, pl.next_power_of_2(s_pad))
    if s_pad % chunk:
        scores = jnp.pad(scores, ((0, 0), (0, chunk - s_pad % chunk)), constant_values=-jnp.inf)
    kernel = functools.partial(_topk_kernel, k=k, chunk=chunk, radix_bits=radix_bits, interpret=interpret)
    pos, val = pl.pallas_call(
        kernel,
        grid=(t,),
        in_specs=[pl.BlockSpec((1,), lambda i: (i,)),
                  pl.BlockSpec((None, scores.shape[1]), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((None, k_pad), lambda i: (i, 0)),
                   pl.BlockSpec((None, k_pad), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((t, k_pad), jnp.int32), jax.ShapeDtypeStruct((t, k_pad), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="indexer_topk_select",
    )(kv_lens.astype(jnp.int32), scores)
    pos, val = pos[:, :k], val[:, :k]
    val = jnp.where(val == 0.0, 0.0, val)  # -0.0 -> +0.0, as the xla form
    # positions are ascending within equal scores: a stable sort by descending score gives the tie rule
    neg, pos = jax.lax.sort((-val, pos), dimension=1, is_stable=True, num_keys=1)
    return pos, -neg
