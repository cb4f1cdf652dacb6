"""Pallas Triton merge of split-K partial attention results by their log-sum-exp (docs/math.md §6): the function
`kernels.lse_merge.merge_partials(o, lse, axis=0)` computes, over partials o [N, T, H, R] / lse [N, T, H], in one
launch. XLA runs that merge as five passes over the partials (max, exp and sum, log, weights, weighted sum), each
a kernel launch of its own: at one query row they took longer than the attention kernel itself (ncu,
BENCHMARKS.md, sparse MLA).

Grid (T, H / block_h, R / block_r): program (t, j, c) reads the N lse of its block_h heads (one [block_h] load per
split), forms the weights as merge_partials does (NaN and +inf lse count as empty, an all-empty set gives (0,
-inf)), then sums its [block_h, block_r] columns of the N partials in float32, every split's load issued before
the sums (the split loop is unrolled) and masked off where the weight is 0 (an empty split's o is never read). The
c == 0 programs write the merged lse. Registered as impls "triton" / "triton_interpret" of op "lse_merge"
(`kernels.lse_merge.merge_splits`), whose "xla" impl is merge_partials.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import registry
from ..common.triton_common import with_options
from .config import MergeConfig, default_config  # noqa: F401 (default_config: read from here)

MAX_SPLITS = 64  # the split loop is unrolled: more partials than this take the xla merge


def _largest_pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def supports(o, lse, **_options) -> str | None:
    """Why the kernel cannot take these partials (None when it can)."""
    if o.ndim != 4 or lse.ndim != 3 or o.shape[:3] != lse.shape:
        return f"partials o {o.shape} / lse {lse.shape} must be [N, T, H, R] / [N, T, H]"
    if o.shape[0] > MAX_SPLITS:
        return f"{o.shape[0]} partials exceed MAX_SPLITS {MAX_SPLITS}"
    return None


def _merge_kernel(o_ref, lse_ref, out_ref, out_lse_ref, *, n):
    t, j, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bh, br = out_ref.shape
    heads, cols = pl.ds(j * bh, bh), pl.ds(c * br, br)
    lse = []
    for s in range(n):
        x = lse_ref[s, t, heads].astype(jnp.float32)
        lse.append(jnp.where(jnp.isnan(x) | (x == jnp.inf), -jnp.inf, x))
    m = functools.reduce(jnp.maximum, lse)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    w = [jnp.exp(x - m) for x in lse]  # exp(-inf) = 0 for an empty partial
    total = functools.reduce(jnp.add, w)
    has = total > 0
    inv = jnp.where(has, 1.0 / jnp.where(has, total, 1.0), 0.0)
    scales = [ws * inv for ws in w]
    # every split's load before the sums; a head whose weight is 0 (lse -inf: an empty split, e.g. every split of a
    # padding row) is not read at all: its o may be unwritten (the Mosaic sparse MLA kernel skips empty splits),
    # and the masked-off values are never used below, so the sums are bit for bit those of reading it
    # (the split as an int32: the interpreter's discharge of a masked load takes array indices only)
    parts = [plgpu.load(o_ref.at[jnp.int32(s), t, heads, cols], mask=jnp.broadcast_to((sc > 0)[:, None], (bh, br)),
                        other=0) for s, sc in enumerate(scales)]
    acc = jnp.zeros((bh, br), jnp.float32)
    for scale, part in zip(scales, parts):
        acc += jnp.where(scale[:, None] > 0, scale[:, None] * part.astype(jnp.float32), 0.0)
    out_ref[...] = acc

    @pl.when(c == 0)
    def _():
        out_lse_ref[...] = jnp.where(has, m + jnp.log(jnp.where(has, total, 1.0)), -jnp.inf)


def merge_partials_triton(o, lse, *, config: MergeConfig | None = None, interpret: bool = False, **overrides):
    """(o [T, H, R] float32, lse [T, H] float32): the log-sum-exp merge of partials o [N, T, H, R] (any float dtype)
    / lse [N, T, H] over N, as `kernels.lse_merge.merge_partials(o, lse, axis=0)`. `config` (default
    `default_config` for the shape); `overrides` replace fields of it by name (block_h, block_r, num_warps).
    `interpret`: run under the Pallas interpreter."""
    why = supports(o, lse)
    if why:
        raise ValueError(f"lse_merge triton: {why}")
    n, t, h, r = o.shape
    cfg = registry.launch("lse_merge", with_options(config or default_config(registry.config_rows(t), h, r), overrides,
                                                    "lse_merge"))
    bh, br = _largest_pow2_divisor(h, cfg.block_h), _largest_pow2_divisor(r, cfg.block_r)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_merge_kernel, n=n),
        grid=(t, h // bh, r // br),
        in_specs=[any_spec, any_spec],
        out_specs=[pl.BlockSpec((None, bh, br), lambda i, j, c: (i, j, c)),
                   pl.BlockSpec((None, bh), lambda i, j, c: (i, j))],
        out_shape=[jax.ShapeDtypeStruct((t, h, r), jnp.float32), jax.ShapeDtypeStruct((t, h), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="lse_merge",
    )(o, lse.astype(jnp.float32))
