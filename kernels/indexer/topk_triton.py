"""Pallas Triton top-k of the indexer scores (docs/math.md §2): the same (positions, scores) as
`kernels.indexer.topk_positions` (`lax.top_k`), bit for bit: min(k, kv_lens[t]) positions per row ordered by score
descending, then position ascending; -1 / -inf after them.

One program per query row (grid (T,)), the whole row in registers (S_pad = S rounded up to a power of two, at most
`kernels.indexer.SELECT_MAX_S`), `num_warps` warps. As the reference, the top is taken over all S scores of a row and
kv_lens[t] only bounds how many are kept (the scores kernels write -inf past kv_lens). Scores become
order-preserving int32 keys (key(x) = bits(x) for x >= 0, bits(x) ^ 0x7FFFFFFF for x < 0; -0.0 is +0.0; the
padding past S the minimum int32). The kernel then

1. finds tau, the k-th largest key, by narrowing a bracket [lo, hi) with count(key >= lo) >= k > count(key >= hi)
   until it holds one key value: each step counts the keys >= the bracket's key midpoint (one compare per key and
   one block-wide sum); a step whose probe fell in a gap between keys (the bracket's count did not move) is followed
   by a snap of lo and hi - 1 to the bracket's least and greatest keys, or exact ties would take 32 steps (a
   simulation of 32K rows: 15-20 steps on continuous scores, 13 on 50 distinct integers, 3 on mostly-zero rows);
2. where more keys equal tau than the k - count(key > tau) to take, finds the position cut P that leaves exactly
   that many of them before it (a bisection on positions, 16 steps): the tie rule, smaller positions first;
3. scatters the selection (key > tau, or key == tau before P: exactly min(k, kv_lens) keys) to the output row in
   position order (one scan), then orders it as `TopkConfig.sort` says (a bitonic network on [k_pad] written as
   reshapes and size-2 reductions, as Triton's own `tl.sort`, or `lax.sort` after the kernel).
The H200 saw (bench_indexer.py, 2026-12-01, an earlier form of steps 1-3): positions and scores equal to
`lax.top_k`'s bit for bit at B = 32 x 32K, also with relu-style zero ties and rows of 1..2049 keys.

Rows that split into 4 chunks of at least k scores take two launches of the kernel (`TopkConfig.chunks`): each
chunk's own top k, then the top k of the 4k candidates, so 32 rows keep 128 SMs busy instead of 32.

Registered as impl "triton" of the op "topk" (`kernels.indexer.select_topk`), whose "xla" impl,
`kernels.indexer.topk_positions`, is the reference and the fallback (`kernels.indexer.triton.topk_select_impl` takes
it for rows wider than SELECT_MAX_S). Launch configs are `TopkConfig`s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import registry
from ..common.triton_common import with_options
from . import select_width_supported
from .config import TopkConfig

KEY_MIN = -(2**31)  # the key of positions past kv_lens: below every score's key (-inf is -2139095041)
KEY_MAX = 2**31 - 1


# ------------------------------------------------------------------------------------------------- in-kernel

def _order_key(x):
    """float32 -> int32 whose signed order is the float order; -0.0 and +0.0 both map to 0."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    key = jnp.where(b >= 0, b, b ^ 0x7FFFFFFF)
    return jnp.where(x == 0.0, 0, key)


def _key_value(key):
    """Inverse of `_order_key` (+0.0 for key 0)."""
    return jax.lax.bitcast_convert_type(jnp.where(key >= 0, key, key ^ 0x7FFFFFFF), jnp.float32)


def _refuse_out_of_range(bad, slots):
    if bad:
        raise ValueError(f"topk select: a masked scatter index outside the row's {slots} output slots (on a GPU it "
                         "writes into the next row's)")


def _scatter(ref, idx, val, mask, interpret):
    """ref[idx[i]] = val[i] where mask[i] (distinct indices, each inside ref)."""
    if interpret:  # the interpreter cannot discharge masked stores: out-of-range indices are dropped instead
        # ... so a kernel bug writing past its row would pass on CPU: refuse it (the GPU would corrupt a neighbour)
        jax.debug.callback(_refuse_out_of_range, jnp.any(mask & ((idx < 0) | (idx >= ref.shape[0]))), ref.shape[0])
        ref[...] = ref[...].at[jnp.where(mask, idx, ref.shape[0])].set(val, mode="drop")
    else:
        plgpu.store(ref.at[idx], val, mask=mask)


def _barrier(interpret):
    """CTA barrier between global stores and other threads' loads of them (nothing to order when interpreted)."""
    if not interpret:
        plgpu.debug_barrier()


