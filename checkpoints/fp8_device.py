"""The 128 x 128 block FP8 code of weights in our layout, on the devices (jax.numpy): quantise and dequantise.

The arithmetic of `fp8_codec.quantize_blocks` / `dequantize_blocks_np` (docs/math.md §11), transposed: a weight of
`ParamSpec.fp8_grid` (lead, n_in, n_out) is blocked over its flattened input and output axes ([*lead, IN, OUT]),
where the HF release blocks [OUT, IN]. The amax of a block is symmetric under that transpose, so the e4m3 bytes are
those of the release transposed, and the scale grid is `layout.fp8_scale_shape`. The one device-side quantiser:
orbax restores (`orbax_io`) and random benchmark parameters (`glm_dsa.model.random_init`) both call it, so the two
never differ.
`quantize_kept` / `dequantize_kept` go between a weight in our layout and its kept form (`layout.kept_fp8_spec`:
K-major for expert stacks, blocked as stored, which is the same blocking transposed).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .fp8_codec import E4M3_MAX, FP8_BLOCK


def _flat_shape(shape: tuple[int, ...], grid: tuple[int, int, int]) -> tuple[int, ...]:
    """[*lead, IN, OUT]: `shape` with its input and its output axes each flattened (fp8_grid counts)."""
    lead, n_in, _ = grid
    return (*shape[:lead], math.prod(shape[lead:lead + n_in]), math.prod(shape[lead + n_in:]))


def quantize_fp8(w, grid: tuple[int, int, int], block: int = FP8_BLOCK):
    """A weight in our layout (any float dtype) -> (float8_e4m3fn of the same shape, float32 scale grid
    [*lead, ceil(IN / block), ceil(OUT / block)]): `scale = amax(block) / 448` (1.0 for an all-zero block),
    `q = e4m3(w / scale)`, computed in float32. Jit it with the leaves' out_shardings to keep it on the mesh."""
    shape = tuple(w.shape)
    flat = _flat_shape(shape, grid)
    rows, cols = flat[-2:]
    rb, cb = -(-rows // block), -(-cols // block)
    x = jnp.reshape(w, flat).astype(jnp.float32)
    pad = [(0, 0)] * (len(flat) - 2) + [(0, rb * block - rows), (0, cb * block - cols)]
    blocks = jnp.reshape(jnp.abs(jnp.pad(x, pad)), (*flat[:-2], rb, block, cb, block))
    amax = jnp.max(blocks, axis=(-3, -1))
    # XLA rewrites a division by a broadcast (a scalar, or the scales repeated over their blocks) into a
    # multiplication by its rounded reciprocal, which differs from numpy's division in the last bit (and then an
    # e4m3 code in a few hundred thousand); dividing by a materialised array behind a barrier keeps the IEEE
    # division, so scales and codes are those of `fp8_codec.quantize_blocks` bit for bit.
    denom = jax.lax.optimization_barrier(jnp.full(amax.shape, E4M3_MAX, jnp.float32))
    scale = jnp.where(amax > 0, amax / denom, 1.0).astype(jnp.float32)
    full = jax.lax.optimization_barrier(_expand(scale, rows, cols, block))  # the same: a true division by it
    return jnp.reshape((x / full).astype(jnp.float8_e4m3fn), shape), scale


def dequantize_fp8(q, scale, grid: tuple[int, int, int], dtype, block: int = FP8_BLOCK):
    """An e4m3 weight in our layout and its float32 scale grid -> `q * scale` per block, computed in float32 and
    cast to `dtype` (the arithmetic of `fp8_codec.dequantize_blocks_np` and the HF loader's dequantisation)."""
    shape = tuple(q.shape)
    flat = _flat_shape(shape, grid)
    full = _expand(jnp.asarray(scale, jnp.float32), flat[-2], flat[-1], block)
    w = jnp.reshape(q, flat).astype(jnp.float32) * full
    return jnp.reshape(w, shape).astype(dtype)


def _expand(scale, rows: int, cols: int, block: int):
    """A [*lead, rb, cb] scale grid repeated over its blocks and cut to [*lead, rows, cols]."""
    full = jnp.repeat(jnp.repeat(scale, block, axis=-2), block, axis=-1)
    return full[..., :rows, :cols]


def quantize_kept(w, grid: tuple[int, int, int], kmajor: bool, block: int = FP8_BLOCK):
    """A weight in our layout -> its kept FP8 leaves (`layout.kept_fp8_spec`, whose `fp8_grid` and `kmajor` are
    the arguments): (e4m3 in the stored form, float32 scale grid of that form). A K-major stack is transposed
    first, then blocked as stored."""
    return quantize_fp8(jnp.swapaxes(w, -1, -2) if kmajor else w, grid, block)


def dequantize_kept(q, scale, grid: tuple[int, int, int], kmajor: bool, dtype, block: int = FP8_BLOCK):
    """Kept FP8 leaves (`layout.kept_fp8_spec`'s `fp8_grid` and `kmajor`) -> the weight in our layout, in `dtype`
    (K-major stacks transposed back)."""
    w = dequantize_fp8(q, scale, grid, dtype, block)
    return jnp.swapaxes(w, -1, -2) if kmajor else w
