"""Pallas Triton sparse MLA attention (docs/math.md §5): gathered rows of the paged MLA cache, split-K partials.

Grid (T, H / block_h, n_split). Program (t, hb, s) attends query row t's heads [hb * block_h, +block_h)
over the indices [s * K_s, (s + 1) * K_s) of row t (K_s = K / n_split, padded with -1), gathering
`block_k` cache rows per step straight from the cache (never a slice of it outside the kernel), with an
online softmax in float32. Each program writes a partial (o [block_h, R] normalised, lse [block_h]); an
empty split writes (0, -inf). The partials are combined in a second launch by `kernels.lse_merge.triton` (one
Pallas Triton kernel, config `merge="launch"`, the default) or by `kernels.lse_merge.merge_partials` (XLA, the
function the DCP merge uses, `merge="xla"`), or (`merge="kernel"`, for few rows) inside the same
launch: each program stores its partial to a workspace, passes a CTA barrier, and counts itself in with an
acq_rel gpu-scope atomic add on a per-(row, head block) counter; the program that sees n_split - 1 merges
(`_merged_kernel`, `_merged_call`).

Two cache formats: bfloat16 rows [kv R | k_pe Dr] and fp8_ds_mla uint8 rows (kernels/common/fp8_formats.py:
R e4m3 in tiles, one float32 scale per tile, Dr bf16 k_pe), dequantised in registers to bf16: e4m3 -> f32,
x the tile's f32 scale, one rounding to bf16 (exact dequantisation). With 64-head blocks the latent is
gathered as one contiguous [block_k, R] byte tile and scaled as [block_k, tiles, tile] * scale[:, :, None]
(the same loop body as bf16); with smaller head blocks (few rows) as one part per scale tile. The scales and
k_pe are gathered as contiguous byte runs and reassembled with reshapes and 2-way splits: strided byte
gathers cannot become async copies, so they stalled every step.
The scales multiply the [block_k, R] tile, not the [block_h, block_k] score and output matrices: ALU work is not
what limits this kernel, and per-tile scale vectors in the MMA layout add register spills (BENCHMARKS.md).
Launch configs are `SparseMLAConfig`s (`default_config` picks one per shape).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import registry
from ..common import fp8_formats
from ..lse_merge import merge_partials, merge_splits
from ..common.triton_common import (check_addressable, col_range, dot, gather, is_pow2, u8_to_bf16, u8_to_f32, u8_words,
                            with_options)
from .config import SparseMLAConfig, default_config, one_launch_config  # noqa: F401 (read from here)


def _load_rows(cache_ref, slot, valid, r, dr, tile, fp8, n_parts, interpret):
    """Gathered rows -> (kv parts: n_parts x [bk, R / n_parts], k_pe [bk, Dr]) in the compute dtype, rows not
    `valid` read as zeros. fp8_ds_mla is dequantised exactly (e4m3 -> f32, x its tile's f32 scale) and rounded
    once to bf16, either as one [bk, R] tile (n_parts = 1) or one part per scale tile (n_parts = R / tile)."""
    if not fp8:
        return ([gather(cache_ref, slot, col_range(0, r), valid, interpret)],
                gather(cache_ref, slot, col_range(r, dr), valid, interpret))
    bk, n_tiles = slot.shape[0], r // tile
    scale_bytes = gather(cache_ref, slot, col_range(r, 4 * n_tiles), valid, interpret)  # uint8 [bk, 4 tiles]
    if n_parts == 1:
        scales = u8_to_f32(scale_bytes)  # [bk, tiles]
        q8 = gather(cache_ref, slot, col_range(0, r), valid, interpret)  # uint8 [bk, R], one contiguous run
        x = fp8_formats.decode_e4m3_bits(q8, jnp.float32).reshape(bk, n_tiles, tile)
        parts = [(x * scales[:, :, None]).reshape(bk, r).astype(jnp.bfloat16)]
    else:
        parts = []
        for g, word in enumerate(u8_words(scale_bytes)):
            q8 = gather(cache_ref, slot, col_range(g * tile, tile), valid, interpret)  # uint8 [bk, tile]
            x = fp8_formats.decode_e4m3_bits(q8, jnp.float32)
            parts.append((x * jax.lax.bitcast_convert_type(word, jnp.float32)).astype(jnp.bfloat16))
    pe = u8_to_bf16(gather(cache_ref, slot, col_range(r + 4 * n_tiles, 2 * dr), valid, interpret))
    return parts, pe


def _key_slots(idx_ref, i, block_k):
    """Key block i of the row's indices: (valid [bk], slot [bk] with -1 replaced by a readable 0)."""
    idx = idx_ref[pl.ds(i * block_k, block_k)]
    return idx >= 0, jnp.maximum(idx, 0)


def _softmax_init(block_h):
    """(m, l) before any key: running max -inf, running sum 0."""
    return jnp.full((block_h,), -jnp.inf, jnp.float32), jnp.zeros((block_h,), jnp.float32)


def _softmax_step(s, valid, scale, m, l):
    """One key block of the online softmax: scores s [bh, bk] (invalid keys masked to -inf) -> (p, alpha, m, l),
    with alpha rescaling the accumulators; a row with no valid key yet keeps m = -inf and gets p = 0."""
    s = jnp.where(valid[None, :], s * scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_use)
    p = jnp.exp(s - m_use[:, None])
    return p, alpha, m_new, l * alpha + jnp.sum(p, axis=1)


def _softmax_finish(m, l):
    """(1 / l, lse): a row with no valid key gets (1, -inf), so its o stays 0 — the merge identity (0, -inf)."""
    has = l > 0
    return 1.0 / jnp.where(has, l, 1.0), jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)


