"""Pallas Triton form of the fused q/kv norm + RoPE + paged cache write (docs/math.md §4), one kernel per layer.

Two kinds of work, each over blocks of token rows (`FusedNormRopeConfig`):
  q part (a): q RMSNorm of `q_rows` rows, written for EVERY row — the slot is not looked at (3/4 of the bytes,
      a plain row-wise stream);
  cache part, per row of a `cache_rows` block:
      (b) `slot < 0` (or past the cache) masks every cache store of the row — MLA and indexer;
      (c) kv RMSNorm + RoPE on k_pe -> MLA cache row (bfloat16 `[kv | k_pe]` or fp8_ds_mla bytes);
      (d) full layers: indexer key LayerNorm + RoPE on its first Dr dims (interleaved or neox) -> indexer
          cache (its own dtype, or FP8 bytes with a UE8M0 scale) at the indexer slot;
  every program of the launch with the cache part: (e) with a top-k buffer (full layers), its share of the
  buffer set to -1.

How programs map to the parts (`layout`): "split" (q programs, then cache programs, one grid), "interleave"
(one grid, groups of k q programs and one cache program, so both kinds run side by side all along), "fused"
(program i does q blocks and cache blocks both), "two_launch" (a q-only launch with its own warp count, then
a cache-only launch). `q_programs` / `cache_programs` > 0 make a part persistent: that many programs, each
looping over the blocks p, p + programs, ... with its weights loaded once.

Caches are `pl.ANY` refs aliased input -> output (`input_output_aliases`): rows are stored at computed
offsets, nothing else of a cache is touched, and a donated cache is updated in place. Widths that are
not powers of two (q_lora 48, ...) are loaded as the next power of two under a column mask.

RoPE without shuffles: each rotated column j also loads its partner column (j ^ 1 interleaved, (j + Dr/2)
mod Dr neox) and computes `x_j cos - x_partner sin` (first of a pair) or `x_j cos + x_partner sin`. The
indexer key's rotated columns [0, Dr) and its pass-through columns are separate tensors, so when both RoPE
layouts agree the key reuses k_pe's cos/sin (one set of angles per row).

Numerics follow the xla oracle step by step: norms in float32 rounded to the input dtype, RoPE in
float32 of the rounded values rounded again, then the cache cast or the FP8 quantiser of
`kernels.common.fp8_formats` (its `mla_tile_scale`, `e4m3_bits`, `ue8m0_scale_and_inverse`, called in the kernel):
IEEE division (`div.rn.f32` inline PTX; Triton's `/` is div.full.f32) for the MLA scale and values, UE8M0
scales from the float32 bits, values times the exact power-of-two 1/s. FP8 scale and k_pe bytes are built
as contiguous byte runs (joins of the little-endian bytes), so each is stored with wide vector stores.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import registry
from ..common import fp8_formats as f8
from ..common import rope
from ..common.triton_common import MASKED_ROW, check_addressable, div_rn, is_pow2, with_options
from .config import FP8_MIN_CACHE_ROWS, LAYOUTS, FusedNormRopeConfig, default_config  # noqa: F401


def _p2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------ in-kernel helpers

def _and(a, b):
    """a & b where either may be None (= all true): statically full masks are dropped, which lets Triton
    vectorise the accesses."""
    return b if a is None else a if b is None else a & b


def _ld(ref, mask):
    return plgpu.load(ref, mask=mask, other=None if mask is None else 0)


def _iota(shape, dim):
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _rope_cols(width: int, dr: int, interleave: bool):
    """For columns j < width ([1, width]): the partner column, the sign of the partner term, the frequency
    index and whether j is rotated (j < dr)."""
    j = _iota((1, width), 1)
    half = dr // 2
    if interleave:
        partner, first, freq = j ^ 1, (j & 1) == 0, j >> 1
    else:
        partner = jnp.where(j < half, j + half, j - half)
        first, freq = j < half, jnp.where(j < half, j, j - half)
    rotated = j < dr
    partner = jnp.where(rotated, partner, j)
    freq = jnp.where(rotated, freq, 0)
    return j, partner, jnp.where(first, -1.0, 1.0), freq, rotated


def _le_bytes(bits, nbytes: int):
    """int32 bits [N, n] -> uint8 [N, n * nbytes] (nbytes 2 or 4), each value's bytes little-endian and
    adjacent: one contiguous byte run a vector store can write. Built with 2-way joins (Triton's `join`)."""
    def byte(k):
        return ((bits >> (8 * k)) & 0xFF).astype(jnp.uint8)
    if nbytes == 2:
        pair = jnp.stack([byte(0), byte(1)], axis=-1)
    else:
        # [..., i, s] = byte 2 i + s: the outer join's new axis is the last one
        pair = jnp.stack([jnp.stack([byte(0), byte(2)], axis=-1), jnp.stack([byte(1), byte(3)], axis=-1)], axis=-1)
    return pair.reshape(bits.shape[0], bits.shape[1] * nbytes)


def _q_rows_to_write(in_range, slot_ok_fn):
    """Rows whose normalised q is written: every row in range, whatever its slot (docs/math.md §4 (a)).

    Kept as a module-level function so a test can swap in the defective variant
    (`in_range & slot_ok_fn()`) and show that its check catches it."""
    del slot_ok_fn
    return in_range


# ------------------------------------------------------------------------------ static geometry

@dataclasses.dataclass(frozen=True)
class _Part:
    """How one part's `n_blocks` row blocks (`rows` each, over T rows) go to `n_prog` programs: program p does
    blocks p, p + n_prog, ... (`n_iter` of them; blocks past the last hold no row and store nothing)."""
    T: int
    rows: int
    n_prog: int

    @property
    def n_blocks(self) -> int:
        return _cdiv(self.T, self.rows)

    @property
    def n_iter(self) -> int:
        return _cdiv(self.n_blocks, self.n_prog)

    @property
    def exact(self) -> bool:
        """Every block of every program is a whole block of real rows: no row masks are needed."""
        return self.T % self.rows == 0 and self.n_iter * self.n_prog == self.n_blocks


@dataclasses.dataclass(frozen=True)
class _QGeometry:
    """Static shape of the q part: T rows of width Rq."""
    Rq: int
    eps: float
    part: _Part


@dataclasses.dataclass(frozen=True)
class _CacheGeometry:
    """Static shape of the cache part: widths, FP8 formats, logical rows / block size / page rows of each
    cache (slot = page * bs + offset -> row page * page_rows + offset), RoPE layouts."""
    R: int
    Dr: int
    Di: int
    tile: int
    nt: int
    mla_fp8: bool
    idx_fp8: bool
    has_index: bool
    mla_rows: int
    mla_bs: int
    mla_pr: int
    idx_rows: int
    idx_bs: int
    idx_pr: int
    rope_il: bool
    index_rope_il: bool
    eps: float
    interpret: bool
    part: _Part


def _row_block(blk, part: _Part):
    """Rows of block `blk`, which are real (< T), and rows safe to load (clamped; stores are masked)."""
    rows = blk * part.rows + _iota((part.rows,), 0)
    if part.exact:
        return rows, None, rows
    return rows, rows < part.T, jnp.minimum(rows, part.T - 1)


def _for_blocks(pid, part: _Part, body):
    """body(blk) for the blocks of program `pid` of `part`; a static-trip loop when there are several."""
    if part.n_iter == 1:
        body(pid)
        return

    @pl.loop(0, part.n_iter)
    def _(i):
        body(pid + i * part.n_prog)


# ------------------------------------------------------------------------------ the q part

def _q_geometry(Rq):
    pq = _p2(Rq)
    qcol = _iota((1, pq), 1)
    return qcol, None if pq == Rq else qcol < Rq


def _q_weights(qw_ref, Rq):
    qcol, qcm = _q_geometry(Rq)
    return _ld(qw_ref.at[qcol[0]], None if qcm is None else qcm[0]).astype(jnp.float32)[None, :]


def _q_load(blk, qc_ref, g: _QGeometry):
    """Load phase of a q block: its rows and their q_c values (float32)."""
    rows, in_range, rows_ld = _row_block(blk, g.part)
    qcol, qcm = _q_geometry(g.Rq)
    return rows, in_range, rows_ld, _ld(qc_ref.at[rows_ld[:, None], qcol], qcm).astype(jnp.float32)


def _q_finish(st, qn_ref, slot_ref, qw, g: _QGeometry):
    """(a) q RMSNorm of a loaded block, written for every row whatever its slot."""
    rows, in_range, rows_ld, x = st
    qcol, qcm = _q_geometry(g.Rq)
    ms = jnp.sum(x * x, axis=1) / g.Rq
    y = qw * (x * jax.lax.rsqrt(ms + g.eps)[:, None])
    ok = jnp.ones(rows.shape, jnp.bool_) if in_range is None else in_range
    write = _q_rows_to_write(ok, lambda: plgpu.load(slot_ref.at[rows_ld]) >= 0)
    if in_range is None and write is ok:  # every row real and written: unmasked (vectorised) stores
        plgpu.store(qn_ref.at[rows[:, None], qcol], y.astype(qn_ref.dtype), mask=qcm)
    else:
        plgpu.store(qn_ref.at[jnp.where(write, rows, MASKED_ROW)[:, None], qcol], y.astype(qn_ref.dtype),
                    mask=_and(write[:, None], qcm))


# ------------------------------------------------------------------------------ the cache part

def _kv_geometry(tile, nt):
    tp, ntp = _p2(tile), _p2(nt)
    ti = _iota((1, ntp, tp), 1)
    tc = _iota((1, ntp, tp), 2)
    kcm = _and(None if ntp == nt else ti < nt, None if tp == tile else tc < tile)
    return ti * tile + tc, kcm, ntp


def _index_geometry(Di, Dr):
    """Indexer key columns past the rotated ones: their offsets [1, pp] from Dr and mask (None: all real)."""
    npass = Di - Dr
    if npass == 0:
        return None, None
    pp = _p2(npass)
    jp = _iota((1, pp), 1)
    return jp, None if pp == npass else jp < npass


def _cache_weights(refs, g: _CacheGeometry):
    """Loads of a cache program that do not depend on its rows: kv norm weight, RoPE frequencies per column,
    indexer LayerNorm weight/bias at the rotated columns, their RoPE partners and the pass-through columns."""
    Dr, Di = g.Dr, g.Di
    kvw_ref, invf_ref, inw_ref, inb_ref = refs
    f32 = jnp.float32
    kcol, kcm, _ = _kv_geometry(g.tile, g.nt)
    wts = dict(kw=_ld(kvw_ref.at[kcol[0]], None if kcm is None else kcm[0]).astype(f32)[None])
    _, _, _, freq, _ = _rope_cols(Dr, Dr, g.rope_il)
    wts["pe_invf"] = plgpu.load(invf_ref.at[freq[0]])[None, :]
    if g.has_index:
        j, partner, _, ifreq, _ = _rope_cols(Dr, Dr, g.index_rope_il)
        wts.update(iw=plgpu.load(inw_ref.at[j[0]]).astype(f32)[None],
                   ib=plgpu.load(inb_ref.at[j[0]]).astype(f32)[None],
                   iwp=plgpu.load(inw_ref.at[partner[0]]).astype(f32)[None],
                   ibp=plgpu.load(inb_ref.at[partner[0]]).astype(f32)[None])
        if g.index_rope_il != g.rope_il:  # other layout: its own angles
            wts["i_invf"] = plgpu.load(invf_ref.at[ifreq[0]])[None, :]
        jp, pm = _index_geometry(Di, Dr)
        if jp is not None:
            m = None if pm is None else pm[0]
            wts.update(iw_pass=_ld(inw_ref.at[Dr + jp[0]], m).astype(f32)[None],
                       ib_pass=_ld(inb_ref.at[Dr + jp[0]], m).astype(f32)[None])
    return wts


def _mla_fp8_store(mla_ref, phys, ok2, kv_n, kcm, pe, g: _CacheGeometry):
    """fp8_ds_mla row: e4m3 kv codes per tile, the float32 tile scales, k_pe bf16; three contiguous byte runs."""
    R, Dr, nt, interpret = g.R, g.Dr, g.nt, g.interpret
    f32 = jnp.float32
    kcol, _, ntp = _kv_geometry(g.tile, nt)
    kvf = kv_n.astype(f32)
    amax = jnp.max(jnp.abs(kvf) if kcm is None else jnp.where(kcm, jnp.abs(kvf), 0.0), axis=2)  # [bc, ntp]
    scale = f8.mla_tile_scale(amax, div=functools.partial(div_rn, interpret=interpret))
    qb = f8.e4m3_bits(div_rn(kvf, scale[:, :, None], interpret))
    plgpu.store(mla_ref.at[phys[:, None, None], kcol], qb, mask=_and(ok2[:, :, None], kcm))
    sb = _le_bytes(jax.lax.bitcast_convert_type(scale, jnp.int32), 4)  # [bc, 4 ntp]
    sc = _iota((1, 4 * ntp), 1)
    plgpu.store(mla_ref.at[phys[:, None], R + sc], sb, mask=_and(ok2, None if ntp == nt else sc < 4 * nt))
    pb = _le_bytes(jax.lax.bitcast_convert_type(pe.astype(jnp.bfloat16), jnp.uint16).astype(jnp.int32), 2)
    plgpu.store(mla_ref.at[phys[:, None], R + 4 * nt + _iota((1, 2 * Dr), 1)], pb, mask=ok2)


def _cache_load(blk, refs, g: _CacheGeometry):
    """Load phase of a cache block: slots, positions, kv_c (latent as [nt, tile], k_pe and its partners), the
    indexer key (rotated columns, their partners, pass-through columns) and indexer slots."""
    R, Dr = g.R, g.Dr
    kvc_ref, pos_ref, slot_ref, islot_ref, ik_ref = refs
    f32 = jnp.float32
    rows, in_range, rows_ld = _row_block(blk, g.part)
    r2, r3 = rows_ld[:, None], rows_ld[:, None, None]
    kcol, kcm, _ = _kv_geometry(g.tile, g.nt)
    j, partner, _, _, _ = _rope_cols(Dr, Dr, g.rope_il)
    st = dict(in_range=in_range, slot=plgpu.load(slot_ref.at[rows_ld]),
              pos=plgpu.load(pos_ref.at[rows_ld]).astype(f32)[:, None],
              kv=_ld(kvc_ref.at[r3, kcol], kcm).astype(f32),
              pe_x=plgpu.load(kvc_ref.at[r2, R + j]).astype(f32),
              pe_p=plgpu.load(kvc_ref.at[r2, R + partner]).astype(f32))
    if g.has_index:
        j, partner, _, _, _ = _rope_cols(Dr, Dr, g.index_rope_il)
        jp, pm = _index_geometry(g.Di, Dr)
        st.update(islot=plgpu.load(islot_ref.at[rows_ld]), ix=plgpu.load(ik_ref.at[r2, j]).astype(f32),
                  ixp=plgpu.load(ik_ref.at[r2, partner]).astype(f32),
                  ixq=None if jp is None else _ld(ik_ref.at[r2, Dr + jp], pm).astype(f32))
    return st


def _index_row(st, iok, cs, icache_ref, wts, g: _CacheGeometry, in_dtype):
    """(d) indexer key of the block's rows: LayerNorm over Di, RoPE on dims [0, Dr), stored at its own slot
    (FP8 bytes + UE8M0 scale, or the cache's dtype). `cs`: k_pe's (cos, sin) per column, reused when the
    layouts agree."""
    Dr, Di, eps = g.Dr, g.Di, g.eps
    f32 = jnp.float32
    j, _, sign, _, _ = _rope_cols(Dr, Dr, g.index_rope_il)
    jp, pm = _index_geometry(Di, Dr)
    x, xq, xp = st["ix"], st["ixq"], st["ixp"]
    tot = jnp.sum(x, axis=1, keepdims=True)
    if xq is not None:
        tot = tot + jnp.sum(xq, axis=1, keepdims=True)
    mu = tot / Di
    d = x - mu
    ss = jnp.sum(d * d, axis=1, keepdims=True)
    dq = None
    if xq is not None:
        dq = xq - mu if pm is None else jnp.where(pm, xq - mu, 0.0)
        ss = ss + jnp.sum(dq * dq, axis=1, keepdims=True)
    rstd = jax.lax.rsqrt(ss / Di + eps)
    k = (d * rstd * wts["iw"] + wts["ib"]).astype(in_dtype).astype(f32)
    # the partner's normalised value, by the same arithmetic (its column's x, w, b)
    kp = ((xp - mu) * rstd * wts["iwp"] + wts["ibp"]).astype(in_dtype).astype(f32)
    if "i_invf" in wts:
        ang = st["pos"] * wts["i_invf"]
        cos, sin = jnp.cos(ang), jnp.sin(ang)
    else:
        cos, sin = cs
    k = (k * cos + sign * (kp * sin)).astype(in_dtype)
    kq = None if dq is None else (dq * rstd * wts["iw_pass"] + wts["ib_pass"]).astype(in_dtype)

    islot = st["islot"]
    iphys = islot if g.idx_bs == g.idx_pr else (islot // g.idx_bs) * g.idx_pr + islot % g.idx_bs
    iphys = jnp.where(iok, iphys, MASKED_ROW)[:, None]
    iok2 = iok[:, None]
    if not g.idx_fp8:
        plgpu.store(icache_ref.at[iphys, j], k.astype(icache_ref.dtype), mask=iok2)
        if kq is not None:
            plgpu.store(icache_ref.at[iphys, Dr + jp], kq.astype(icache_ref.dtype), mask=_and(iok2, pm))
        return
    kf = k.astype(f32)
    amax = jnp.max(jnp.abs(kf), axis=1)
    kqf = None
    if kq is not None:
        kqf = kq.astype(f32)
        amax = jnp.maximum(amax, jnp.max(jnp.abs(kqf) if pm is None else jnp.where(pm, jnp.abs(kqf), 0.0), axis=1))
    s, inv_s = f8.ue8m0_scale_and_inverse(amax)
    plgpu.store(icache_ref.at[iphys, j], f8.e4m3_bits(kf * inv_s[:, None]), mask=iok2)
    if kqf is not None:
        plgpu.store(icache_ref.at[iphys, Dr + jp], f8.e4m3_bits(kqf * inv_s[:, None]), mask=_and(iok2, pm))
    sbytes = _le_bytes(jax.lax.bitcast_convert_type(s, jnp.int32)[:, None], 4)  # [bc, 4]
    plgpu.store(icache_ref.at[iphys, Di + _iota((1, 4), 1)], sbytes, mask=iok2)


def _cache_finish(st, refs, wts, g: _CacheGeometry, in_dtype):
    """(b)-(d) for a loaded block: MLA row and indexer key row at their slots, unless slot < 0."""
    R, Dr, eps = g.R, g.Dr, g.eps
    mla_ref, icache_ref = refs
    slot, in_range = st["slot"], st["in_range"]
    slot_ok = _and(in_range, (slot >= 0) & (slot < g.mla_rows))

    # (c) kv RMSNorm over [nt, tile] (tile = the fp8 scale tile).
    kcol, kcm, _ = _kv_geometry(g.tile, g.nt)
    kv = st["kv"]
    ms = jnp.sum(jnp.sum(kv * kv, axis=2), axis=1) / R
    kv_n = (wts["kw"] * (kv * jax.lax.rsqrt(ms + eps)[:, None, None])).astype(in_dtype)

    # k_pe RoPE: x_j cos - x_partner sin (first of a pair) / x_j cos + x_partner sin.
    j, _, sign, _, _ = _rope_cols(Dr, Dr, g.rope_il)
    ang = st["pos"] * wts["pe_invf"]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    pe = (st["pe_x"] * cos + sign * (st["pe_p"] * sin)).astype(in_dtype)

    # (b) + (c): store the MLA row at its physical row (page * page_rows + offset), only where slot_ok.
    phys = slot if g.mla_bs == g.mla_pr else (slot // g.mla_bs) * g.mla_pr + slot % g.mla_bs
    phys = jnp.where(slot_ok, phys, MASKED_ROW)
    ok2 = slot_ok[:, None]
    if not g.mla_fp8:
        plgpu.store(mla_ref.at[phys[:, None, None], kcol], kv_n.astype(mla_ref.dtype), mask=_and(ok2[:, :, None], kcm))
        plgpu.store(mla_ref.at[phys[:, None], R + j], pe.astype(mla_ref.dtype), mask=ok2)
    else:
        _mla_fp8_store(mla_ref, phys, ok2, kv_n, kcm, pe, g)

    if g.has_index:
        islot = st["islot"]
        iok = _and(in_range, (slot >= 0) & (islot >= 0) & (islot < g.idx_rows))  # (b) looks at the MLA slot's sign
        _index_row(st, iok, (cos, sin), icache_ref, wts, g, in_dtype)


def _topk_share(pid, n_prog, topk_ref, topk_n, chunk):
    """(e) Top-K clearing: program `pid`'s contiguous share (of `n_prog`) of the flat buffer."""
    share = chunk * _cdiv(_cdiv(topk_n, n_prog), chunk)
    start = pid * share
    col = _iota((chunk,), 0)

    @pl.loop(0, share, step=chunk)
    def _(i):
        idx = start + i + col
        ok = (idx < topk_n) & (i + col < share)
        plgpu.store(topk_ref.at[jnp.where(ok, idx, topk_n)], jnp.full((chunk,), -1, topk_ref.dtype), mask=ok)


# ------------------------------------------------------------------------------ the kernel

@dataclasses.dataclass(frozen=True)
class _Launch:
    """One launch: which parts it runs, how program ids map to them, the top-k share."""
    layout: str  # "split", "interleave", "fused", "q", "cache"
    grid: int
    q: _QGeometry | None
    c: _CacheGeometry | None
    group: int  # interleave: k q programs then one cache program per group of k + 1
    has_index: bool
    has_topk: bool
    topk_n: int
    topk_chunk: int


def _kernel(*refs, lc: _Launch):
    """Runs the launch's parts on the program's blocks (`_Launch.layout`); a program of the launch with the
    cache part also clears its share of the top-k buffer."""
    it = iter(refs)
    has_q, has_c, has_index = lc.q is not None, lc.c is not None, lc.has_index
    qc_ref = next(it) if has_q else None
    kvc_ref = pos_ref = islot_ref = ik_ref = None
    if has_c:
        kvc_ref, pos_ref = next(it), next(it)
    slot_ref = next(it)
    if has_c and has_index:
        islot_ref = next(it)
    qw_ref = next(it) if has_q else None
    kvw_ref = invf_ref = inw_ref = inb_ref = None
    if has_c:
        kvw_ref, invf_ref = next(it), next(it)
        if has_index:
            ik_ref, inw_ref, inb_ref = next(it), next(it), next(it)
        next(it)  # mla cache (input side of the alias)
        if has_index:
            next(it)
        if lc.has_topk:
            next(it)
    qn_ref = next(it) if has_q else None
    mla_ref = icache_ref = topk_ref = None
    if has_c:
        mla_ref = next(it)
        icache_ref = next(it) if has_index else None
        topk_ref = next(it) if lc.has_topk else None
    pid = pl.program_id(0)

    c_load_refs = (kvc_ref, pos_ref, slot_ref, islot_ref, ik_ref)
    c_store_refs = (mla_ref, icache_ref)
    in_dtype = kvc_ref.dtype if has_c else None

    def q_weights():
        return _q_weights(qw_ref, lc.q.Rq)

    def c_weights():
        return _cache_weights((kvw_ref, invf_ref, inw_ref, inb_ref), lc.c)

    def q_program(p):
        qw = q_weights()
        _for_blocks(p, lc.q.part, lambda blk: _q_finish(_q_load(blk, qc_ref, lc.q), qn_ref, slot_ref, qw, lc.q))

    def cache_program(p):
        wts = c_weights()
        _for_blocks(p, lc.c.part, lambda blk: _cache_finish(_cache_load(blk, c_load_refs, lc.c), c_store_refs, wts,
                                                            lc.c, in_dtype))

    def both_program(p):
        """Fused layout, both parts on every program with as many blocks: each step issues the loads of its q
        block and its cache block before any arithmetic or store (stores might alias later loads for the
        compiler, so loads placed after them would wait)."""
        qw, wts = q_weights(), c_weights()

        def step(i):
            qst = _q_load(p + i * lc.q.part.n_prog, qc_ref, lc.q)
            cst = _cache_load(p + i * lc.c.part.n_prog, c_load_refs, lc.c)
            _q_finish(qst, qn_ref, slot_ref, qw, lc.q)
            _cache_finish(cst, c_store_refs, wts, lc.c, in_dtype)
        if lc.q.part.n_iter == 1:
            step(0)
        else:
            pl.loop(0, lc.q.part.n_iter)(step)

    def when(cond, fn, p):
        if cond is None:
            fn(p)
        else:
            pl.when(cond)(lambda: fn(p))  # pl.when runs the function under the condition

    nqp = lc.q.part.n_prog if has_q else 0
    ncp = lc.c.part.n_prog if has_c else 0
    if lc.layout == "q":
        when(None if nqp == lc.grid else pid < nqp, q_program, pid)
    elif lc.layout == "cache":
        when(None if ncp == lc.grid else pid < ncp, cache_program, pid)
    elif lc.layout == "split":
        when(pid < nqp, q_program, pid)
        when(pid >= nqp, cache_program, pid - nqp)
    elif lc.layout == "fused" and nqp == ncp == lc.grid and lc.q.part.n_iter == lc.c.part.n_iter:
        both_program(pid)
    elif lc.layout == "fused":
        when(None if nqp == lc.grid else pid < nqp, q_program, pid)
        when(None if ncp == lc.grid else pid < ncp, cache_program, pid)
    else:  # interleave
        k = lc.group - 1
        grp, r = pid // lc.group, pid % lc.group
        when((r < k) & (grp * k + r < nqp), q_program, grp * k + r)
        when((r == k) & (grp < ncp), cache_program, grp)

    if has_c and lc.has_topk:
        _topk_share(pid, lc.grid, topk_ref, lc.topk_n, lc.topk_chunk)


# ------------------------------------------------------------------------------ configs


def _launches(cfg: FusedNormRopeConfig, T: int, q_fields: dict, c_fields: dict, topk_n: int, has_index: bool,
              has_topk: bool) -> list[tuple[_Launch, int]]:
    """The launches of a config and their warp counts: one, or the q launch then the cache launch."""
    nq_blocks, nc_blocks = _cdiv(T, cfg.q_rows), _cdiv(T, cfg.cache_rows)
    nqp = min(cfg.q_programs or nq_blocks, nq_blocks)
    ncp = min(cfg.cache_programs or nc_blocks, nc_blocks)
    qg = _QGeometry(part=_Part(T=T, rows=cfg.q_rows, n_prog=nqp), **q_fields)
    cg = _CacheGeometry(part=_Part(T=T, rows=cfg.cache_rows, n_prog=ncp), **c_fields)
    group = 1
    if cfg.layout == "split":
        grid = nqp + ncp
    elif cfg.layout == "fused":
        grid = max(nqp, ncp)
    elif cfg.layout == "interleave":
        k = max(1, nqp // ncp)
        group = k + 1
        grid = group * max(_cdiv(nqp, k), ncp)
    else:
        grid = 0

    def launch(layout, grid, q, c):
        chunk = min(1024, _p2(max(1, _cdiv(topk_n, grid)))) if has_topk and c is not None else 1
        return _Launch(layout=layout, grid=grid, q=q, c=c, group=group, has_index=has_index,
                       has_topk=has_topk and c is not None, topk_n=topk_n, topk_chunk=chunk)
    if cfg.layout == "two_launch":
        return [(launch("q", nqp, qg, None), cfg.q_warps or cfg.num_warps), (launch("cache", ncp, None, cg),
                                                                              cfg.num_warps)]
    return [(launch(cfg.layout, grid, qg, cg), cfg.num_warps)]


# ------------------------------------------------------------------------------ the wrapper

def _page_geometry(cache, block_size, what: str):
    """cache [rows, pitch] (flat, slot = row) or [pages, page_rows, pitch] with slot = page * block_size + off."""
    if cache.ndim == 2:
        return cache, cache.shape[0], cache.shape[0], cache.shape[0]  # flat: bs = page_rows = rows
    pages, page_rows, pitch = cache.shape
    bs = page_rows if block_size is None else block_size
    if not 1 <= bs <= page_rows:
        raise ValueError(f"fused_norm_rope: block_size {bs} must be in [1, page_rows = {page_rows}] of the {what} "
                         f"{cache.shape}")
    return cache.reshape(pages * page_rows, pitch), pages * bs, bs, page_rows


def _call(lc: _Launch, num_warps: int, num_stages: int, arrays: dict, interpret: bool):
    """One pallas_call of `_kernel` for launch `lc`; `arrays` holds every operand by name. Returns the outputs
    by name (q_n; mla, idx, topk: the aliased caches)."""
    has_q, has_c = lc.q is not None, lc.c is not None
    names = (["q_c"] if has_q else []) + (["kv_c", "positions"] if has_c else []) + ["slots"]
    names += ["islots"] if has_c and lc.has_index else []
    names += ["q_norm_w"] if has_q else []
    if has_c:
        names += ["kv_norm_w", "inv_freq"] + (["index_k", "index_norm_w", "index_norm_b"] if lc.has_index else [])
    aliased = (["mla", "idx"] if lc.has_index else ["mla"]) + (["topk"] if lc.has_topk else []) if has_c else []
    first_alias = len(names)
    names += aliased
    out_names = (["q_n"] if has_q else []) + aliased
    q_c = arrays["q_c"]
    outs = [jax.ShapeDtypeStruct(q_c.shape, q_c.dtype) if n == "q_n" else
            jax.ShapeDtypeStruct(arrays[n].shape, arrays[n].dtype) for n in out_names]
    aliases = {first_alias + i: int(has_q) + i for i in range(len(aliased))}
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    call = pl.pallas_call(
        functools.partial(_kernel, lc=lc), grid=(lc.grid,), out_shape=outs,
        in_specs=[any_spec] * len(names), out_specs=[any_spec] * len(outs),
        input_output_aliases=aliases, interpret=interpret, name="fused_norm_rope_cache",
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages))
    return dict(zip(out_names, call(*[arrays[n] for n in names])))


def fused_norm_rope_cache_triton(q_c, kv_c, positions, slot_mapping, q_norm_w, kv_norm_w, mla_cache, *,
                                 rope_theta, rope_interleave: bool = True, eps: float = 1e-6,
                                 index_k=None, index_norm_w=None, index_norm_b=None, index_cache=None,
                                 index_slot_mapping=None, index_rope_interleave: bool = True, topk_buf=None,
                                 block_size=None, config: FusedNormRopeConfig | None = None, interpret: bool = False,
                                 **overrides):
    """Pallas Triton kernel; same contract as `fused_norm_rope.fused_norm_rope_cache_xla`.

    Caches: 2-D [slots, pitch] (slot = row) or 3-D [pages, page_rows, pitch] with `block_size <= page_rows`
    (slot = page * block_size + offset; padded pages and padded row pitches are left untouched). A uint8
    cache holds FP8 rows (`fp8_formats`). Returns (q_normed, mla_cache, index_cache, topk_buf).
    `config` (default `default_config(T, fp8 cache)`); `overrides` replace fields of it by name (`FusedNormRopeConfig`'s
    fields; None keeps the field). `interpret`: run under the Pallas interpreter.
    """
    if not interpret:
        check_addressable(mla_cache, "fused_norm_rope MLA cache")
        if index_cache is not None:
            check_addressable(index_cache, "fused_norm_rope indexer cache")
    T, Rq = q_c.shape
    R = kv_norm_w.shape[0]
    Dr = kv_c.shape[-1] - R
    why = supports(q_c, kv_c, positions, slot_mapping, q_norm_w, kv_norm_w, mla_cache, index_k=index_k)
    if why:
        raise ValueError(f"fused_norm_rope triton: {why}")
    mla_shape = mla_cache.shape
    mla_flat, mla_logical, mla_bs, mla_pr = _page_geometry(mla_cache, block_size, "MLA cache")
    mla_fp8 = mla_cache.dtype == jnp.uint8
    need = f8.mla_row_bytes(R, Dr) if mla_fp8 else R + Dr
    if mla_flat.shape[1] < need:
        raise ValueError(f"fused_norm_rope: MLA cache pitch {mla_flat.shape[1]} < its row width {need} "
                         f"(R={R}, Dr={Dr}, {'fp8_ds_mla' if mla_fp8 else mla_cache.dtype})")
    tile = f8.mla_tile(R) if mla_fp8 else (128 if R % 128 == 0 else R)
    nt = R // tile

    has_index = index_cache is not None
    has_topk = has_index and topk_buf is not None
    Di, idx_fp8, idx_flat, idx_logical, idx_bs, idx_pr = 0, False, None, 0, 1, 1
    idx_shape = None
    if has_index:
        Di = index_k.shape[-1]
        idx_shape = index_cache.shape
        idx_flat, idx_logical, idx_bs, idx_pr = _page_geometry(index_cache, block_size, "indexer cache")
        idx_fp8 = index_cache.dtype == jnp.uint8
        need = f8.index_row_bytes(Di) if idx_fp8 else Di
        if idx_flat.shape[1] < need:
            raise ValueError(f"fused_norm_rope: indexer cache pitch {idx_flat.shape[1]} < its row width {need} "
                             f"(Di={Di}, {'fp8' if idx_fp8 else index_cache.dtype})")
    # an option given as None keeps the config's value
    cfg = with_options(config or default_config(registry.config_rows(T), mla_fp8 or idx_fp8),
                       {k: v for k, v in overrides.items() if v is not None}, "fused_norm_rope")
    registry.launch("fused_norm_rope", cfg)
    if (mla_fp8 or idx_fp8) and cfg.cache_rows < FP8_MIN_CACHE_ROWS:
        raise ValueError(f"fused_norm_rope triton: cache_rows {cfg.cache_rows} with an FP8 cache; it needs "
                         f"cache_rows >= {FP8_MIN_CACHE_ROWS} (1-row FP8 launches segfault in Triton's compiler on "
                         "the H200)")
    if T == 0:
        topk_out = jnp.full_like(topk_buf, -1) if has_topk else topk_buf
        return q_c, mla_cache, index_cache, topk_out

    topk_n = topk_buf.size if has_topk else 0
    launches = _launches(
        cfg, T, dict(Rq=Rq, eps=float(eps)),
        dict(R=R, Dr=Dr, Di=Di, tile=tile, nt=nt, mla_fp8=mla_fp8, idx_fp8=idx_fp8, has_index=has_index,
             mla_rows=mla_logical, mla_bs=mla_bs, mla_pr=mla_pr, idx_rows=idx_logical, idx_bs=idx_bs, idx_pr=idx_pr,
             rope_il=bool(rope_interleave), index_rope_il=bool(index_rope_interleave), eps=float(eps),
             interpret=bool(interpret)),
        topk_n, has_index, has_topk)

    arrays = dict(q_c=q_c, kv_c=kv_c, positions=positions.astype(jnp.int32), slots=slot_mapping.astype(jnp.int32),
                  q_norm_w=q_norm_w, kv_norm_w=kv_norm_w, inv_freq=rope.inv_freq(Dr, rope_theta),  # base or YaRN
                  mla=mla_flat)
    if has_index:
        islots = slot_mapping if index_slot_mapping is None else index_slot_mapping
        arrays.update(islots=islots.astype(jnp.int32), index_k=index_k, index_norm_w=index_norm_w,
                      index_norm_b=index_norm_b, idx=idx_flat)
    if has_topk:
        arrays["topk"] = topk_buf.reshape(-1)
    for lc, warps in launches:
        arrays.update(_call(lc, warps, cfg.num_stages, arrays, interpret))
    q_n, mla_out = arrays["q_n"], arrays["mla"].reshape(mla_shape)
    idx_out = arrays["idx"].reshape(idx_shape) if has_index else index_cache
    topk_out = arrays["topk"].reshape(topk_buf.shape) if has_topk else topk_buf
    return q_n, mla_out, idx_out, topk_out


def q_norm_triton(q_c, q_norm_w, *, eps: float = 1e-6, config: FusedNormRopeConfig | None = None,
                  interpret: bool = False, **overrides):
    """The q part alone (RMSNorm of every row, `rms_norm(q_c, q_norm_w, eps)`) as its own launch, with the q
    fields of `config` (q_rows, q_programs, q_warps or num_warps, num_stages). For benchmarks: it shows what
    the q stream costs by itself, and it is the first launch of layout "two_launch"."""
    T, Rq = q_c.shape
    cfg = with_options(config or default_config(registry.config_rows(T)), {k: v for k, v in overrides.items() if v is not None},
                       "fused_norm_rope")
    if T == 0:
        return q_c
    n_blocks = _cdiv(T, cfg.q_rows)
    part = _Part(T=T, rows=cfg.q_rows, n_prog=min(cfg.q_programs or n_blocks, n_blocks))
    lc = _Launch(layout="q", grid=part.n_prog, q=_QGeometry(Rq=Rq, eps=float(eps), part=part), c=None, group=1,
                 has_index=False, has_topk=False, topk_n=0, topk_chunk=1)
    arrays = dict(q_c=q_c, q_norm_w=q_norm_w, slots=jnp.zeros((T,), jnp.int32))
    return _call(lc, cfg.q_warps or cfg.num_warps, cfg.num_stages, arrays, interpret)["q_n"]


def supports(q_c, kv_c, positions, slot_mapping, q_norm_w, kv_norm_w, mla_cache, *, index_k=None, **_) -> str | None:
    """Why the kernel cannot take these shapes (None: it can): RoPE partners are found by bit tricks over
    power-of-two column ranges, so the rope dim Dr (kv_c width - kv_lora_rank) must be 2 x a power of two,
    and the indexer key width Di must be at least Dr."""
    R = kv_norm_w.shape[0]
    Dr = kv_c.shape[-1] - R
    if Dr < 2 or Dr % 2 or not is_pow2(Dr // 2):
        return f"rope dim {Dr} (kv_c width {kv_c.shape[-1]} - kv_lora_rank {R}) must be 2 x a power of two"
    if index_k is not None and index_k.shape[-1] < Dr:
        return f"indexer key width {index_k.shape[-1]} must be >= the rope dim {Dr}"
    return None
