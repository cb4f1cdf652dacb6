"""Pallas Triton grouped GEMMs for the routed experts (kernels/moe/), over the tile layout of `moe.tile_plan`.

Two kernels, each on a grid (column block, tile) whose tile index runs fastest, so the programs in flight share
a column block and consecutive tiles of one expert find its weight block in L2:
  up:   h[tile rows, n-block] = silu(x[tokens] @ gate_e) * (x[tokens] @ up_e), the x rows gathered by token;
  down: y[pair, d-block] = w_pair * (h[tile rows] @ down_e), stored at each row's (token, j) pair index.
Empty tiles (first row -1) do no work, so a decode step reads only the weights of the experts it uses.
The combine y[T, k, D] summed over k is one XLA pass outside (`ordered_sum`: the pairs in routing order). A pair
whose expert id is outside [0, n_exp) (a padding row's) is in no tile (`tile_plan`), so neither kernel computes it, and
the combine takes 0 for it. Widths that are not a multiple of the blocks (a tiny model's expert slice under TP: I =
4..8) take 16-wide blocks whose columns past the width are masked: loads read zeros there (so those h columns are
exactly 0) and stores skip them. Launch configs are `MoEConfig`s (`default_config` picks one per shape). FP8 experts
(W8A16): the same kernels read e4m3 blocks, convert them to x.dtype in registers (exact) and scale each K step's float32
partial by its 128-block's scale (K steps of at most 128 stay in one block; a width slice starting mid-block shifts the
down kernel's steps onto the block boundaries). The bf16 kernels are traced unchanged when no scales are given.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import registry
from ..common import fp8_formats
from ..common.fp8_formats import FP8, WEIGHT_BLOCK as FP8_BLOCK, load_e4m3, quantize_activation_blocks
from ..common.ordered import ordered_sum
from ..common.triton_common import MASKED_ROW, col_range, div_rn, dot, gather, with_options
from .tiles import routed_pairs, tile_plan
from .config import MoEConfig, block_width, default_config, word_form  # noqa: F401 (read from here)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _weight_block(ref, e, r0, nr, c0, nc, n_rows, n_cols, interpret):
    """ref[e, r0:r0 + nr, c0:c0 + nc] of a weight [E, n_rows, n_cols], zeros past its rows or columns. Widths
    that the blocks divide take the plain block load (no mask)."""
    if n_rows % nr == 0 and n_cols % nc == 0:
        return ref[e, pl.ds(r0, nr), pl.ds(c0, nc)]
    rows, cols = col_range(r0, nr), col_range(c0, nc)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    if interpret:  # the interpreter cannot discharge masked loads: clamp, then zero
        x = ref[e, jnp.minimum(rows, n_rows - 1)[:, None], jnp.minimum(cols, n_cols - 1)[None, :]]
        return jnp.where(mask, x, jnp.zeros((), x.dtype))
    return plgpu.load(ref.at[e, rows[:, None], cols[None, :]], mask=mask, other=0)


def _gate_up(src_ref, te_ref, x_ref, wg_ref, wu_ref, *, tile, n0, bn, k0, steps, k, bk, interpret, fp8=None):
    """float32 (x @ gate_e, x @ up_e) [tile, bn] of columns [n0, n0 + bn) over hidden columns
    [k0, k0 + steps * bk), the x rows gathered by the tile's tokens (padding rows, and columns past the
    widths, read as zeros). Program ids are read by the caller, outside its `pl.when` (the interpreter cannot
    evaluate them inside). `fp8`: None (weights in x's dtype), or the `_Fp8Scales` of e4m3 weights: each step's
    e4m3 blocks become x.dtype in registers and the step's partials are scaled by their 128-block's scales."""
    src = src_ref[...]
    e = te_ref[0]
    valid = src >= 0
    token = jnp.where(valid, src // k, 0)
    d, i = wg_ref.shape[1], wg_ref.shape[2]

    def body(s, acc):
        c0 = k0 + s * bk
        cols = col_range(c0, bk)
        if fp8 is not None and fp8.act:  # e4m3 rows: no masked load (Triton cannot fill one), whole blocks
            return _gate_up_step_w8a8(acc, fp8, x_ref, token, cols, wg_ref, wu_ref, e, c0, bk, n0, bn,
                                      c0 // FP8_BLOCK)
        if d % bk:  # hidden columns past D: zeros (their weight rows are zeros too)
            xt = gather(x_ref, token, jnp.minimum(cols, d - 1), valid, interpret)
            xt = jnp.where((cols < d)[None, :], xt, jnp.zeros((), xt.dtype))
        else:
            xt = gather(x_ref, token, cols, valid, interpret)  # [tile, bk]
        if fp8 is None:
            return (acc[0] + dot(xt, _weight_block(wg_ref, e, c0, bk, n0, bn, d, i, interpret)),
                    acc[1] + dot(xt, _weight_block(wu_ref, e, c0, bk, n0, bn, d, i, interpret)))
        kb = c0 // FP8_BLOCK  # bk divides 128: the step lies in one hidden-axis block
        if fp8.packed:  # even and odd output columns from the two bytes of each word, accumulated apart
            h = bn // 2
            parts = []
            for w_ref, s_ref, a_even, a_odd in ((wg_ref, fp8.refs[0], acc[0], acc[1]),
                                                (wu_ref, fp8.refs[1], acc[2], acc[3])):
                w_even, w_odd = _pair_block(w_ref, e, c0, bk, n0 // 2, h, xt.dtype)
                parts += [a_even + dot(xt, w_even) * fp8.out_scales(s_ref, e, kb, n0, h, 2),
                          a_odd + dot(xt, w_odd) * fp8.out_scales(s_ref, e, kb, n0 + 1, h, 2)]
            return tuple(parts)
        wg = _weight_block_fp8(wg_ref, e, c0, bk, n0, bn, d, i, xt.dtype)  # e4m3 -> x.dtype: exact
        wu = _weight_block_fp8(wu_ref, e, c0, bk, n0, bn, d, i, xt.dtype)
        return (acc[0] + dot(xt, wg) * fp8.out_scales(fp8.refs[0], e, kb, n0, bn),
                acc[1] + dot(xt, wu) * fp8.out_scales(fp8.refs[1], e, kb, n0, bn))

    if fp8 is not None and fp8.split_out:
        z = jnp.zeros((tile, bn // 2), jnp.float32)
        return jax.lax.fori_loop(0, steps, body, (z, z, z, z))
    z = jnp.zeros((bn, tile) if fp8 is not None and fp8.swap else (tile, bn), jnp.float32)
    return jax.lax.fori_loop(0, steps, body, (z, z))


def _gate_up_step_w8a8(acc, fp8, x_ref, token, cols, wg_ref, wu_ref, e, c0, bk, n0, bn, kb):
    """One hidden step of the W8A8 up projection: e4m3 rows x e4m3 weights on the fp8 tensor cores (float32
    partials), each partial scaled by its row's activation scale and the weight block's scale. Widths are whole
    128-blocks (checked by the caller), so every load is a plain one."""
    sa = fp8.refs[2][kb, token][:, None]  # [tile, 1]
    xq = x_ref[token[:, None], cols[None, :]]  # [tile, bk] e4m3; padding rows read row 0 and are never stored
    if fp8.packed and not fp8.nk:
        h = bn // 2
        parts = []
        for w_ref, s_ref, a_even, a_odd in ((wg_ref, fp8.refs[0], acc[0], acc[1]),
                                            (wu_ref, fp8.refs[1], acc[2], acc[3])):
            w_even, w_odd = _pair_block(w_ref, e, c0, bk, n0 // 2, h, None)
            parts += [a_even + dot(xq, w_even) * (sa * fp8.out_scales(s_ref, e, kb, n0, h, 2)),
                      a_odd + dot(xq, w_odd) * (sa * fp8.out_scales(s_ref, e, kb, n0 + 1, h, 2))]
        return tuple(parts)
    if fp8.nk and fp8.packed:  # K-major words of two K values: back into K order in registers
        wg, wu = (_kmajor_words(w_ref, e, n0, bn, c0 // 2, bk // 2) for w_ref in (wg_ref, wu_ref))
    elif fp8.nk:  # K-major stacks [E, I, D]: the [bn, bk] tile is the fp8 MMA's native B operand
        wg, wu = (w_ref[e, pl.ds(n0, bn), pl.ds(c0, bk)] for w_ref in (wg_ref, wu_ref))
    else:
        wg, wu = (w_ref[e, pl.ds(c0, bk), pl.ds(n0, bn)] for w_ref in (wg_ref, wu_ref))
    sg, su = (fp8.out_scales(ref, e, kb, n0, bn) for ref in fp8.refs[:2])
    if fp8.swap:  # [bn, tile] = w [bn, bk] . x^T: the weight columns fill the MMA's M (see MoEConfig.swap_ab)
        sa, sg, su = sa.T, _transposed(sg), _transposed(su)
        return (acc[0] + dot(wg, xq, trans_b=True) * (sa * sg), acc[1] + dot(wu, xq, trans_b=True) * (sa * su))
    return (acc[0] + dot(xq, wg, trans_b=fp8.nk) * (sa * sg), acc[1] + dot(xq, wu, trans_b=fp8.nk) * (sa * su))


@dataclasses.dataclass(frozen=True)
class _Fp8Scales:
    """In-kernel view of the FP8 experts' block scales: `refs` (the scale grids the kernel reads, weights' grids
    first, then W8A8's activation scales), `i_off` (the expert-width slice's offset inside its first block: an
    int, or a traced scalar read from the offsets ref). A weight grid is [E, K-blocks, N-blocks] for [E, K, N]
    stacks (gate/up [E, D-blocks, I-blocks], down [E, I-blocks, D-blocks]) and [E, N-blocks, K-blocks] for
    K-major ones (`nk`: the stored orientation, gate/up [E, I-blocks, D-blocks], down [E, D-blocks, I-blocks]);
    `weight_scale` and `k_blocks` read either by (K block, N blocks)."""
    refs: tuple
    i_off: object
    scalar: bool  # one scale per step and column block (offset 0 and blocks within one 128-block)
    packed: bool = False  # weights as uint16 words of two e4m3 values (`_pair_block`, `_kmajor_words`): 2-4 GB arrays
    act: bool = False  # W8A8: the rows (x, h) are e4m3 too, their per-row 128-block scales the last ref [blocks, rows]
    nk: bool = False  # K-major weight stacks (gate/up [E, I, D], down [E, D, I]: the release's [out, in]); W8A8 only
    swap: bool = False  # MoEConfig.swap_ab: accumulators [columns, tile rows] (K-major W8A8 only)

    @property
    def split_out(self) -> bool:
        """Words of two output columns ([E, K, N] stacks as words): even and odd columns accumulate apart. K-major
        words pair two K values instead, interleaved back into K order in registers (`_kmajor_words`)."""
        return self.packed and not self.nk

    def weight_scale(self, ref, e, kb, nb):
        """The scale(s) of weight grid `ref` at K block `kb` (a scalar) and N block(s) `nb` (a scalar or a vector),
        in either orientation."""
        return ref[e, nb, kb] if self.nk else ref[e, kb, nb]

    def k_blocks(self, ref) -> int:
        """The K-block extent of weight grid `ref`."""
        return ref.shape[2 if self.nk else 1]

    def n_blocks(self, ref) -> int:
        """The N-block extent of weight grid `ref`."""
        return ref.shape[1 if self.nk else 2]

    def out_scales(self, ref, e, kb, n0, bn, stride: int = 1):
        """Scales of gate/up output columns n0, n0 + stride, ... (bn of them; the expert width) at hidden block
        kb: [1, bn] or a scalar."""
        if self.scalar:
            return self.weight_scale(ref, e, kb, n0 // FP8_BLOCK)
        blocks = jnp.minimum((self.i_off + col_range(n0, bn, stride)) // FP8_BLOCK, self.n_blocks(ref) - 1)
        return self.weight_scale(ref, e, kb, blocks)[None, :]


def _up_kernel(src_ref, te_ref, x_ref, wg_ref, wu_ref, h_ref, hs_ref=None, *, k, bk, steps, interpret, fp8=None,
               h_dtype=None):
    """h rows of one tile and column block. With `hs_ref` (W8A8, 128-wide column blocks: MoEConfig.quant_h), h is
    quantised here for the down kernel: rounded to `h_dtype` (the rows' dtype, as the unfused path stores it), then
    e4m3 per row over the block's 128 columns with its float32 scale in hs_ref [1, tile], the rule of
    `fp8_formats.quantize_activation_blocks` bit for bit (IEEE divisions), which saves the four XLA passes over h
    between the kernels."""
    tile, bn = h_ref.shape
    n0 = pl.program_id(0) * bn

    @pl.when(src_ref[0] >= 0)
    def _():
        acc = _gate_up(src_ref, te_ref, x_ref, wg_ref, wu_ref, tile=tile, n0=n0, bn=bn, k0=0,
                       steps=steps, k=k, bk=bk, interpret=interpret, fp8=fp8)
        if fp8 is not None and fp8.split_out:  # even columns, then odd ones
            g_even, g_odd, u_even, u_odd = acc
            h_ref[:, pl.ds(0, bn // 2, stride=2)] = (jax.nn.silu(g_even) * u_even).astype(h_ref.dtype)
            h_ref[:, pl.ds(1, bn // 2, stride=2)] = (jax.nn.silu(g_odd) * u_odd).astype(h_ref.dtype)
        else:
            g, u = acc
            h = jax.nn.silu(g) * u
            if fp8 is not None and fp8.swap:
                h = h.T
            if hs_ref is None:
                h_ref[...] = h.astype(h_ref.dtype)
            else:
                hb = h.astype(h_dtype).astype(jnp.float32)
                div = functools.partial(div_rn, interpret=interpret)
                scale = fp8_formats.mla_tile_scale(jnp.max(jnp.abs(hb), axis=1), div=div)  # [tile]
                h_ref[...] = fp8_formats.to_e4m3(div(hb, scale[:, None]))
                hs_ref[...] = scale[None, :]


def _up_partial_kernel(src_ref, te_ref, x_ref, wg_ref, wu_ref, g_ref, u_ref, *, k, bk, steps, interpret, fp8=None):
    """Split-K form of the up kernel (few tiles: decode at small batch): program (n, m, c) sums `steps` hidden
    blocks from c * steps * bk into float32 partials of gate and up; SwiGLU after the sum, outside."""
    tile, bn = g_ref.shape
    n0 = pl.program_id(0) * bn
    k0 = pl.program_id(2) * steps * bk

    @pl.when(src_ref[0] >= 0)
    def _():
        acc = _gate_up(src_ref, te_ref, x_ref, wg_ref, wu_ref, tile=tile, n0=n0, bn=bn, k0=k0,
                       steps=steps, k=k, bk=bk, interpret=interpret, fp8=fp8)
        if fp8 is not None and fp8.split_out:
            half = bn // 2
            g_ref[:, pl.ds(0, half, stride=2)], g_ref[:, pl.ds(1, half, stride=2)] = acc[0], acc[1]
            u_ref[:, pl.ds(0, half, stride=2)], u_ref[:, pl.ds(1, half, stride=2)] = acc[2], acc[3]
        elif fp8 is not None and fp8.swap:
            g_ref[...], u_ref[...] = acc[0].T, acc[1].T
        else:
            g_ref[...], u_ref[...] = acc

    @pl.when(src_ref[0] < 0)
    def _():  # defined values for the rows of empty tiles, which the sum outside reads
        g_ref[...] = jnp.zeros((tile, bn), jnp.float32)
        u_ref[...] = jnp.zeros((tile, bn), jnp.float32)


def _down_kernel(src_ref, te_ref, w_ref, h_ref, wd_ref, y_ref, *, bn, bk, steps, interpret, fp8=None, shift=0):
    """y rows of one tile and column block. `fp8`: None, or the `_Fp8Scales` of e4m3 down weights, whose K axis
    (the expert width) may start mid-block: the steps then start `shift` columns (static, or None: from the
    traced offset) before column 0, on the weight's block boundaries, and mask the columns outside [0, I)."""
    tile = src_ref.shape[0]
    n0 = pl.program_id(0) * bn
    m0 = pl.program_id(1) * tile
    i, d = wd_ref.shape[1], wd_ref.shape[2]
    if fp8 is not None and fp8.nk:
        d, i = i, d

    @pl.when(src_ref[0] >= 0)
    def _():
        src = src_ref[...]
        e = te_ref[0]

        def body(s, acc):  # h columns past I are exactly 0 (the up kernel wrote them from zero weights)
            wd = _weight_block(wd_ref, e, s * bk, bk, n0, bn, i, d, interpret)
            return acc + dot(h_ref[pl.ds(m0, tile), pl.ds(s * bk, bk)], wd)

        if fp8 is not None:
            body = functools.partial(_down_step_fp8, fp8=fp8, e=e, m0=m0, n0=n0, tile=tile, bn=bn, bk=bk,
                                     shift=shift, h_ref=h_ref, wd_ref=wd_ref, interpret=interpret)

        valid = src >= 0
        rows = jnp.where(valid, src, MASKED_ROW)  # out of range: the interpreter drops masked rows too
        if fp8 is not None and fp8.split_out:  # even and odd output columns apart (no ragged widths here)
            z = jnp.zeros((tile, bn // 2), jnp.float32)
            acc = jax.lax.fori_loop(0, steps, body, (z, z))
            for j in range(2):
                y = (acc[j] * w_ref[...][:, None]).astype(y_ref.dtype)
                cols = col_range(n0 + j, bn // 2, 2)
                plgpu.store(y_ref.at[rows[:, None], cols[None, :]], y, mask=valid[:, None])
            return
        if fp8 is not None and fp8.swap:
            acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bn, tile), jnp.float32)).T
        else:
            acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((tile, bn), jnp.float32))
        y = (acc * w_ref[...][:, None]).astype(y_ref.dtype)
        cols = col_range(n0, bn)
        if d % bn:
            col_ok = cols < d
            mask = valid[:, None] & col_ok[None, :]
            cols = jnp.where(col_ok, cols, MASKED_ROW)
        else:
            mask = valid[:, None]
        plgpu.store(y_ref.at[rows[:, None], cols[None, :]], y, mask=mask)