def _swap(key, pos, flip, i: int, n_dims: int):
    """One compare-and-swap layer of the bitonic network on [2**n_dims] (key, pos) pairs, partners 2**(n_dims-i-1)
    apart: a pair is ordered "greater first" (key desc, then pos asc) unless `flip`."""
    n = key.shape[0]
    shape = (2**i, 2, 2 ** (n_dims - i - 1))
    side = jax.lax.broadcasted_iota(jnp.int32, shape, 1)

    def halves(x):
        y = x.reshape(shape)
        left = jnp.sum(jnp.where(side == 0, y, 0), axis=1, keepdims=True)
        right = jnp.sum(jnp.where(side == 1, y, 0), axis=1, keepdims=True)
        return jnp.broadcast_to(left, shape).reshape(n), jnp.broadcast_to(right, shape).reshape(n)

    lk, rk = halves(key)
    lp, rp = halves(pos)
    left_first = (lk > rk) | ((lk == rk) & (lp < rp))
    swap = left_first == flip  # swap when the pair is not in its layer's order
    return jnp.where(swap, lk ^ rk ^ key, key), jnp.where(swap, lp ^ rp ^ pos, pos)


def _bitonic_sort(key, pos):
    """(key, pos) [2**m] sorted by key descending, then pos ascending (Triton's `tl.sort` network)."""
    n_dims = key.shape[0].bit_length() - 1
    for stage in range(1, n_dims + 1):
        if stage < n_dims:
            shape = (2 ** (n_dims - 1 - stage), 2, 2**stage)
            flip = jax.lax.broadcasted_iota(jnp.int32, shape, 1).reshape(key.shape[0]) == 1
        else:
            flip = jnp.zeros(key.shape, jnp.bool_)
        for i in range(stage):
            key, pos = _swap(key, pos, flip, i + n_dims - stage, n_dims)
    return key, pos


def _bounds(key):
    """The first bracket [lo, hi) of `_threshold`: the row's least real key (past S is KEY_MIN) and greatest + 1."""
    return jnp.min(jnp.where(key > KEY_MIN, key, KEY_MAX)), jnp.max(key) + 1


def _threshold(key, p, ke, lo, hi, s: int, s_pad: int):
    """Steps 1 and 2 of the module docstring on one row of keys [s_pad] (positions p) from the bracket [lo, hi):
    (tau, the ke-th largest key; cut_at, the position before which the ties at tau are taken; the loop's steps).
    Plain jnp: the kernel's code, and a test's on CPU."""
    def count(mask):
        return jnp.sum(mask.astype(jnp.int32))

    # 1. tau, the ke-th largest key: a bracket [lo, hi) with count(key >= lo) = c_lo >= ke > count(key >= hi),
    # narrowed until it holds one key value (or exactly ke keys are >= lo)
    def narrowing(c):
        lo, hi, c_lo, _, _, _ = c
        return (hi > lo + 1) & (c_lo > ke)

    def snap(c):  # lo, hi - 1 to the bracket's own least and greatest keys (the counts stay)
        lo, hi, c_lo, c_hi, _, steps = c
        return (jnp.min(jnp.where(key >= lo, key, KEY_MAX)), jnp.max(jnp.where(key < hi, key, KEY_MIN)) + 1,
                c_lo, c_hi, hi < lo, steps + 1)  # (hi < lo: a traced False, a branch must yield values)

    def bisect(c):
        lo, hi, c_lo, c_hi, _, steps = c
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow: lo < mid < hi
        cnt = count(key >= mid)
        up = cnt >= ke
        lo2, c_lo2 = jnp.where(up, mid, lo), jnp.where(up, cnt, c_lo)
        hi2, c_hi2 = jnp.where(up, hi, mid), jnp.where(up, c_hi, cnt)
        # the probe fell in a gap between keys (the bracket's count did not move): snap next, or exact ties would
        # take 32 steps (a simulation of 32K rows: 15-20 steps on continuous scores, 13 on 50 distinct integers)
        return lo2, hi2, c_lo2, c_hi2, c_lo2 - c_hi2 == c_lo - c_hi, steps + 1

    lo, hi, c_lo, _, _, steps = jax.lax.while_loop(
        narrowing, lambda c: jax.lax.cond(c[4], snap, bisect, c),
        (lo, hi, jnp.int32(s), jnp.int32(0), jnp.bool_(False), jnp.int32(0)))
    tau = lo
    need_eq = ke - count(key > tau)  # keys == tau to take, by smallest position

    # 2. the position cut for ties: the least P with #{key == tau, position < P} = need_eq (bisection on P). The
    # compares key == tau are recomputed where used: a [S_pad] mask kept live would spill (64 registers a thread
    # at 32 warps, half of them holding the row)
    def cut(_, c):  # invariant: #{ties before p_lo} < need_eq <= #{ties before p_hi}
        p_lo, p_hi = c
        mid = (p_lo + p_hi) // 2
        below = count((key == tau) & (p < mid)) >= need_eq
        return jnp.where(below, p_lo, mid), jnp.where(below, mid, p_hi)

    def cut_ties(none):
        return jax.lax.fori_loop(0, s_pad.bit_length(), cut, (none, none + s_pad))[1]

    # (a fixed-count loop under a cond: the while form of this bisection did not lower; the branches take a traced
    # zero, as a branch must yield values, not constants)
    zero = need_eq - need_eq
    cut_at = jax.lax.cond((need_eq > 0) & (count(key == tau) > need_eq), cut_ties, lambda z: z + s_pad, zero)
    return tau, cut_at, steps


