"""Pallas Triton sparse MLA attention (SPEC §5): gathered rows of the paged MLA cache, split-K partials.

Grid (T, H / block_h, n_split). Program (t, hb, s) attends query row t's heads [hb * block_h, +block_h)
over the indices [s * K_s, (s + 1) * K_s) of row t (K_s = K / n_split, padded with -1), gathering
`block_k` cache rows per step straight from the cache (never a slice of it outside the kernel), with an
online softmax in float32. Each program writes a partial (o [block_h, R] normalised, lse [block_h]); an
empty split writes (0, -inf). The partials are combined by `kernels.lse_merge.merge_partials`, the same
function the DCP merge uses.

Two cache formats: bfloat16 rows [kv R | k_pe Dr] and fp8_ds_mla uint8 rows (kernels/fp8_formats.py:
R e4m3 in tiles, one float32 scale per tile, Dr bf16 k_pe), dequantised in registers to bf16.
Everything Triton-specific lives in this module (the Triton backend is deprecated in jax 0.11).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import fp8_formats
from .lse_merge import merge_partials

NUM_SMS = 132  # H200


def gather(ref, rows, cols, valid, interpret):
    """ref[rows[:, None], cols[None, :]] ([len(rows), len(cols)]), zero where not `valid` (rows not read)."""
    shape = (rows.shape[0], cols.shape[0])
    if interpret:  # the interpreter cannot discharge masked gathers
        x = ref[rows[:, None], cols[None, :]]
        return jnp.where(valid[:, None], x, jnp.zeros((), x.dtype))
    return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=jnp.broadcast_to(valid[:, None], shape), other=0)


def dot(a, b, trans_b=False):
    """float32 accumulation; float32 operands exactly (IEEE, not TF32): the tiny test models are float32."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, trans_b=trans_b, precision=precision)


def col_range(start, size, stride=1):
    return start + stride * jax.lax.iota(jnp.int32, size)