def _cols(ref, r0, nr, cols, ok, interpret):
    """ref[r0:r0 + nr, cols] of a 2-D ref, zeros in the columns not `ok`."""
    rows = col_range(r0, nr)
    if interpret:  # the interpreter cannot discharge masked loads: clamp, then zero
        x = ref[rows[:, None], jnp.clip(cols, 0, ref.shape[1] - 1)[None, :]]
        return jnp.where(ok[None, :], x, jnp.zeros((), x.dtype))
    return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=jnp.broadcast_to(ok[None, :], (nr, len(cols))),
                      other=0)


def _weight_block_fp8(ref, e, r0, nr, c0, nc, n_rows, n_cols, dtype):
    """`_weight_block` of an e4m3 weight, converted to `dtype` (exact): zeros past its rows or columns, read by
    clamped indices (Triton cannot fill a masked e4m3 load)."""
    if n_rows % nr == 0 and n_cols % nc == 0:
        return ref[e, pl.ds(r0, nr), pl.ds(c0, nc)].astype(dtype)
    return load_e4m3(ref, (e,), col_range(r0, nr), col_range(c0, nc), n_rows, n_cols, dtype)


def _pair_block(ref, e, r0, nr, c0, nc, dtype):
    """(even, odd) columns of an e4m3 weight block stored as uint16 words (two e4m3 values each, the first in the
    low byte): words ref[e, r0:r0 + nr, c0:c0 + nc] -> two [nr, nc] blocks in `dtype` (exact; None: e4m3). Such a
    view halves the element count: Pallas Triton computes the offsets of an array under 4 GiB in int32, which
    overflows past 2**31 elements (a 256 x 6144 x 2048 e4m3 expert stack is 3.2 GB)."""
    words = ref[e, pl.ds(r0, nr), pl.ds(c0, nc)]
    lo = jax.lax.bitcast_convert_type((words & 0xFF).astype(jnp.uint8), FP8)
    hi = jax.lax.bitcast_convert_type((words >> 8).astype(jnp.uint8), FP8)
    if dtype is None:  # W8A8: e4m3 operands of an fp8 dot
        return lo, hi
    return lo.astype(dtype), hi.astype(dtype)