def _selected(key, p, tau, cut_at, ke):
    """The selection mask: keys above tau, and ties at tau before the position cut. A row that keeps nothing (ke =
    0, kv_lens 0) selects nothing: the bracket then ends on the row's greatest key, and taking its ties would write
    past the row's k_pad output slots into the next row's (the H200 showed it: a chunked pass over an empty row's
    -inf candidates overwrote the next row's positions)."""
    return ((key > tau) | ((key == tau) & (p < cut_at))) & (ke > 0)


def _select_kernel(len_ref, sc_ref, pos_ref, val_ref, *, k, s, s_cols, s_pad, sort, interpret, stop=4):
    row = pl.program_id(0)
    ke = jnp.maximum(jnp.minimum(len_ref[0], k), 0)  # as the reference: the top over all s keys, kv_lens entries kept
    k_pad = pos_ref.shape[0]
    p = jax.lax.iota(jnp.int32, s_pad)
    if s_cols >= s_pad:  # one contiguous row load
        x = sc_ref[row, pl.ds(0, s_pad)]
    elif interpret:
        x = sc_ref[row, jnp.minimum(p, s - 1)]
    else:
        x = plgpu.load(sc_ref.at[row, jnp.minimum(p, s - 1)], mask=p < s, other=0.0)
    key = jnp.where(p < s, _order_key(x), KEY_MIN)

    lo, hi = _bounds(key)
    if stop == 0:
        pos_ref[...] = jnp.full((k_pad,), lo, jnp.int32) + hi
        return
    tau, cut_at, steps = _threshold(key, p, ke, lo, hi, s, s_pad)
    if stop == 1:
        pos_ref[...] = jnp.where(jax.lax.iota(jnp.int32, k_pad) == 0, steps, tau + cut_at)
        return

    # 3. the selection (exactly ke keys) to the output row in position order, one scan
    sel = _selected(key, p, tau, cut_at, ke)
    si = sel.astype(jnp.int32)
    slot = jnp.cumsum(si) - si
    _scatter(pos_ref, slot, p, sel, interpret)
    _scatter(val_ref, slot, _key_value(key), sel, interpret)  # the score, -0.0 as +0.0 (as the reference)
    kk = jax.lax.iota(jnp.int32, k_pad)
    real = kk < ke
    if sort != "kernel" or stop == 3:
        if not interpret:  # slots >= ke
            plgpu.store(pos_ref, jnp.full((k_pad,), -1, jnp.int32), mask=jnp.logical_not(real))
            plgpu.store(val_ref, jnp.full((k_pad,), -jnp.inf, jnp.float32), mask=jnp.logical_not(real))
        else:
            pos_ref[...] = jnp.where(real, pos_ref[...], -1)
            val_ref[...] = jnp.where(real, val_ref[...], -jnp.inf)
        return
    _barrier(interpret)
    sel_pos = jnp.where(real, pos_ref[...], KEY_MAX)
    sel_key = jnp.where(real, _order_key(val_ref[...]), KEY_MIN)
    sel_key, sel_pos = _bitonic_sort(sel_key, sel_pos)
    _barrier(interpret)  # every program thread has read the position-ordered row before it is overwritten
    pos_ref[...] = jnp.where(real, sel_pos, -1)
    val_ref[...] = jnp.where(real, _key_value(sel_key), -jnp.inf)


