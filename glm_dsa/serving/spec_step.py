"""Speculative decoding with the MTP layer (docs/math.md §12): verify, accept and draft again, in one device step.

A decoding request brings rows [x, d_1 .. d_k] (its last token and the drafts of the previous step) at positions
P .. P + k; the target scores them in one step. Greedy requests accept the longest prefix where the target's
argmax equals the draft, plus the target's own next token; sampling requests use speculative rejection sampling
(accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), else draw from normalise(max(0, p_j - q_j)); all
accepted: draw the bonus from p_k), which keeps the target distribution exactly. Then the nextn layer runs over
every row of the step (each row's hidden state with the token after it: the emitted ones for the verify rows)
and k - 1 more single-row steps per request chain the next drafts from the row of the last accepted token.

Rows of rejected drafts are dead: their KV (target and nextn layer) sits at positions past the request's new
length, which no query attends to (attention and the indexer see positions <= the query's only, and the next
step rewrites those positions before any query reaches them); the nextn layer writes no KV for them at all.
The accepted counts are computed once, outside `shard_map`, from the gathered logits: every DCP and TP rank
uses the same values.

Randomness: the draws for token index m of a request use the key fold_in(fold_in(key(seed), m), prompt_index)
(as plain sampling), folded with 0 (the draft drawn for m), 1 (the uniform that tests it) or 2 (the residual
or bonus token). A key whose draw was discarded (a draft past a rejection) influenced no emitted token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from sharding.dcp import local_position

from ..model.layers import StepBatch, StepContext
from ..model.mtp import run_mtp
from ..model.options import StepOptions
from ..model.step import fp8_paths, model_graphdef, run_sharded
from . import host_buffer
from .sampling import GREEDY_BELOW

_DRAFT, _TEST, _RESIDUAL = 0, 1, 2  # what a token index's key is folded with for each of its draws


def nucleus_probs(logits, temperature, top_p):
    """The distribution a sampling row draws from: softmax(logits / temperature) restricted to the smallest set of
    top tokens whose mass reaches top_p (all of them when top_p = 1), renormalised. logits float32 [..., V];
    temperature, top_p broadcast against logits[..., 0]. The same rule as `sampling.sample`."""
    t = jnp.maximum(jnp.asarray(temperature, jnp.float32), GREEDY_BELOW)[..., None]
    top_p = jnp.asarray(top_p, jnp.float32)[..., None]
    scaled = logits.astype(jnp.float32) / t
    probs = jax.nn.softmax(scaled, axis=-1)
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    keep_sorted = (jnp.cumsum(sorted_probs, axis=-1) - sorted_probs) < top_p  # mass strictly above each token
    keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1) | (top_p >= 1.0)
    probs = jnp.where(keep, probs, 0.0)
    return probs / jnp.sum(probs, axis=-1, keepdims=True)


def _draw(keys, probs, salt: int):
    """One token per row of `probs` [G, V] with each row's key folded with `salt`."""
    return jax.vmap(lambda key, p: jax.random.categorical(jax.random.fold_in(key, salt), jnp.log(p)))(
        keys, probs).astype(jnp.int32)


def accept_drafts(logits, drafts, n_drafts, draft_probs, keys, temperature, top_p, all_greedy: bool = False):
    """Verify each group's drafts against the target.

    logits float32 [G, k + 1, V]: the target's logits at the rows [x, d_1 .. d_k]; drafts int [G, k]; n_drafts
    int [G]: how many drafts are real (rows past them are ignored); draft_probs float32 [G, k, V]: the distribution
    each draft was drawn from (read for sampling groups only); keys [G, k + 1]: the PRNG key of each token index
    this step may emit; temperature, top_p float32 [G]; `all_greedy` (static): every group is greedy, nothing else
    is computed (else a device-side branch decides). Returns (accepted int32 [G] in [0, n_drafts],
    tokens int32 [G, k + 1]): the group emits tokens[:accepted + 1] (the accepted drafts, then the target's token).
    """
    g, k1, _ = logits.shape
    k = k1 - 1
    valid = jnp.arange(k)[None, :] < n_drafts[:, None]
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    greedy = temperature < GREEDY_BELOW
    greedy_match = (drafts == target[:, :k]) & valid

    def count(match):
        return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)

    def greedy_only():
        return count(greedy_match), target  # tokens[:a] are the drafts the target agreed with, then its own

    def mixed():
        p = nucleus_probs(logits, temperature[:, None], top_p[:, None])  # [G, k + 1, V]
        pd = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
        qd = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
        u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, _TEST))))(keys[:, :k])
        sampled_match = (u * qd < pd) & valid  # P(accept) = min(1, p / q); q(d) > 0: d was drawn from q
        a = count(jnp.where(greedy[:, None], greedy_match, sampled_match))
        rows = jnp.arange(g)
        pa = p[rows, a]  # [G, V]
        qa = jnp.where((a < n_drafts)[:, None], draft_probs[rows, jnp.minimum(a, k - 1)], 0.0)
        residual = jnp.maximum(pa - qa, 0.0)  # rejected at a: normalise(max(0, p - q)); all accepted: p itself
        mass = jnp.sum(residual, axis=-1, keepdims=True)
        residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), pa)
        last = jnp.where(greedy, target[rows, a], _draw(keys[rows, a], residual, _RESIDUAL))
        padded = jnp.concatenate([drafts, jnp.zeros((g, 1), drafts.dtype)], axis=1)
        tokens = jnp.where(jnp.arange(k1)[None, :] < a[:, None], padded, last[:, None])
        return a, tokens.astype(jnp.int32)

    if all_greedy:
        return greedy_only()
    return jax.lax.cond(jnp.all(greedy), greedy_only, mixed)