def _kmajor_words(ref, e, r0, nr, w0, nw):
    """e4m3 [nr, 2 * nw] from a K-major stack read as uint16 words of two consecutive K values (the first in the low
    byte): words ref[e, r0:r0 + nr, w0:w0 + nw] split into their bytes and interleaved back into K order in
    registers (a join and a reshape), so one fp8 dot takes the tile against contiguous activation columns."""
    words = ref[e, pl.ds(r0, nr), pl.ds(w0, nw)]
    lo = (words & 0xFF).astype(jnp.uint8)
    hi = (words >> 8).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(jnp.stack([lo, hi], axis=-1).reshape(nr, 2 * nw), FP8)


def _down_step_fp8(s, acc, *, fp8, e, m0, n0, tile, bn, bk, shift, h_ref, wd_ref, interpret):
    """One K step of the FP8 down projection: h [tile, bk] @ e4m3 down rows [bk, bn] (as h.dtype), the partial
    scaled by its (width block, hidden block) scale."""
    i, d = wd_ref.shape[1], wd_ref.shape[2]
    r = shift if shift is not None else fp8.i_off % bk
    kb = jnp.minimum((fp8.i_off - r + s * bk) // FP8_BLOCK, fp8.k_blocks(fp8.refs[0]) - 1)
    if fp8.act:  # W8A8 (whole 128-blocks, shift 0): e4m3 h rows with their per-row block scales
        sa = fp8.refs[1][(s * bk) // FP8_BLOCK, pl.ds(m0, tile)][:, None]  # [tile, 1]
        h = h_ref[pl.ds(m0, tile), pl.ds(s * bk, bk)]
    if fp8.packed and not fp8.nk:  # shards on block boundaries (shift 0), words of two D columns
        if not fp8.act:
            h = h_ref[pl.ds(m0, tile), pl.ds(s * bk, bk)]
        half = bn // 2
        w_even, w_odd = _pair_block(wd_ref, e, s * bk, bk, n0 // 2, half, None if fp8.act else h.dtype)
        scales = [_down_scale(fp8, e, kb, n0, bn, half, 2), _down_scale(fp8, e, kb, n0 + 1, bn, half, 2)]
        if fp8.act:
            scales = [sa * sc for sc in scales]
        return acc[0] + dot(h, w_even) * scales[0], acc[1] + dot(h, w_odd) * scales[1]
    if fp8.act:
        if fp8.nk and fp8.packed:  # K-major words of two I values: back into K order in registers
            wd = _kmajor_words(wd_ref, e, n0, bn, s * (bk // 2), bk // 2)
        elif fp8.nk:
            wd = wd_ref[e, pl.ds(n0, bn), pl.ds(s * bk, bk)]
        else:
            wd = wd_ref[e, pl.ds(s * bk, bk), pl.ds(n0, bn)]
        scale = _down_scale(fp8, e, kb, n0, bn)
        if fp8.swap:  # [bn, tile] = down rows [bn, bk] . h^T
            return acc + dot(wd, h, trans_b=True) * (sa.T * _transposed(scale))
        return acc + dot(h, wd, trans_b=fp8.nk) * (sa * scale)
    if shift == 0:  # steps on block boundaries from column 0: the bf16 path's loads
        h = h_ref[pl.ds(m0, tile), pl.ds(s * bk, bk)]
        wd = _weight_block_fp8(wd_ref, e, s * bk, bk, n0, bn, i, d, h.dtype)
    else:  # the shard starts mid-block: columns before 0 and past I read as zeros
        cols = col_range(s * bk - r, bk)
        ok = (cols >= 0) & (cols < i)
        h = _cols(h_ref, m0, tile, cols, ok, interpret)
        wd = load_e4m3(wd_ref, (e,), cols, col_range(n0, bn), i, d, h.dtype)
    return acc + dot(h, wd) * _down_scale(fp8, e, kb, n0, bn)


def _down_scale(fp8, e, kb, n0, bn, count=None, stride: int = 1):
    """The down weights' scales of output columns n0, n0 + stride, ... (`count` of them, default bn) of the column
    block [n0 - n0 % bn, + bn) at width block kb: a scalar when the block lies in one 128-block (the block start is
    a multiple of bn, which then divides 128), else [1, count]."""
    ref = fp8.refs[0]
    if bn <= FP8_BLOCK:
        return fp8.weight_scale(ref, e, kb, n0 // FP8_BLOCK)
    blocks = jnp.minimum(col_range(n0, count or bn, stride) // FP8_BLOCK, fp8.n_blocks(ref) - 1)
    return fp8.weight_scale(ref, e, kb, blocks)[None, :]


def _transposed(scale):
    """A [1, n] scale row as an [n, 1] column (a scalar as it is): the swapped accumulators' orientation."""
    return scale if jnp.ndim(scale) == 0 else scale.T


def _round_to(x, dtype):
    """float32 x rounded to the values of `dtype` (kept float32): a rounding XLA may not elide."""
    f = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x, exponent_bits=f.nexp, mantissa_bits=f.nmant)


def _fp8_kernel(kernel, n_in, n_out, scalar, i_off, shift, packed, act, nk, swap, *refs, **kw):
    """`kernel` with FP8 block scales: refs are [offset (when `i_off` is None: traced)], the `n_in` inputs of the
    bf16 kernel, its scale grids, then its outputs; the scale grids go to `kernel` as `fp8=_Fp8Scales(...)`."""
    refs = list(refs)
    off = refs.pop(0)[0] if i_off is None else i_off
    n_scales = len(refs) - n_in - n_out
    fp8 = _Fp8Scales(tuple(refs[n_in:n_in + n_scales]), off, scalar, packed, act, nk, swap)
    if kernel is _down_kernel:
        kw["shift"] = shift
    return kernel(*refs[:n_in], *refs[n_in + n_scales:], fp8=fp8, **kw)


def _fp8_launch(kernel, i_offset, scales, in_specs, inputs, *, scalar, shift, packed=False, act=False, nk=False,
                swap=False, n_out=1):
    """(kernel, in_specs, inputs) with the FP8 scale grids (and a traced offset) added; unchanged without FP8."""
    if scales is None:
        return kernel, in_specs, inputs
    traced = not isinstance(i_offset, int)
    wrapped = functools.partial(_fp8_kernel, kernel.func, len(inputs), n_out, scalar, None if traced else i_offset,
                                shift, packed, act, nk, swap, **kernel.keywords)
    specs = list(in_specs) + [pl.BlockSpec(memory_space=pl.ANY)] * len(scales)
    args = list(inputs) + list(scales)
    if traced:
        specs = [pl.BlockSpec(memory_space=pl.ANY)] + specs
        args = [jnp.reshape(jnp.asarray(i_offset, jnp.int32), (1,))] + args
    return wrapped, specs, args


def grouped_swiglu(x, experts, weights, wg, wu, wd, *, config: MoEConfig | None = None, interpret: bool = False,
                   wg_scale=None, wu_scale=None, wd_scale=None, i_offset=0, packed: bool | None = None,
                   form: str = "w8a16", w_layout: str = "kn", **overrides):
    """float32 [T, D]: the routed experts by the two grouped-GEMM kernels. `config` (default `default_config`
    for the shape); `overrides` replace fields of it by name (tile, bn_up, bk_up, bn_down, bk_down, num_warps,
    num_stages, k_split). `interpret`: run under the Pallas interpreter.

    FP8 experts (`kernels.moe.routed_experts` validates them): e4m3 gate/up [E, D, I] and down [E, I, D] with
    float32 block scales `wg_scale`, `wu_scale` [E, D-blocks, I-blocks] and `wd_scale` [E, I-blocks, D-blocks];
    `i_offset` (int or traced int32 scalar) is the expert-width slice's position in its first block (TP shards).
    W8A16: the e4m3 blocks become x.dtype in the kernels' registers (exact) and each K step's float32 partial is
    scaled by its block's scale; K steps (bk_up, bk_down) must then be at most 128. `packed` (default: when an
    expert stack has 2**31 elements or more, e.g. GLM-5.2's 256 x 6144 x 2048 on one device) reads the e4m3
    weights as uint16 words of two columns (`_pair_block`; K-major stacks: of two K values, interleaved back in
    registers by `_kmajor_words`), because Pallas Triton's int32 offsets of arrays under 4 GiB overflow past 2**31
    elements; it needs widths the blocks divide and a shard on block boundaries.
    `form` "w8a8" (FP8 experts whose widths are whole 128-blocks and whose shard starts on a block boundary):
    the rows are quantised too (`fp8_formats.quantize_activation_blocks`: x before the up kernel, h between the
    kernels, per row and 128-block) and both GEMMs run e4m3 x e4m3 on the fp8 tensor cores, each K step's float32
    partial scaled by the row's and the weight block's scales (docs/math.md §11). `w_layout` "nk" (W8A8 only):
    K-major stacks, gate/up [E, I, D] and down [E, D, I] (each expert in the release's [out, in] form), the B
    operand Hopper's fp8 MMA takes without a transpose, with their scale grids in the same orientation as the
    stacks (the HF `weight_scale_inv` grids stacked, no transpose): `wg_scale`, `wu_scale` [E, I-blocks,
    D-blocks], `wd_scale` [E, D-blocks, I-blocks], i.e. [E, N-blocks, K-blocks] for every projection."""
    t, k = experts.shape
    if w_layout not in ("kn", "nk"):
        raise ValueError(f"moe triton: w_layout {w_layout!r} is not one of 'kn', 'nk'")
    nk = w_layout == "nk"
    if nk and form != "w8a8":
        raise ValueError("moe triton: K-major ('nk') expert stacks are for form 'w8a8'")
    if nk:
        n_exp, i, d = wg.shape
    else:
        n_exp, d, i = wg.shape
    fp8 = wg_scale is not None
    if form not in ("w8a16", "w8a8"):
        raise ValueError(f"moe triton: form {form!r} is not one of 'w8a16', 'w8a8'")
    act = form == "w8a8"
    if act and not (fp8 and isinstance(i_offset, int) and i_offset == 0 and d % FP8_BLOCK == 0
                    and i % FP8_BLOCK == 0):
        raise ValueError(f"moe triton: form 'w8a8' needs FP8 experts of whole 128-blocks starting on a block "
                         f"boundary; got {wg.dtype} experts of {d} x {i} at i_offset {i_offset!r}")
    out_dtype = x.dtype
    x_scale = None
    if act:
        x, x_scale = quantize_activation_blocks(x)
        x_scale = x_scale.T  # [D-blocks, T]: one contiguous row of scales per block
    cfg = config or default_config(registry.config_rows(t), k, n_exp, d, i, jnp.dtype(out_dtype if fp8 else wg.dtype).itemsize, form,
                                  w_layout)
    cfg = with_options(cfg, overrides, "moe")
    if cfg.swap_ab and not (act and nk):
        raise ValueError(f"moe triton: swap_ab is for form 'w8a8' over K-major ('nk') stacks; got form {form!r}, "
                         f"w_layout {w_layout!r}")
    if act and (i % cfg.bn_up or d % cfg.bn_down or d % cfg.bk_up or i % cfg.bk_down):
        raise ValueError(f"moe triton: form 'w8a8' reads whole blocks: the blocks of {cfg} must divide the widths "
                         f"(hidden {d}, expert width {i})")
    if fp8 and max(cfg.bk_up, cfg.bk_down) > FP8_BLOCK:
        raise ValueError(f"moe triton: FP8 experts need bk_up and bk_down <= {FP8_BLOCK} (one scale block per K "
                         f"step), got {cfg.bk_up} and {cfg.bk_down}")
    static_off = isinstance(i_offset, int)
    if packed is None:
        packed = fp8 and word_form(n_exp, d, i)
    # in-kernel h quantisation: not for [E, K, N] stacks as words, whose up kernel stores h as even and odd columns
    quant_h_ok = act and cfg.k_split == 1 and cfg.bn_up == FP8_BLOCK and not (packed and not nk)
    if cfg.quant_h is None:
        cfg = dataclasses.replace(cfg, quant_h=quant_h_ok)
    if cfg.quant_h and not quant_h_ok:
        raise ValueError(f"moe triton: quant_h quantises h in the up kernel: it needs form 'w8a8', k_split 1 and "
                         f"bn_up {FP8_BLOCK} (one 128-block per program); got form {form!r}, {cfg}")
    if packed and nk:  # words of two K values (act: whole blocks checked above)
        wg, wu = (jax.lax.bitcast_convert_type(w.reshape(n_exp, i, d // 2, 2), jnp.uint16) for w in (wg, wu))
        wd = jax.lax.bitcast_convert_type(wd.reshape(n_exp, d, i // 2, 2), jnp.uint16)
    elif packed:
        if not fp8:
            raise ValueError("moe triton: packed weights are for FP8 experts (e4m3 pairs in uint16 words)")
        if not (static_off and i_offset == 0 and i % max(cfg.bn_up, cfg.bk_down) == 0 and d % cfg.bn_down == 0
                and d % cfg.bk_up == 0 and cfg.bn_up % 32 == 0 and cfg.bn_down % 32 == 0):
            raise ValueError(f"moe triton: FP8 experts of {n_exp} x {d} x {i} ({max(wg.size, wd.size)} elements: "
                             f"read as uint16 pairs) need the blocks to divide the widths and a shard on block "
                             f"boundaries; got {cfg} and i_offset {i_offset}")
        wg, wu = (jax.lax.bitcast_convert_type(w.reshape(n_exp, d, i // 2, 2), jnp.uint16) for w in (wg, wu))
        wd = jax.lax.bitcast_convert_type(wd.reshape(n_exp, i, d // 2, 2), jnp.uint16)
    tile = registry.launch("moe", cfg).tile
    src, tile_expert = tile_plan(experts, n_exp, tile)
    n_tiles = tile_expert.shape[0]
    pair_w = jnp.where(src >= 0, weights.reshape(-1).astype(jnp.float32)[jnp.maximum(src, 0)], 0.0)
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    tile_specs = [pl.BlockSpec((tile,), lambda n, m: (m,)), pl.BlockSpec((1,), lambda n, m: (m,))]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)

    # h [rows, i_h]: I rounded up to whole up-kernel column blocks and down-kernel K steps; the up kernel
    # writes every column of it (zeros past I), so the down kernel reads no unwritten memory
    i_h = _cdiv(i, max(cfg.bn_up, cfg.bk_down)) * max(cfg.bn_up, cfg.bk_down)
    bn, ks = cfg.bn_up, cfg.k_split
    up_steps = _cdiv(d, cfg.bk_up)
    if up_steps % ks:
        raise ValueError(f"moe triton: k_split {ks} must be a power of two dividing D / bk_up = {up_steps}")
    up_scales = ((wg_scale, wu_scale, x_scale) if act else (wg_scale, wu_scale)) if fp8 else None
    up_scalar = static_off and i_offset == 0 and bn <= FP8_BLOCK
    h_scale = None
    if ks == 1:
        out_specs = pl.BlockSpec((tile, bn), lambda n, m: (m, n))
        out_shape = jax.ShapeDtypeStruct((n_tiles * tile, i_h), out_dtype)
        if cfg.quant_h:  # h as e4m3 with its scales [I-blocks, rows] (one 128-block per column block)
            out_specs = [out_specs, pl.BlockSpec((1, tile), lambda n, m: (n, m))]
            out_shape = [jax.ShapeDtypeStruct(out_shape.shape, FP8),
                         jax.ShapeDtypeStruct((i_h // FP8_BLOCK, n_tiles * tile), jnp.float32)]
        kernel, specs, args = _fp8_launch(
            functools.partial(_up_kernel, k=k, bk=cfg.bk_up, steps=up_steps, interpret=interpret,
                              h_dtype=out_dtype), i_offset,
            up_scales, tile_specs + [any_spec] * 3, (src, tile_expert, x, wg, wu), scalar=up_scalar, shift=0,
            packed=packed, act=act, nk=nk, swap=cfg.swap_ab, n_out=2 if cfg.quant_h else 1)
        h = pl.pallas_call(
            kernel,
            grid=(i_h // bn, n_tiles),
            in_specs=specs,
            out_specs=out_specs,
            out_shape=out_shape,
            compiler_params=params, interpret=interpret, name="moe_up",
        )(*args)
        if cfg.quant_h:
            h, h_scale = h
    else:
        part = jax.ShapeDtypeStruct((ks, n_tiles * tile, i_h), jnp.float32)
        kernel, specs, args = _fp8_launch(
            functools.partial(_up_partial_kernel, k=k, bk=cfg.bk_up, steps=up_steps // ks, interpret=interpret),
            i_offset, up_scales,
            [pl.BlockSpec((tile,), lambda n, m, c: (m,)), pl.BlockSpec((1,), lambda n, m, c: (m,))]
            + [any_spec] * 3, (src, tile_expert, x, wg, wu), scalar=up_scalar, shift=0, packed=packed, act=act,
            nk=nk, swap=cfg.swap_ab, n_out=2)
        g, u = pl.pallas_call(
            kernel,
            grid=(i_h // bn, n_tiles, ks),
            in_specs=specs,
            out_specs=[pl.BlockSpec((None, tile, bn), lambda n, m, c: (c, m, n))] * 2,
            out_shape=[part, part],
            compiler_params=params, interpret=interpret, name="moe_up_split_k",
        )(*args)
        h = jax.nn.silu(ordered_sum(g, 0)) * ordered_sum(u, 0)  # the splits in split order
        if act:  # h is quantised from its out_dtype values: XLA may drop a convert pair inside the fusion
            h = _round_to(h, out_dtype)  # (excess precision), so round explicitly, as the up kernel's store does
        h = h.astype(out_dtype)
    down_scales = (wd_scale,) if fp8 else None
    if act and h_scale is None:  # h rows of empty tiles hold garbage, their scales too; no program reads them
        h, h_scale = quantize_activation_blocks(h)
        h_scale = h_scale.T
    if act:
        down_scales = (wd_scale, h_scale)

    bn, bk = cfg.bn_down, cfg.bk_down
    shift = (i_offset % bk if static_off else None) if fp8 else 0
    down_steps = _cdiv(i, bk) if shift == 0 else _cdiv((bk - 1 if shift is None else shift) + i, bk)
    kernel, specs, args = _fp8_launch(
        functools.partial(_down_kernel, bn=bn, bk=bk, steps=down_steps, interpret=interpret), i_offset,
        down_scales, tile_specs + [pl.BlockSpec((tile,), lambda n, m: (m,)), any_spec, any_spec],
        (src, tile_expert, pair_w, h, wd), scalar=False, shift=shift, packed=packed, act=act, nk=nk,
        swap=cfg.swap_ab)
    y = pl.pallas_call(
        kernel,
        grid=(_cdiv(d, bn), n_tiles),
        in_specs=specs,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((t * k, d), out_dtype),
        compiler_params=params, interpret=interpret, name="moe_down",
    )(*args)
    # the down kernel writes the rows of the pairs in tiles only: an unrouted pair's row (an expert id outside
    # [0, n_exp), in no tile: `tile_plan`) is never written, so it is selected away, not summed
    y = jnp.where(routed_pairs(experts, n_exp)[..., None], y.astype(jnp.float32).reshape(t, k, d), 0.0)
    return ordered_sum(y, 1)  # a token's k pairs in routing order