def topk_select(scores, kv_lens, topk: int, width: int | None = None, *, config: TopkConfig | None = None,
                interpret: bool = False, _stop: int = 4, **overrides):
    """(positions int32, scores float32) [T, min(topk, width)] of `scores` [T, S'] (float32; the first `width`
    (default S') columns, any right padding -inf as the reference assumes), equal to
    `kernels.indexer.topk_positions(scores, kv_lens, topk, width)` (`TopkConfig.sort` "none": the same entries in
    position order). `config` (default `TopkConfig()`), `overrides` replace its fields by name (None keeps a field);
    `interpret`: the Pallas interpreter. `TopkConfig.chunks` C > 1 (where the row splits into C chunks of at least
    k scores, else one pass): `_chunked_select`. `_stop` (the benchmark's stage breakdown only; its outputs are then
    not a top-k): 0 ends after the row load and its bounds, 1 after tau and the tie cut, 3 after the scatter."""
    t, s_cols = scores.shape
    s = s_cols if width is None else min(width, s_cols)
    k = min(topk, s)
    why = select_width_supported(s)
    if why or k < 1:
        raise ValueError(f"topk_select: {why or f'top-k of {k} < 1'}")
    cfg = registry.launch("topk_select", with_options(config or TopkConfig(),
                                                      {k_: v for k_, v in overrides.items() if v is not None}, "topk"))
    if cfg.two_pass(s, k) and _stop == 4:
        return _chunked_select(scores, kv_lens, k, s, cfg, interpret)
    pos, val = _select_call(scores, kv_lens, k, s, cfg.num_warps, cfg.sort, interpret, _stop)
    return _order(pos, val, cfg.sort, interpret)


def _select_call(scores, kv_lens, k: int, s: int, num_warps: int | None, sort: str, interpret: bool,
                 stop: int = 4):
    """One launch of the select kernel: grid (T,), (positions, scores) [T, k] in position order (`sort` "xla" or
    "none") or in the reference order ("kernel")."""
    t, s_cols = scores.shape
    s_pad = max(16, pl.next_power_of_2(s))
    k_pad = max(16, pl.next_power_of_2(k))
    warps = num_warps or max(1, min(32, s_pad // 1024))
    kernel = functools.partial(_select_kernel, k=k, s=s, s_cols=s_cols, s_pad=s_pad, sort=sort,
                               interpret=interpret, stop=stop)
    pos, val = pl.pallas_call(
        kernel,
        grid=(t,),
        in_specs=[pl.BlockSpec((1,), lambda i: (i,)), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((None, k_pad), lambda i: (i, 0)), pl.BlockSpec((None, k_pad), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((t, k_pad), jnp.int32), jax.ShapeDtypeStruct((t, k_pad), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret,
        name="indexer_topk_select",
    )(kv_lens.astype(jnp.int32), scores.astype(jnp.float32))
    return pos[:, :k], val[:, :k]


def _order(pos, val, sort: str, interpret: bool = False):
    """The selection, which the kernel left in position order unless `sort` is "kernel", in the order `sort` asks:
    "xla" by one stable `lax.sort` on the score (score desc, then position asc; the -1 padding, score -inf, stays
    last), "none" and "kernel" as it is."""
    if sort != "xla":
        return pos, val
    neg, pos = jax.lax.sort((jnp.where(pos >= 0, -val, jnp.inf), pos), dimension=1, is_stable=True, num_keys=1)
    return pos, jnp.where(pos >= 0, -neg, -jnp.inf)


def _chunked_select(scores, kv_lens, k: int, s: int, cfg: TopkConfig, interpret: bool):
    """The top-k in two launches that keep more SMs busy than one program per row (issue 17: 32 rows leave 100 of
    the H200's 132 SMs idle). Pass 1: each of the row's C chunks of w = ceil(S / C) scores (-inf past S) takes its
    own top k (all k kept, whatever kv_lens says), in position order. The row's top k under the order (score desc,
    position asc) is in the union of the chunks' top k: a key with k better keys in the whole row has fewer in
    its own chunk only if it is among the chunk's k best. Pass 2: the top k of the C * k candidates with kv_lens'
    bound, the candidate's index standing in for its position (chunks in order, positions ascending in each, so
    the two orders agree and ties break the same way); then the candidates' positions are read back."""
    t, s_cols = scores.shape
    c = cfg.chunks
    w = -(-s // c)
    x = scores[:, :s] if s_cols > s else scores
    if c * w != x.shape[1]:
        x = jnp.pad(x, ((0, 0), (0, c * w - x.shape[1])), constant_values=-jnp.inf)
    full = jnp.full((t * c,), w, jnp.int32)
    pos1, val1 = _select_call(x.reshape(t * c, w), full, k, w, cfg.num_warps, "none", interpret)
    base = (jnp.arange(t * c, dtype=jnp.int32) % c * w)[:, None]
    cand_pos = (pos1 + base).reshape(t, c * k)  # every slot holds a real entry: w >= k
    cand_val = val1.reshape(t, c * k)
    sort = "kernel" if cfg.sort == "kernel" else "none"
    idx, val = _select_call(cand_val, kv_lens, k, c * k, cfg.num_warps, sort, interpret)
    pos = jnp.where(idx >= 0, jnp.take_along_axis(cand_pos, jnp.maximum(idx, 0), axis=1), -1)
    return _order(pos, val, cfg.sort, interpret)

