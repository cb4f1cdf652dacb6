"""Pallas Triton kernel of the FP8 block-scaled linear layer (kernels/fp8_linear/): y = x @ (w_q * s)^T from the
e4m3 bytes of w_q [N, K] (1 byte per weight from HBM), or y = x @ (w_q * s) for a [K, N] weight (`w_layout` "kn":
the model's own layout; the same program with the tile and scale indices swapped).

Grid (row block m, column block n, K split c), m fastest (Pallas Triton launches grid axis 0 as CUDA's x): the
programs in flight share a weight tile, which HBM then serves about once for all row blocks. A program walks its K
range in steps of `bk` columns (bk divides 128, and the steps start on the weight's block boundaries, so one step
lies in one scale block even for a shard starting mid-block): loads the x tile and the e4m3 weight tile [bn, bk],
and
  w8a16: acc += dot(x, w_q.astype(x.dtype)^T) * s_w[:, kb]          (float32 accumulation)
  w8a8:  acc += dot(a_q, w_q^T) (e4m3 x e4m3 -> float32) * s_a[:, kb] * s_w[:, kb]
with s_w gathered per output column ((n_offset + n) // 128; one scalar when the offsets are 0 and bn <= 128).
W8A8 activations are quantised before the kernel by XLA (one fused pass; quantising inside would redo it for
every column block). k_split > 1 writes float32 partials [k_split, T, N] summed by XLA (decode: enough programs
to stream the weight at HBM speed). Rows, columns and K past the operands are masked (ragged 128-blocks, tiny
widths); the unmasked block loads are used where the shapes allow, except that a batch-invariant decode step
masks its rows at every row bucket (one kernel body at all of them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import registry
from ..common.fp8_formats import FP8, WEIGHT_BLOCK, block_count, load_e4m3, quantize_activation_blocks
from ..common.ordered import ordered_sum
from ..common.triton_common import MASKED_ROW, col_range, dot, with_options
from .config import Fp8LinearConfig, cdiv, default_config  # noqa: F401 (default_config: read from here)


def _tile(ref, r0, nr, c0, nc, n_rows, n_cols, mask_rows, mask_cols, interpret, dtype=None):
    """ref[r0:r0 + nr, c0:c0 + nc] of a 2-D ref, zeros at rows outside [0, n_rows) / columns outside [0, n_cols)
    when `mask_rows` / `mask_cols` (static): the plain block load when neither. e4m3 refs: `load_e4m3` (converted
    to `dtype` when given, else the clamped raw values)."""
    if not (mask_rows or mask_cols):
        x = ref[pl.ds(r0, nr), pl.ds(c0, nc)]
        return x if dtype is None else x.astype(dtype)
    rows, cols = col_range(r0, nr), col_range(c0, nc)
    if jnp.dtype(ref.dtype) == FP8:
        return load_e4m3(ref, (), rows, cols, n_rows, n_cols, dtype)
    row_ok = (rows >= 0) & (rows < n_rows) if mask_rows else jnp.ones((nr,), jnp.bool_)
    col_ok = (cols >= 0) & (cols < n_cols) if mask_cols else jnp.ones((nc,), jnp.bool_)
    mask = row_ok[:, None] & col_ok[None, :]
    if interpret:  # the interpreter cannot discharge masked loads: clamp, then zero
        x = ref[jnp.clip(rows, 0, n_rows - 1)[:, None], jnp.clip(cols, 0, n_cols - 1)[None, :]]
        return jnp.where(mask, x, jnp.zeros((), x.dtype))
    return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=mask, other=0)


def _kernel(*refs, form, t, n, k, bm, bn, bk, steps, shift, static_off, n_scalar_scale, mask_m, mask_n, mask_k,
            split, kn, interpret):
    """One (m, n, c) program. `shift`: K columns before the first step's start (static, or None when the K offset
    is traced); `static_off`: (n_offset, k_offset) ints or None (read from the offsets ref); `kn`: the weight and
    its scale grid are [K, N] / [K-blocks, N-blocks] (the model's layout) instead of [N, K] / [N-blocks, K-blocks]."""
    refs = list(refs)
    off_ref = None if static_off is not None else refs.pop(0)
    if form == "w8a8":
        x_ref, sa_ref, w_ref, ws_ref, o_ref = refs
    else:
        (x_ref, w_ref, ws_ref, o_ref), sa_ref = refs, None
    m0 = pl.program_id(0) * bm
    n0 = pl.program_id(1) * bn
    c = pl.program_id(2)
    if static_off is not None:
        n_off, k_off = static_off
        r = shift
    else:
        n_off, k_off = off_ref[0], off_ref[1]
        r = k_off % bk
    nbk, nbn = ws_ref.shape if kn else ws_ref.shape[::-1]
    if n_scalar_scale:
        row_blocks = None
    else:
        row_blocks = jnp.minimum((n_off + col_range(n0, bn)) // WEIGHT_BLOCK, nbn - 1)
    x_dot_dtype = x_ref.dtype

    def body(i, acc):
        s = c * steps + i
        start = s * bk - r  # local K column of the step's first column (negative: before the shard)
        kb = jnp.minimum((k_off - r + s * bk) // WEIGHT_BLOCK, nbk - 1)
        if n_scalar_scale:
            s_w = ws_ref[kb, n0 // WEIGHT_BLOCK] if kn else ws_ref[n0 // WEIGHT_BLOCK, kb]
        else:
            s_w = (ws_ref[kb, row_blocks] if kn else ws_ref[row_blocks, kb])[None, :]

        def weight_tile(dtype=None):  # [bn, bk] of an [N, K] weight, [bk, bn] of a [K, N] one
            if kn:
                return _tile(w_ref, start, bk, n0, bn, k, n, mask_k, mask_n, interpret, dtype=dtype)
            return _tile(w_ref, n0, bn, start, bk, n, k, mask_n, mask_k, interpret, dtype=dtype)

        if form == "w8a8":  # a_q is padded to whole row blocks and aligned steps: plain block loads
            at = x_ref[pl.ds(m0, bm), pl.ds(s * bk, bk)]
            part = dot(at, weight_tile(), trans_b=not kn)  # e4m3 x e4m3 (zeros in a_q cancel K edges), float32
            return acc + part * (sa_ref[pl.ds(m0, bm), kb][:, None] * s_w)
        xt = _tile(x_ref, m0, bm, start, bk, t, k, mask_m, mask_k, interpret)
        return acc + dot(xt, weight_tile(x_dot_dtype), trans_b=not kn) * s_w

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
    y = acc.astype(o_ref.dtype)
    lead = (c,) if split else ()
    if not (mask_m or mask_n):
        o_ref[(*lead, pl.ds(m0, bm), pl.ds(n0, bn))] = y
        return
    rows, cols = col_range(m0, bm), col_range(n0, bn)
    row_ok, col_ok = rows < t, cols < n
    rows = jnp.where(row_ok, rows, MASKED_ROW)  # out of range: the interpreter drops masked rows too
    cols = jnp.where(col_ok, cols, MASKED_ROW)
    plgpu.store(o_ref.at[(*lead, rows[:, None], cols[None, :])], y, mask=row_ok[:, None] & col_ok[None, :])


def fp8_matmul(x, w_q, w_scale, *, form: str = "w8a16", n_offset=0, k_offset=0, w_layout: str = "nk",
               config: Fp8LinearConfig | None = None, interpret: bool = False, **overrides):
    """x.dtype [T, N]: x [T, K] @ W by the Pallas kernel, W = (w_q [N, K] * scales)^T, or w_q [K, N] * scales for
    `w_layout` "kn" (arguments as `fp8_linear.fp8_linear`, already validated there). `config` (default
    `default_config` for the shape); `overrides` replace its fields by name (bm, bn, bk, k_split, num_warps,
    num_stages)."""
    t, k = x.shape
    kn = w_layout == "kn"
    n = w_q.shape[1] if kn else w_q.shape[0]
    k_blocks = w_scale.shape[0] if kn else w_scale.shape[1]
    # the config of `registry.config_rows`: the op's rows, or in a batch-invariant decode step the fixed
    # INVARIANT_CONFIG_ROWS whatever the step's bucket (8 to 256 rows), since the split-K (chosen from the rows) sets
    # the order a row's K partials are summed in, and the tile shape the MMA instruction. At one config a row's K
    # order (steps, splits summed in split order) is the same wherever it sits, whatever the other rows hold and
    # whatever the bucket.
    cfg = config or default_config(registry.config_rows(t), n, k, form, jnp.dtype(x.dtype).itemsize)
    cfg = registry.launch("fp8_linear", with_options(cfg, overrides, "fp8_linear"))
    bm, bn, bk, ks = cfg.bm, cfg.bn, cfg.bk, cfg.k_split
    static = isinstance(n_offset, int) and isinstance(k_offset, int)
    shift = k_offset % bk if static else None
    # steps from the block-aligned start before column 0 up to past column K; a traced offset takes the worst case
    total = cdiv((shift if static else bk - 1) + k, bk)
    steps = cdiv(total, ks)
    mask_k = not (static and shift == 0 and k % bk == 0 and steps * ks == total)
    # a batch-invariant decode step takes the row-masked body at every bucket, also where its rows fill whole row
    # blocks (64 rows and up at the decode kind's 64-row tiles): masked and plain loads and stores are different
    # kernel code, which Triton compiles to different programs that need not round a row alike. With the masks
    # from t alone the buckets of 8 to 32 rows ran one kernel and those from 64 another (on an H100 a request's
    # logprobs parted between the two groups a few decode steps in)
    mask_m = t % bm != 0 or registry.invariant_decode_rows() is not None
    mask_n = n % bn != 0
    n_scalar_scale = static and n_offset == 0 and bn <= WEIGHT_BLOCK
    if static and block_count(k, k_offset) != k_blocks:
        raise ValueError(f"fp8_linear triton: scale grid {tuple(w_scale.shape)} does not cover K {k} from offset "
                         f"{k_offset}")

    inputs = []
    specs = []
    if not static:
        inputs.append(jnp.stack([jnp.asarray(n_offset, jnp.int32), jnp.asarray(k_offset, jnp.int32)]))
        specs.append(pl.BlockSpec((2,), lambda m, j, c: (0,)))
    if form == "w8a8":
        a_q, s_a = quantize_activation_blocks(x, k_offset, k_blocks)
        t_pad, k_pad = cdiv(t, bm) * bm, steps * ks * bk
        if mask_k or t_pad != t:  # rows to whole blocks, columns at their aligned step positions, zeros around
            a_pad = jnp.zeros((t_pad, k_pad), a_q.dtype)
            first = jnp.asarray(shift if static else k_offset % bk, jnp.int32)
            a_q = jax.lax.dynamic_update_slice(a_pad, a_q, (jnp.int32(0), first))
            s_a = jnp.pad(s_a, ((0, t_pad - t), (0, 0)), constant_values=1.0)
        inputs += [a_q, s_a]
    else:
        inputs.append(x)
    inputs += [w_q, w_scale]
    specs += [pl.BlockSpec(memory_space=pl.ANY)] * (len(inputs) - len(specs))
    split = ks > 1
    out_shape = jax.ShapeDtypeStruct((ks, t, n) if split else (t, n), jnp.float32 if split else x.dtype)
    kernel = functools.partial(
        _kernel, form=form, t=t, n=n, k=k, bm=bm, bn=bn, bk=bk, steps=steps, shift=shift,
        static_off=(n_offset, k_offset) if static else None, n_scalar_scale=n_scalar_scale, mask_m=mask_m,
        mask_n=mask_n, mask_k=mask_k, split=split, kn=kn, interpret=interpret)
    y = pl.pallas_call(
        kernel,
        grid=(cdiv(t, bm), cdiv(n, bn), ks),
        in_specs=specs,
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret, name=f"fp8_linear_{form}" + ("_split_k" if split else ""),
    )(*inputs)
    return ordered_sum(y, 0).astype(x.dtype) if split else y  # the splits in split order