def draw_drafts(logits, keys, temperature, top_p, all_greedy: bool = False):
    """One draft per group from the nextn layer's logits [G, V]: (tokens int32 [G], probs float32 [G, V]: the
    distribution it was drawn from). Greedy groups take the argmax (their probs are not used: zeros); `all_greedy`
    as for `accept_drafts`."""
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    greedy = temperature < GREEDY_BELOW

    def greedy_only():
        return target, jnp.zeros(logits.shape, jnp.float32)

    def mixed():
        q = nucleus_probs(logits, temperature, top_p)
        return jnp.where(greedy, target, _draw(keys, q, _DRAFT)), q

    if all_greedy:
        return greedy_only()
    return jax.lax.cond(jnp.all(greedy), greedy_only, mixed)


def spec_serve_step(params, mtp_params, caches, mtp_caches, tables, draft_probs, rows, plan_rows, table_updates,
                    table_resets, vrows, gmeta, samp_u32, samp_f32, *, config, parallel, impl, k: int,
                    block_size: int, width: int, greedy: bool = False, with_logits: bool = False):
    """One speculative serving step (the MTP counterpart of `runner.serving_step`, whose block-table arguments it
    shares): the target over the step's rows, acceptance per sampling request, the nextn layer over every row,
    then k - 1 chained draft rows per request.

    rows int32 [4, T]: token, position (-1: padding), request (index into `plan_rows`), the token after the row
    (-1: this step emits it: a verify row's). vrows int32 [G, k + 1]: the rows [x, d_1 .. d_k] of each sampling
    request ("group"), -1 past its drafts (and for padding groups). gmeta int32 [3, G]: drafts, the request's
    table row (its draft distributions live in `draft_probs` [S + 1, k, V] at that row), pages it holds (chained
    rows past them write nothing). samp_u32 uint32 [4, G]: seed high and low words, the token index of the first
    token it emits, prompt index; samp_f32 float32 [2, G]: temperature, top_p. `greedy` (static): every group is
    greedy (no sampling code is compiled in).
    Returns (int32 [G, 2k + 2]: accepted count, the k + 1 tokens (the first accepted + 1 are emitted), the next k
    drafts; caches, mtp_caches, tables, draft_probs), and with `with_logits` (static) the target's float32 logits
    of the verify rows [G, k + 1, V] last (for tests that compare them)."""
    tables = jnp.where(table_resets[:, None] > 0, 0, tables)
    tables = tables.at[table_updates[0], table_updates[1]].set(table_updates[2], mode="drop")
    block_tables = tables[plan_rows, :width]
    n, inter = parallel.dcp, parallel.interleave

    def owner_slot(req, pos):
        lp = local_position(pos, n, inter)  # the position on its owning DCP rank
        col = lp // block_size
        return block_tables[req, jnp.minimum(col, width - 1)] * block_size + lp % block_size, col

    token, pos, req, after = rows
    t = token.shape[0]
    p = jnp.maximum(pos, 0)
    slot = jnp.where(pos < 0, -1, owner_slot(req, p)[0]).astype(jnp.int32)
    in_group = vrows >= 0
    vr = jnp.maximum(vrows, 0)
    g = vrows.shape[0]
    options = StepOptions(impl=impl)

    # the target over every row; logits of the verify rows, hidden states of all. Padding rows keep position -1,
    # as in the plain serving step: they write no KV and route to no expert (a clamped position 0 would route them)
    batch = StepBatch(token, pos, slot, req, block_tables, vr.reshape(-1))
    ctx = StepContext(config, block_size=block_size, parallel=parallel, options=options)
    graphdef = model_graphdef(config, fp8_paths(params))

    def target(params, caches, batch):
        return nnx.merge(graphdef, params)(caches, batch, ctx, return_hidden=True)

    logits, caches, hidden = run_sharded(target, params, caches, batch, parallel, lambda cs: (P(), cs, P()),
                                         config)

    # acceptance: computed once from the gathered logits, so every rank agrees
    n_drafts, table_row, n_pages = gmeta
    temperature, top_p = samp_f32

    def key(words, index, prompt_index):
        return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(words), index), prompt_index)

    def keys_at(index):  # [G] keys of token index `index` [G] of each group
        return jax.vmap(key)(samp_u32[:2].T, index.astype(jnp.uint32), samp_u32[3])

    first = samp_u32[2].astype(jnp.int32)
    emit_keys = jax.vmap(lambda j: keys_at(first + j), out_axes=1)(jnp.arange(k + 1))  # [G, k + 1]
    drafts = token[vr[:, 1:]]
    accepted, emitted = accept_drafts(logits.reshape(g, k + 1, -1), drafts, n_drafts, draft_probs[table_row],
                                      emit_keys, temperature, top_p, greedy)

    # the nextn layer over every row: (h_t, token t + 1); verify rows past the accepted ones are dead (no KV)
    j = jnp.arange(k + 1)[None, :]
    nxt = after.at[jnp.where(in_group, vrows, t)].set(emitted, mode="drop")
    dead = in_group & (j > accepted[:, None])
    mtp_slot = slot.at[jnp.where(dead, vrows, t)].set(-1, mode="drop")
    mtp_slot = jnp.where(nxt < 0, -1, mtp_slot)
    last = jnp.take_along_axis(vr, accepted[:, None], axis=1)[:, 0]  # each group's row of its last accepted token
    mbatch = StepBatch(jnp.maximum(nxt, 0), pos, mtp_slot, req, block_tables, last)
    h, mlogits, mtp_caches = run_mtp(params, mtp_params, mtp_caches, hidden, mbatch, config=config,
                                     parallel=parallel, options=options)
    base = first + accepted  # the token index of the last emitted token; draft i is for base + i
    d, q = draw_drafts(mlogits, keys_at(base + 1), temperature, top_p, greedy)
    new_drafts, new_q = [d], [q]
    h = h[last]
    gpos, greq = p[last], req[last]
    for i in range(2, k + 1):  # chained drafts: row at position gpos + i - 1 with (hn of the previous, d_{i-1})
        cpos = gpos + i - 1
        cslot, col = owner_slot(greq, cpos)
        cslot = jnp.where((col < n_pages) & in_group[:, 0], cslot, -1).astype(jnp.int32)
        cbatch = StepBatch(d, cpos, cslot, greq, block_tables, jnp.arange(g, dtype=jnp.int32))
        h, clogits, mtp_caches = run_mtp(params, mtp_params, mtp_caches, h, cbatch, config=config, parallel=parallel,
                                         options=options)
        d, q = draw_drafts(clogits, keys_at(base + i), temperature, top_p, greedy)
        new_drafts.append(d)
        new_q.append(q)
    if not greedy:  # a greedy step's distributions are never read: the buffer passes through untouched
        draft_probs = draft_probs.at[table_row].set(jnp.stack(new_q, axis=1))
    out = jnp.concatenate([accepted[:, None], emitted, jnp.stack(new_drafts, axis=1)], axis=1).astype(jnp.int32)
    if with_logits:
        return out, caches, mtp_caches, tables, draft_probs, logits.reshape(g, k + 1, -1)
    return out, caches, mtp_caches, tables, draft_probs


def spec_serve_step_packed(params, mtp_params, caches, mtp_caches, tables, draft_probs, packed, *,
                           layout: host_buffer.Layout, **kw):
    """`spec_serve_step` with its eight host inputs in one uint32 buffer (`host_buffer.pack` of rows [4, T],
    plan_rows [R], table_updates [3, T], table_resets [S + 1], vrows [G, k + 1], gmeta [3, G], samp_u32 [4, G]
    and samp_f32 [2, G]): a turn makes one host-to-device transfer, not eight (each costs tens of microseconds
    before the step can start, and the turn waits for its step); `layout` (static) is the pack's."""
    return spec_serve_step(params, mtp_params, caches, mtp_caches, tables, draft_probs,
                           *host_buffer.unpack(packed, layout), **kw)
