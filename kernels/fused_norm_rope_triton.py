"""Pallas Triton form of the fused q/kv norm + RoPE + paged cache write (docs/math.md §4), one kernel per layer.

One launch: a 1-D grid of q programs then cache programs, one block of rows each (`FusedNormRopeConfig`:
`q_rows` / `cache_rows` token rows per program, warps, stages).
  q part (a): q RMSNorm, written for EVERY row — the slot is not looked at (3/4 of the bytes);
  cache part, per row:
      (b) `slot < 0` (or past the cache) masks every cache store of the row — MLA and indexer;
      (c) kv RMSNorm + RoPE on k_pe -> MLA cache row (bfloat16 `[kv | k_pe]` or fp8_ds_mla bytes);
      (d) full layers: indexer key LayerNorm + RoPE on its first Dr dims (interleaved or neox) -> indexer
          cache (its own dtype, or FP8 bytes with a UE8M0 scale) at the indexer slot;
  every program: (e) with a top-k buffer (full layers), its share of the buffer set to -1.

Caches are `pl.ANY` refs aliased input -> output (`input_output_aliases`): rows are stored at computed
offsets, nothing else of a cache is touched, and a donated cache is updated in place. Widths that are
not powers of two (q_lora 48, ...) are loaded as the next power of two under a column mask.

RoPE without shuffles: each rotated column j also loads its partner column (j ^ 1 interleaved, (j + Dr/2)
mod Dr neox) and computes `x_j cos - x_partner sin` (first of a pair) or `x_j cos + x_partner sin`.

Numerics follow the xla oracle step by step: norms in float32 rounded to the input dtype, RoPE in
float32 of the rounded values rounded again, then the cache cast or the FP8 quantiser of
`kernels.fp8_formats` (its `mla_tile_scale`, `e4m3_bits`, `ue8m0_scale_and_inverse`, called in the kernel):
IEEE division (`div.rn.f32` inline PTX; Triton's `/` is div.full.f32) for the MLA scale and values, UE8M0
scales from the float32 bits, values times the exact power-of-two 1/s.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import fp8_formats as f8
from . import rope
from .triton_common import MASKED_ROW, bytes_of, check_addressable, with_options


def _p2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# ------------------------------------------------------------------------------ in-kernel helpers

def _div_rn(a, b, interpret: bool):
    """IEEE float32 a / b (Triton's `/` is div.full.f32, ~2 ulp; XLA turns A / broadcast(b) into A * 1/b)."""
    b = jnp.broadcast_to(jnp.asarray(b, jnp.float32), a.shape)
    if interpret:
        return f8.exact_div(a, b)
    [out] = plgpu.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
                                         result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return out


def _and(a, b):
    """a & b where either may be None (= all true): statically full masks are dropped, which lets Triton
    vectorise the accesses."""
    return b if a is None else a if b is None else a & b


def _ld(ref, mask):
    return plgpu.load(ref, mask=mask, other=None if mask is None else 0)


def _rope_cols(width: int, dr: int, interleave: bool):
    """For columns j < width ([1, width]): the partner column, the sign of the partner term, the frequency
    index and whether j is rotated (j < dr)."""
    j = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
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


def _q_rows_to_write(in_range, slot_ok_fn):
    """Rows whose normalised q is written: every row in range, whatever its slot (docs/math.md §4 (a)).

    Kept as a module-level function so a test can swap in the defective variant
    (`in_range & slot_ok_fn()`) and show that its check catches it."""
    del slot_ok_fn
    return in_range


# ------------------------------------------------------------------------------ the kernel

def _row_block(blk, bt, T):
    rows = blk * bt + jax.lax.broadcasted_iota(jnp.int32, (bt,), 0)
    return rows, rows < T, jnp.minimum(rows, T - 1)  # loads stay in bounds; stores are masked


def _q_geometry(Rq):
    pq = _p2(Rq)
    qcol = jax.lax.broadcasted_iota(jnp.int32, (1, pq), 1)
    return qcol, None if pq == Rq else qcol < Rq


def _q_weights(qw_ref, Rq):
    qcol, qcm = _q_geometry(Rq)
    return _ld(qw_ref.at[qcol[0]], None if qcm is None else qcm[0]).astype(jnp.float32)[None, :]


@dataclasses.dataclass(frozen=True)
class _QGeometry:
    """Static shape of the q part: T rows of width Rq, `bt` rows per program."""
    T: int
    Rq: int
    eps: float
    bt: int


@dataclasses.dataclass(frozen=True)
class _CacheGeometry:
    """Static shape of the cache part: widths, FP8 formats, logical rows / block size / page rows of each
    cache (slot = page * bs + offset -> row page * page_rows + offset), RoPE layouts, `bc` rows per program."""
    T: int
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
    bc: int
    interpret: bool


def _q_rows(blk, qc_ref, qn_ref, slot_ref, qw, g: _QGeometry):
    """(a) q RMSNorm of rows [blk * bt, +bt), written for every row whatever its slot."""
    T, Rq, eps, bt = g.T, g.Rq, g.eps, g.bt
    rows, in_range, rows_ld = _row_block(blk, bt, T)
    qcol, qcm = _q_geometry(Rq)
    x = _ld(qc_ref.at[rows_ld[:, None], qcol], qcm).astype(jnp.float32)
    ms = jnp.sum(x * x, axis=1) / Rq
    y = qw * (x * jax.lax.rsqrt(ms + eps)[:, None])
    write = _q_rows_to_write(in_range, lambda: plgpu.load(slot_ref.at[rows_ld]) >= 0)
    plgpu.store(qn_ref.at[jnp.where(write, rows, MASKED_ROW)[:, None], qcol], y.astype(qn_ref.dtype),
                mask=_and(write[:, None], qcm))


def _kv_geometry(tile, nt):
    tp, ntp = _p2(tile), _p2(nt)
    ti = jax.lax.broadcasted_iota(jnp.int32, (1, ntp, tp), 1)
    tc = jax.lax.broadcasted_iota(jnp.int32, (1, ntp, tp), 2)
    kcm = _and(None if ntp == nt else ti < nt, None if tp == tile else tc < tile)
    return ti * tile + tc, kcm, ntp


def _cache_weights(refs, g: _CacheGeometry):
    """Loads of a cache program that do not depend on its rows: kv norm weight, RoPE frequencies per column,
    indexer LayerNorm weight/bias at each column and at its RoPE partner."""
    Dr, Di, tile, nt, has_index = g.Dr, g.Di, g.tile, g.nt, g.has_index
    rope_il, index_rope_il = g.rope_il, g.index_rope_il
    kvw_ref, invf_ref, inw_ref, inb_ref = refs
    f32 = jnp.float32
    kcol, kcm, _ = _kv_geometry(tile, nt)
    wts = dict(kw=_ld(kvw_ref.at[kcol[0]], None if kcm is None else kcm[0]).astype(f32)[None])
    _, _, _, freq, _ = _rope_cols(Dr, Dr, rope_il)
    wts["pe_invf"] = plgpu.load(invf_ref.at[freq[0]])[None, :]
    if has_index:
        pi = _p2(Di)
        j, partner, _, freq, _ = _rope_cols(pi, Dr, index_rope_il)
        cm = None if pi == Di else j[0] < Di
        wts.update(iw=_ld(inw_ref.at[j[0]], cm).astype(f32)[None], ib=_ld(inb_ref.at[j[0]], cm).astype(f32)[None],
                   iwp=_ld(inw_ref.at[partner[0]], cm).astype(f32)[None],
                   ibp=_ld(inb_ref.at[partner[0]], cm).astype(f32)[None],
                   i_invf=plgpu.load(invf_ref.at[freq[0]])[None, :])
    return wts


def _cache_rows(blk, refs, wts, g: _CacheGeometry):
    """(b)-(d) for rows [blk * bc, +bc): MLA row and indexer key row at their slots, unless slot < 0."""
    T, R, Dr, Di, tile, nt, eps, bc, interpret = g.T, g.R, g.Dr, g.Di, g.tile, g.nt, g.eps, g.bc, g.interpret
    mla_rows, mla_bs, mla_pr, idx_rows, idx_bs, idx_pr = g.mla_rows, g.mla_bs, g.mla_pr, g.idx_rows, g.idx_bs, g.idx_pr
    kvc_ref, pos_ref, slot_ref, islot_ref, ik_ref, mla_ref, icache_ref = refs
    f32 = jnp.float32
    in_dtype = kvc_ref.dtype
    rows, in_range, rows_ld = _row_block(blk, bc, T)
    r2, r3 = rows_ld[:, None], rows_ld[:, None, None]
    slot = plgpu.load(slot_ref.at[rows_ld])
    slot_ok = in_range & (slot >= 0) & (slot < mla_rows)
    pos = plgpu.load(pos_ref.at[rows_ld]).astype(f32)[:, None]

    # (c) kv RMSNorm over [nt, tile] (tile = the fp8 scale tile).
    kcol, kcm, ntp = _kv_geometry(tile, nt)
    kv = _ld(kvc_ref.at[r3, kcol], kcm).astype(f32)
    ms = jnp.sum(jnp.sum(kv * kv, axis=2), axis=1) / R
    kv_n = (wts["kw"] * (kv * jax.lax.rsqrt(ms + eps)[:, None, None])).astype(in_dtype)

    # k_pe RoPE: x_j cos - x_partner sin (first of a pair) / x_j cos + x_partner sin.
    j, partner, sign, _, _ = _rope_cols(Dr, Dr, g.rope_il)
    ang = pos * wts["pe_invf"]
    pe_x = plgpu.load(kvc_ref.at[r2, R + j]).astype(f32)
    pe_p = plgpu.load(kvc_ref.at[r2, R + partner]).astype(f32)
    pe = (pe_x * jnp.cos(ang) + sign * (pe_p * jnp.sin(ang))).astype(in_dtype)

    # (b) + (c): store the MLA row at its physical row (page * page_rows + offset), only where slot_ok.
    phys = slot if mla_bs == mla_pr else (slot // mla_bs) * mla_pr + slot % mla_bs
    phys = jnp.where(slot_ok, phys, MASKED_ROW)
    ok2 = slot_ok[:, None]
    if not g.mla_fp8:
        plgpu.store(mla_ref.at[phys[:, None, None], kcol], kv_n.astype(mla_ref.dtype), mask=_and(ok2[:, :, None], kcm))
        plgpu.store(mla_ref.at[phys[:, None], R + j], pe.astype(mla_ref.dtype), mask=ok2)
    else:
        kvf = kv_n.astype(f32)
        amax = jnp.max(jnp.abs(kvf) if kcm is None else jnp.where(kcm, jnp.abs(kvf), 0.0), axis=2)  # [bc, ntp]
        scale = f8.mla_tile_scale(amax, div=functools.partial(_div_rn, interpret=interpret))
        qb = f8.e4m3_bits(_div_rn(kvf, scale[:, :, None], interpret))
        plgpu.store(mla_ref.at[phys[:, None, None], kcol], qb, mask=_and(ok2[:, :, None], kcm))
        sb = bytes_of(jax.lax.bitcast_convert_type(scale, jnp.int32), 4)  # [bc, ntp, 4]
        sj = jax.lax.broadcasted_iota(jnp.int32, (1, ntp, 4), 1)
        sbyte = jax.lax.broadcasted_iota(jnp.int32, (1, ntp, 4), 2)
        plgpu.store(mla_ref.at[phys[:, None, None], R + 4 * sj + sbyte], sb,
                    mask=_and(ok2[:, :, None], None if ntp == nt else sj < nt))
        pb = jax.lax.bitcast_convert_type(pe.astype(jnp.bfloat16), jnp.uint16).astype(jnp.int32)
        bcol = R + 4 * nt + 2 * j[..., None] + jax.lax.broadcasted_iota(jnp.int32, (1, Dr, 2), 2)
        plgpu.store(mla_ref.at[phys[:, None, None], bcol], bytes_of(pb, 2), mask=ok2[:, :, None])

    if g.has_index:
        # (d) indexer key: LayerNorm over Di, RoPE on dims [0, Dr), FP8 or plain store at its own slot.
        islot = plgpu.load(islot_ref.at[rows_ld])
        iok = in_range & (slot >= 0) & (islot >= 0) & (islot < idx_rows)  # (b) looks at the MLA slot's sign
        pi = _p2(Di)
        j, partner, sign, _, rotated = _rope_cols(pi, Dr, g.index_rope_il)
        cm = None if pi == Di else j < Di
        x = _ld(ik_ref.at[r2, j], cm).astype(f32)
        mu = jnp.sum(x, axis=1, keepdims=True) / Di
        d = x - mu if cm is None else jnp.where(cm, x - mu, 0.0)
        rstd = jax.lax.rsqrt(jnp.sum(d * d, axis=1, keepdims=True) / Di + eps)
        k = (d * rstd * wts["iw"] + wts["ib"]).astype(in_dtype).astype(f32)
        # the partner's normalised value, by the same arithmetic (its column's x, w, b)
        xp = _ld(ik_ref.at[r2, partner], cm).astype(f32)
        kp = ((xp - mu) * rstd * wts["iwp"] + wts["ibp"]).astype(in_dtype).astype(f32)
        ang = pos * wts["i_invf"]
        k = jnp.where(rotated, k * jnp.cos(ang) + sign * (kp * jnp.sin(ang)), k).astype(in_dtype)
        iphys = islot if idx_bs == idx_pr else (islot // idx_bs) * idx_pr + islot % idx_bs
        iphys = jnp.where(iok, iphys, MASKED_ROW)[:, None]
        iok2 = iok[:, None]
        if not g.idx_fp8:
            plgpu.store(icache_ref.at[iphys, j], k.astype(icache_ref.dtype), mask=_and(iok2, cm))
        else:
            kf = k.astype(f32)
            amax = jnp.max(jnp.abs(kf) if cm is None else jnp.where(cm, jnp.abs(kf), 0.0), axis=1)
            s, inv_s = f8.ue8m0_scale_and_inverse(amax)
            plgpu.store(icache_ref.at[iphys, j], f8.e4m3_bits(kf * inv_s[:, None]), mask=_and(iok2, cm))
            scol = Di + jax.lax.broadcasted_iota(jnp.int32, (1, 4), 1)
            plgpu.store(icache_ref.at[iphys, scol], bytes_of(jax.lax.bitcast_convert_type(s, jnp.int32), 4),
                        mask=iok2)


def _topk_share(pid, topk_ref, topk_n, chunk):
    """(e) Top-K clearing: program `pid`'s contiguous share of the flat buffer."""
    share = chunk * pl.cdiv(pl.cdiv(topk_n, pl.num_programs(0)), chunk)
    start = pid * share
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    @pl.loop(0, share, step=chunk)
    def _(i):
        idx = start + i + col
        ok = (idx < topk_n) & (i + col < share)
        plgpu.store(topk_ref.at[jnp.where(ok, idx, topk_n)], jnp.full((chunk,), -1, topk_ref.dtype), mask=ok)


def _kernel(*refs, n_q, q_geom, c_geom, has_index, has_topk, topk_n, topk_chunk):
    """Programs [0, n_q) normalise q blocks, the rest write cache blocks (one block each); every program
    clears its share of the top-k buffer."""
    it = iter(refs)
    qc_ref, kvc_ref, pos_ref, slot_ref = next(it), next(it), next(it), next(it)
    islot_ref = next(it) if has_index else None
    qw_ref, kvw_ref, invf_ref = next(it), next(it), next(it)
    ik_ref = inw_ref = inb_ref = None
    if has_index:
        ik_ref, inw_ref, inb_ref = next(it), next(it), next(it)
    next(it)  # mla cache (input side of the alias)
    if has_index:
        next(it)
    if has_topk:
        next(it)
    qn_ref, mla_ref = next(it), next(it)
    icache_ref = next(it) if has_index else None
    topk_ref = next(it) if has_topk else None
    c_refs = (kvc_ref, pos_ref, slot_ref, islot_ref, ik_ref, mla_ref, icache_ref)
    w_refs = (kvw_ref, invf_ref, inw_ref, inb_ref)
    pid = pl.program_id(0)

    @pl.when(pid < n_q)
    def _():
        _q_rows(pid, qc_ref, qn_ref, slot_ref, _q_weights(qw_ref, q_geom.Rq), q_geom)

    @pl.when(pid >= n_q)
    def _():
        _cache_rows(pid - n_q, c_refs, _cache_weights(w_refs, c_geom), c_geom)

    if has_topk:
        _topk_share(pid, topk_ref, topk_n, topk_chunk)


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


def _pow2(v) -> bool:
    return isinstance(v, int) and v >= 1 and v & (v - 1) == 0


@dataclasses.dataclass(frozen=True)
class FusedNormRopeConfig:
    """Launch config: `q_rows` token rows per q program, `cache_rows` per cache program, warps (all powers of
    two: Triton's tiles are), pipeline stages."""
    q_rows: int
    cache_rows: int
    num_warps: int
    num_stages: int = 1

    def __post_init__(self):
        for name in ("q_rows", "cache_rows", "num_warps"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"FusedNormRopeConfig: {name} {getattr(self, name)!r} must be a power of two")
        if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"FusedNormRopeConfig: num_stages {self.num_stages!r} must be an int >= 1")


def default_config(T: int) -> FusedNormRopeConfig:
    """The launch config from the H200 sweeps in BENCHMARKS.md: 2-row blocks and 4 warps were the best or
    near-best measured at T = 4096 and 65536; one row per program below 256 rows."""
    rows = 1 if T < 256 else 2
    return FusedNormRopeConfig(q_rows=rows, cache_rows=rows, num_warps=4)


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
    `config` (default `default_config(T)`); `overrides` replace fields of it by name (q_rows, cache_rows,
    num_warps, num_stages; None keeps the field). `interpret`: run under the Pallas interpreter.
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
    if T == 0:
        topk_out = jnp.full_like(topk_buf, -1) if has_topk else topk_buf
        return q_c, mla_cache, index_cache, topk_out

    cfg = config or default_config(T)
    # an option given as None keeps the config's value
    cfg = with_options(cfg, {k: v for k, v in overrides.items() if v is not None}, "fused_norm_rope")
    n_q, n_blocks = pl.cdiv(T, cfg.q_rows), pl.cdiv(T, cfg.cache_rows)
    grid = n_q + n_blocks
    topk_n = topk_buf.size if has_topk else 0
    topk_chunk = min(1024, _p2(max(1, pl.cdiv(topk_n, grid)))) if has_topk else 1
    inv_freq = rope.inv_freq(Dr, rope_theta)  # a plain base or YaRN's blend (kernels.rope.YarnRope)

    q_geom = _QGeometry(T=T, Rq=Rq, eps=float(eps), bt=cfg.q_rows)
    c_geom = _CacheGeometry(T=T, R=R, Dr=Dr, Di=Di, tile=tile, nt=nt, mla_fp8=mla_fp8, idx_fp8=idx_fp8,
                            has_index=has_index, mla_rows=mla_logical, mla_bs=mla_bs, mla_pr=mla_pr,
                            idx_rows=idx_logical, idx_bs=idx_bs, idx_pr=idx_pr, rope_il=bool(rope_interleave),
                            index_rope_il=bool(index_rope_interleave), eps=float(eps), bc=cfg.cache_rows,
                            interpret=bool(interpret))
    kernel = functools.partial(_kernel, n_q=n_q, q_geom=q_geom, c_geom=c_geom, has_index=has_index,
                               has_topk=has_topk, topk_n=topk_n, topk_chunk=topk_chunk)

    ins = [q_c, kv_c, positions.astype(jnp.int32), slot_mapping.astype(jnp.int32)]
    if has_index:
        islots = slot_mapping if index_slot_mapping is None else index_slot_mapping
        ins.append(islots.astype(jnp.int32))
    ins += [q_norm_w, kv_norm_w, inv_freq]
    if has_index:
        ins += [index_k, index_norm_w, index_norm_b]
    first_alias = len(ins)
    ins.append(mla_flat)
    outs = [jax.ShapeDtypeStruct((T, Rq), q_c.dtype), jax.ShapeDtypeStruct(mla_flat.shape, mla_flat.dtype)]
    if has_index:
        ins.append(idx_flat)
        outs.append(jax.ShapeDtypeStruct(idx_flat.shape, idx_flat.dtype))
    if has_topk:
        ins.append(topk_buf.reshape(-1))
        outs.append(jax.ShapeDtypeStruct((topk_n,), topk_buf.dtype))
    aliases = {first_alias + i: 1 + i for i in range(len(outs) - 1)}
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    call = pl.pallas_call(
        kernel, grid=(grid,), out_shape=outs,
        in_specs=[any_spec] * len(ins), out_specs=[any_spec] * len(outs),
        input_output_aliases=aliases, interpret=interpret, name="fused_norm_rope_cache",
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    res = call(*ins)
    q_n, mla_out = res[0], res[1].reshape(mla_shape)
    idx_out = res[2].reshape(idx_shape) if has_index else index_cache
    topk_out = res[3].reshape(topk_buf.shape) if has_topk else topk_buf
    return q_n, mla_out, idx_out, topk_out


def supports(q_c, kv_c, positions, slot_mapping, q_norm_w, kv_norm_w, mla_cache, *, index_k=None, **_) -> str | None:
    """Why the kernel cannot take these shapes (None: it can): RoPE partners are found by bit tricks over
    power-of-two column ranges, so the rope dim Dr (kv_c width - kv_lora_rank) must be 2 x a power of two,
    and the indexer key width Di must be at least Dr."""
    R = kv_norm_w.shape[0]
    Dr = kv_c.shape[-1] - R
    if Dr < 2 or Dr % 2 or not _pow2(Dr // 2):
        return f"rope dim {Dr} (kv_c width {kv_c.shape[-1]} - kv_lora_rank {R}) must be 2 x a power of two"
    if index_k is not None and index_k.shape[-1] < Dr:
        return f"indexer key width {index_k.shape[-1]} must be >= the rope dim {Dr}"
    return None