def _attend(idx_ref, q_ref, cache_ref, *, scale, r, dr, block_k, split_len, fp8, tile, n_parts, interpret):
    """This program's split: (o parts n_parts x [bh, R / n_parts] normalised, lse [bh]), (0, -inf) if empty."""
    block_h = q_ref.shape[0]
    w = r // n_parts
    q_nope = [q_ref[:, pl.ds(g * w, w)] for g in range(n_parts)]
    q_pe = q_ref[:, pl.ds(r, dr)]

    def body(i, carry):
        o, m, l = carry
        valid, slot = _key_slots(idx_ref, i, block_k)
        kv, pe = _load_rows(cache_ref, slot, valid, r, dr, tile, fp8, n_parts, interpret)
        s = dot(q_pe, pe, trans_b=True)  # [bh, bk] f32
        for g in range(n_parts):
            s = s + dot(q_nope[g], kv[g], trans_b=True)
        p, alpha, m_new, l = _softmax_step(s, valid, scale, m, l)
        pb = p.astype(kv[0].dtype)
        o = tuple(o[g] * alpha[:, None] + dot(pb, kv[g]) for g in range(n_parts))
        return o, m_new, l

    o0 = tuple(jnp.zeros((block_h, w), jnp.float32) for _ in range(n_parts))
    o, m, l = jax.lax.fori_loop(0, split_len // block_k, body, (o0, *_softmax_init(block_h)))
    inv, lse = _softmax_finish(m, l)
    return [og * inv[:, None] for og in o], lse


def _kernel(idx_ref, q_ref, cache_ref, o_ref, lse_ref, **kw):
    o, lse = _attend(idx_ref, q_ref, cache_ref, **kw)
    w = o_ref.shape[-1] // len(o)
    lse_ref[...] = lse
    for g, og in enumerate(o):
        o_ref[:, pl.ds(g * w, w)] = og


def _merged_kernel(idx_ref, q_ref, cache_ref, _count_in_ref, o_ref, lse_ref, part_o_ref, part_lse_ref, count_ref,
                   *, n_split, merge_cols, **kw):
    """One split of one (row, head block), then the merge by its last program (see `_merged_call`)."""
    o, lse = _attend(idx_ref, q_ref, cache_ref, **kw)
    interpret = kw["interpret"]
    bh, r = o_ref.shape
    w = r // len(o)
    t, hb, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads = pl.ds(hb * bh, bh)
    part_lse_ref[s, t, heads] = lse
    for g, og in enumerate(o):
        part_o_ref[s, t, heads, pl.ds(g * w, w)] = og.astype(part_o_ref.dtype)
    # release: every thread's partial stores happen before thread 0's acq_rel (gpu scope) increment below
    # (bar.sync, then the releasing atomic: the CUTLASS semaphore pattern)
    if not interpret:
        plgpu.debug_barrier()
    arrived = plgpu.atomic_add(count_ref, (t, hb), jnp.int32(1))  # old count; acq_rel, gpu scope

    @pl.when(arrived == n_split - 1)
    def _merge():
        # acquire: the increment that saw n_split - 1 read-from every other program's release, and its acquire
        # at gpu scope drops this SM's L1 lines, so the plain loads below see every partial; the bar.sync
        # orders every thread's loads after thread 0's acquire (Triton broadcasts a scalar atomic's result
        # through shared memory behind a barrier too; this one does not depend on that). Pallas' ".cg" load
        # modifier cannot be used: jax 0.11.2's lowering looks it up under the wrong key.
        # Same math as lse_merge.merge_partials.
        if not interpret:
            plgpu.debug_barrier()
        lse_all = part_lse_ref[:, t, heads]  # [n_split, bh]
        lse_all = jnp.where(jnp.isnan(lse_all) | (lse_all == jnp.inf), -jnp.inf, lse_all)
        m = jnp.max(lse_all, axis=0)
        m = jnp.where(m == -jnp.inf, 0.0, m)
        wgt = jnp.exp(lse_all - m[None, :])  # exp(-inf) = 0 for empty splits
        total = jnp.sum(wgt, axis=0)
        has = total > 0
        lse_ref[...] = jnp.where(has, m + jnp.log(jnp.where(has, total, 1.0)), -jnp.inf)
        wgt = jnp.where(has[None, :], wgt / jnp.where(has, total, 1.0)[None, :], 0.0)
        for c in range(r // merge_cols):
            cols = pl.ds(c * merge_cols, merge_cols)
            part = part_o_ref[:, t, heads, cols].astype(jnp.float32)  # [n_split, bh, cols]
            o_ref[:, cols] = jnp.sum(jnp.where(wgt[:, :, None] > 0, wgt[:, :, None] * part, 0.0), axis=0)
        count_ref[t, hb] = jnp.int32(0)  # back to zero: a counter buffer kept across calls stays valid


def merge_cols(n_split: int, block_h: int, r: int, budget: int = 16384) -> int:
    """Latent columns per step of the in-kernel merge: its [n_split, block_h, cols] float32 tile stays within
    `budget` elements (64 registers a thread at 8 warps), so every partial's load is in flight at once."""
    cols = r
    while cols > 16 and n_split * block_h * cols > budget:
        cols //= 2
    return cols


def supports(q, cache, indices, *, kv_lora_rank: int, **_) -> str | None:
    """Why the kernel cannot take these shapes (None: it can). Its tiles are powers of two: the latent R and the
    rope dim Dr must be powers of two."""
    r = kv_lora_rank
    dr = q.shape[-1] - r
    for name, v in (("kv_lora_rank", r), ("rope dim (q width - kv_lora_rank)", dr)):
        if not is_pow2(v):
            return f"{name} {v} must be a power of two"
    return None


def sparse_mla_triton(q, cache, indices, *, scale: float, kv_lora_rank: int, config: SparseMLAConfig | None = None,
                      interpret: bool = False, return_partials: bool = False, **overrides):
    """o [T, H, R] float32, lse [T, H]. `cache` is bf16 [slots, R + Dr] or fp8_ds_mla uint8 [slots, bytes].
    `config` (default `default_config` for the shape); `overrides` replace fields of it by name (block_h,
    block_k, n_split, num_warps, num_stages; None keeps the field). `interpret`: run under the Pallas
    interpreter. `return_partials`: the per-split (o, lse) [n_split, T, H, ...] instead of their merge."""
    t, h, d = q.shape
    r = kv_lora_rank
    dr = d - r
    fp8 = cache.dtype == jnp.uint8
    if not interpret:
        check_addressable(cache, "sparse_mla cache")
    if fp8:
        if cache.shape[-1] != fp8_formats.mla_row_bytes(r, dr):
            raise ValueError(f"sparse_mla: fp8_ds_mla row of {cache.shape[-1]} bytes != "
                             f"{fp8_formats.mla_row_bytes(r, dr)} for R={r}, Dr={dr}")
    elif cache.shape[-1] != d:
        raise ValueError(f"sparse_mla: query row width {d} != cache row width {cache.shape[-1]}")
    if indices.shape[0] != t:
        raise ValueError(f"sparse_mla: indices rows {indices.shape[0]} != query rows {t}")
    why = supports(q, cache, indices, kv_lora_rank=r)
    if why:
        raise ValueError(f"sparse_mla triton: {why}")
    k = indices.shape[1]
    cfg = config or default_config(registry.config_rows(t), h, k, fp8, jnp.dtype(cache.dtype).itemsize)
    # an option given as None keeps the config's value
    cfg = registry.launch("sparse_mla", with_options(cfg, {k: v for k, v in overrides.items() if v is not None},
                                                     "sparse_mla"))
    bh = cfg.block_h
    h_pad = max(16, -(-h // bh) * bh)
    bh = min(bh, h_pad)
    if h_pad != h:
        q = jnp.pad(q, ((0, 0), (0, h_pad - h), (0, 0)))
    bk, ns = cfg.block_k, cfg.n_split
    split_len = -(-k // (ns * bk)) * bk
    k_pad = split_len * ns
    indices = indices.astype(jnp.int32)
    if k_pad != k:
        indices = jnp.pad(indices, ((0, 0), (0, k_pad - k)), constant_values=-1)
    compute = jnp.bfloat16 if fp8 else cache.dtype
    q = q.astype(compute)
    tile = fp8_formats.mla_tile(r)

    # fp8: one [bk, R] kv tile with 64-head blocks (measured faster at B = 32, 128), one part per scale tile
    # with smaller head blocks (the few-row configs: measured faster at B = 1)
    n_parts = r // tile if fp8 and bh < 64 else 1
    common = dict(scale=float(scale), r=r, dr=dr, block_k=bk, split_len=split_len, fp8=fp8, tile=tile,
                  n_parts=n_parts, interpret=interpret)
    n_hb = h_pad // bh
    part_dtype = jnp.dtype(cfg.partial_dtype) if ns > 1 else jnp.float32
    name = "sparse_mla_fp8" if fp8 else "sparse_mla_bf16"
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    in_specs = [
        pl.BlockSpec((None, split_len), lambda i, j, s: (i, s)),
        pl.BlockSpec((None, bh, d), lambda i, j, s: (i, j, 0)),
        pl.BlockSpec(memory_space=pl.ANY),
    ]
    if cfg.merge == "kernel" and ns > 1 and not return_partials:
        o, lse = _merged_call(indices, q, cache, common, in_specs, params, name + "_merged", t, n_hb, ns, bh,
                              h_pad, r, part_dtype)
        return o[:, :h], lse[:, :h]
    o, lse = pl.pallas_call(
        functools.partial(_kernel, **common),
        grid=(t, n_hb, ns),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, bh, r), lambda i, j, s: (s, i, j, 0)),
            pl.BlockSpec((None, None, bh), lambda i, j, s: (s, i, j)),
        ],
        out_shape=[jax.ShapeDtypeStruct((ns, t, h_pad, r), part_dtype),
                   jax.ShapeDtypeStruct((ns, t, h_pad), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name=name,
    )(indices, q, cache)
    if return_partials:
        return o[:, :, :h], lse[:, :, :h]
    if ns == 1:
        o, lse = o[0], lse[0]
    elif cfg.merge == "launch":
        o, lse = merge_splits(o, lse, impl="triton_interpret" if interpret else "triton")
    else:
        o, lse = merge_partials(o, lse, axis=0)
    return o[:, :h], lse[:, :h]


def _merged_call(indices, q, cache, common, in_specs, params, name, t, n_hb, ns, bh, h_pad, r, part_dtype):
    """The one-launch split-K: grid (T, head blocks, n_split) as in the two-launch form, plus a workspace of
    partials [n_split, T, H, R] / [n_split, T, H] and an int32 arrival counter per (row, head block).

    The counters are a fresh zeros array aliased to an output (XLA fills it with a memset, not a kernel): the
    jax op is functional, so there is no buffer that outlives a call for the merging program to leave at zero
    (it resets its counter anyway, so a caller that one day threads a persistent donated counter array can
    drop the fill). The workspace is an uninitialised output: every cell is written by its program before that
    program's release, and read only by the merger after its acquire."""
    counts = jnp.zeros((t, n_hb), jnp.int32)
    kernel = functools.partial(_merged_kernel, n_split=ns, merge_cols=merge_cols(ns, bh, r), **common)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    o, lse, _, _, _ = pl.pallas_call(
        kernel,
        grid=(t, n_hb, ns),
        in_specs=[*in_specs, any_spec],
        out_specs=[
            pl.BlockSpec((None, bh, r), lambda i, j, s: (i, j, 0)),
            pl.BlockSpec((None, bh), lambda i, j, s: (i, j)),
            any_spec, any_spec, any_spec,
        ],
        out_shape=[jax.ShapeDtypeStruct((t, h_pad, r), jnp.float32),
                   jax.ShapeDtypeStruct((t, h_pad), jnp.float32),
                   jax.ShapeDtypeStruct((ns, t, h_pad, r), part_dtype),
                   jax.ShapeDtypeStruct((ns, t, h_pad), jnp.float32),
                   jax.ShapeDtypeStruct((t, n_hb), jnp.int32)],
        input_output_aliases={3: 4},
        compiler_params=params,
        interpret=common["interpret"],
        name=name,
    )(indices, q, cache, counts)
    return o, lse