def u8_words(b):
    """uint8 [N, 4 n] (little-endian words) -> list of n int32 [N, 1] words."""
    n = b.shape[1] // 4
    x = b.astype(jnp.int32)
    col = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    shifted = x << (8 * (col % 4))
    return [jnp.sum(jnp.where(col // 4 == g, shifted, 0), axis=1, keepdims=True) for g in range(n)]


def u8_pairs_to_bf16(lo, hi):
    bits = (lo.astype(jnp.int32) | (hi.astype(jnp.int32) << 8)).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def _load_rows(cache_ref, slot, valid, r, dr, tile, fp8, interpret):
    """Gathered rows -> (kv parts [bk, R / parts] (1 part for bf16, one per scale tile for fp8), k_pe [bk, Dr])
    in the compute dtype; fp8_ds_mla dequantised to bf16 (Triton lowers no many-way concatenate)."""
    if not fp8:
        return ([gather(cache_ref, slot, col_range(0, r), valid, interpret)],
                gather(cache_ref, slot, col_range(r, dr), valid, interpret))
    n_tiles = r // tile
    scales = u8_words(gather(cache_ref, slot, col_range(r, 4 * n_tiles), valid, interpret))
    parts = []
    for g in range(n_tiles):
        q8 = gather(cache_ref, slot, col_range(g * tile, tile), valid, interpret)  # uint8 [bk, tile]
        x = jax.lax.bitcast_convert_type(q8, jnp.float8_e4m3fn).astype(jnp.float32)
        sc = jax.lax.bitcast_convert_type(scales[g], jnp.float32)
        parts.append((x * sc).astype(jnp.bfloat16))
    pe0 = r + 4 * n_tiles
    pe = u8_pairs_to_bf16(gather(cache_ref, slot, col_range(pe0, dr, 2), valid, interpret),
                          gather(cache_ref, slot, col_range(pe0 + 1, dr, 2), valid, interpret))
    return parts, pe


def _kernel(idx_ref, q_ref, cache_ref, o_ref, lse_ref, *, scale, r, dr, block_k, split_len, fp8, tile,
            interpret):
    block_h = q_ref.shape[0]
    n_parts = r // tile if fp8 else 1
    w = r // n_parts
    q_nope = [q_ref[:, pl.ds(g * w, w)] for g in range(n_parts)]
    q_pe = q_ref[:, pl.ds(r, dr)]

    def body(i, carry):
        o, m, l = carry
        idx = idx_ref[pl.ds(i * block_k, block_k)]
        valid = idx >= 0
        slot = jnp.where(valid, idx, 0)
        kv, pe = _load_rows(cache_ref, slot, valid, r, dr, tile, fp8, interpret)
        s = dot(q_pe, pe, trans_b=True)  # [bh, bk] f32
        for g in range(n_parts):
            s = s + dot(q_nope[g], kv[g], trans_b=True)
        s = jnp.where(valid[None, :], s * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_use)
        p = jnp.exp(s - m_use[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        pb = p.astype(kv[0].dtype)
        o = tuple(o[g] * alpha[:, None] + dot(pb, kv[g]) for g in range(n_parts))
        return o, m_new, l

    o0 = tuple(jnp.zeros((block_h, w), jnp.float32) for _ in range(n_parts))
    m0 = jnp.full((block_h,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((block_h,), jnp.float32)
    o, m, l = jax.lax.fori_loop(0, split_len // block_k, body, (o0, m0, l0))
    has = l > 0
    inv = 1.0 / jnp.where(has, l, 1.0)
    for g in range(n_parts):
        o_ref[:, pl.ds(g * w, w)] = o[g] * inv[:, None]
    lse_ref[...] = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)


def default_config(t: int, h: int, k: int, fp8: bool):
    """(block_h, block_k, n_split, num_warps, num_stages) from the H200 sweep (BENCHMARKS.md): with enough rows,
    64 heads x 64 keys per step, 8 warps, 3 stages, and just enough splits for ~one CTA per SM (each CTA
    holds ~220 KB of shared memory); for a few rows, 32 x 32 tiles and more splits."""
    del fp8
    many = t * max(1, h // 64) >= 32
    block_h = 64 if (many and h % 64 == 0) else (32 if h % 32 == 0 else 16)
    block_k = 64 if many else 32
    n_hb = max(1, h // block_h)
    target = 128 if many else 64
    max_split = max(1, k // block_k)
    n_split = 1
    while t * n_hb * n_split < target and n_split * 2 <= max_split:
        n_split *= 2
    return dict(block_h=block_h, block_k=block_k, n_split=n_split, num_warps=8, num_stages=3 if many else 2)


def sparse_mla_triton(q, cache, indices, *, scale: float, kv_lora_rank: int, block_h: int | None = None,
                      block_k: int | None = None, n_split: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, interpret: bool = False, return_partials: bool = False):
    """o [T, H, R] float32, lse [T, H]. `cache` is bf16 [slots, R + Dr] or fp8_ds_mla uint8 [slots, bytes]."""
    t, h, d = q.shape
    r = kv_lora_rank
    dr = d - r
    fp8 = cache.dtype == jnp.uint8
    if fp8:
        if cache.shape[-1] != fp8_formats.mla_row_bytes(r, dr):
            raise ValueError(f"sparse_mla: fp8_ds_mla row of {cache.shape[-1]} bytes != "
                             f"{fp8_formats.mla_row_bytes(r, dr)} for R={r}, Dr={dr}")
    elif cache.shape[-1] != d:
        raise ValueError(f"sparse_mla: query row width {d} != cache row width {cache.shape[-1]}")
    if indices.shape[0] != t:
        raise ValueError(f"sparse_mla: indices rows {indices.shape[0]} != query rows {t}")
    for name, v in (("kv_lora_rank", r), ("rope dim", dr)):
        if v & (v - 1):
            raise ValueError(f"sparse_mla triton: {name} {v} must be a power of two")
    k = indices.shape[1]
    cfg = default_config(t, h, k, fp8)
    for key, v in (("block_h", block_h), ("block_k", block_k), ("n_split", n_split), ("num_warps", num_warps),
                   ("num_stages", num_stages)):
        if v is not None:
            cfg[key] = v
    bh = cfg["block_h"]
    h_pad = max(16, -(-h // bh) * bh)
    bh = min(bh, h_pad)
    if h_pad != h:
        q = jnp.pad(q, ((0, 0), (0, h_pad - h), (0, 0)))
    bk, ns = cfg["block_k"], cfg["n_split"]
    split_len = -(-k // (ns * bk)) * bk
    k_pad = split_len * ns
    indices = indices.astype(jnp.int32)
    if k_pad != k:
        indices = jnp.pad(indices, ((0, 0), (0, k_pad - k)), constant_values=-1)
    compute = jnp.bfloat16 if fp8 else cache.dtype
    q = q.astype(compute)
    tile = fp8_formats.mla_tile(r)

    kernel = functools.partial(_kernel, scale=float(scale), r=r, dr=dr, block_k=bk, split_len=split_len,
                               fp8=fp8, tile=tile, interpret=interpret)
    n_hb = h_pad // bh
    o, lse = pl.pallas_call(
        kernel,
        grid=(t, n_hb, ns),
        in_specs=[
            pl.BlockSpec((None, split_len), lambda i, j, s: (i, s)),
            pl.BlockSpec((None, bh, d), lambda i, j, s: (i, j, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=[
            pl.BlockSpec((None, None, bh, r), lambda i, j, s: (s, i, j, 0)),
            pl.BlockSpec((None, None, bh), lambda i, j, s: (s, i, j)),
        ],
        out_shape=[jax.ShapeDtypeStruct((ns, t, h_pad, r), jnp.float32),
                   jax.ShapeDtypeStruct((ns, t, h_pad), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret,
        name="sparse_mla_fp8" if fp8 else "sparse_mla_bf16",
    )(indices, q, cache)
    if return_partials:
        return o[:, :, :h], lse[:, :, :h]
    if ns == 1:
        o, lse = o[0], lse[0]
    else:
        o, lse = merge_partials(o, lse, axis=0)
    return o[:, :h], lse[:, :h]


def lower_for_gpu(fn, *args, compute_capability: int = 90):
    """Lower `fn(*args)` (args may be ShapeDtypeStructs) to StableHLO for CUDA on a machine with no GPU:
    runs the Pallas -> Triton IR lowering of every kernel inside (not Triton's own compiler). A check for
    CPU CI that the kernels lower at production shapes. Returns the lowered text."""
    import types
    from unittest import mock

    from jax._src.pallas.triton import pallas_call_registration as reg

    info = types.SimpleNamespace(compute_capability=compute_capability)
    with mock.patch.object(reg.gpu_info_lib, "get_gpu_info", lambda *a, **k: info):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
