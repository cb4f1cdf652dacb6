"""The 128 x 128 block FP8 code of weights in our layout, on the devices: quantise and dequantise.

The kernels' block codec (`kernels.common.fp8_formats`: `quantize_weight_blocks` / `dequantize_weight_blocks`, the
device forms of `quantize_blocks_np` / `dequantize_blocks_np`; docs/math.md §11), transposed: a weight of
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

import jax.numpy as jnp

from kernels.common.fp8_formats import WEIGHT_BLOCK as FP8_BLOCK
from kernels.common.fp8_formats import dequantize_weight_blocks, quantize_weight_blocks


def _flat_shape(shape: tuple[int, ...], grid: tuple[int, int, int]) -> tuple[int, ...]:
    """[*lead, IN, OUT]: `shape` with its input and its output axes each flattened (fp8_grid counts)."""
    lead, n_in, _ = grid
    return (*shape[:lead], math.prod(shape[lead:lead + n_in]), math.prod(shape[lead + n_in:]))


def quantize_fp8(w, grid: tuple[int, int, int], block: int = FP8_BLOCK):
    """A weight in our layout (any float dtype) -> (float8_e4m3fn of the same shape, float32 scale grid
    [*lead, ceil(IN / block), ceil(OUT / block)]): the kernels' block codec (`quantize_weight_blocks`: `scale =
    amax(block) / 448`, 1.0 for an all-zero block, `q = e4m3(w / scale)` in IEEE float32, the bits of the host
    form) over the flattened axes. Jit it with the leaves' out_shardings to keep it on the mesh."""
    shape = tuple(w.shape)
    q, scale = quantize_weight_blocks(jnp.reshape(w, _flat_shape(shape, grid)), block)
    return jnp.reshape(q, shape), scale


def dequantize_fp8(q, scale, grid: tuple[int, int, int], dtype, block: int = FP8_BLOCK):
    """An e4m3 weight in our layout and its float32 scale grid -> `q * scale` per block, computed in float32 and
    cast to `dtype` (the kernels' `dequantize_weight_blocks`, as the host form and the HF loader compute it)."""
    shape = tuple(q.shape)
    w = dequantize_weight_blocks(jnp.reshape(q, _flat_shape(shape, grid)), jnp.asarray(scale, jnp.float32),
                                 dtype=jnp.float32, block=block, convert=True)
    return jnp.reshape(w, shape).astype(dtype)


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
