"""Linear layers of the per-shard model from bf16 or FP8 weights (docs/math.md §11).

A module's weight `name` is either a float array in our [*in, *out] layout, or an e4m3 array in that layout with
a float32 block-scale grid `name + "_scale"` over its flattened input and output axes (checkpoints.quantization).
`apply` computes x @ W for both. For FP8 under TP, `split` says which flattened axis this device holds a slice of
and over which mesh axes: when the slice is a whole number of 128-blocks the grid arrives sharded with it (the
real model, `sharding.fp8_scale_spec`); otherwise the whole grid is replicated and each device cuts its blocks by
its rank, passing the slice's offset inside its first block to the kernel as a traced int.

Which FP8 form runs where is the kernels registry's rule "fp8_linear.model_form": decode-sized row counts read
the e4m3 bytes in the W8A16 kernel; prefill-sized ones dequantise the weight to the activations' dtype and run
XLA's GEMM. impl "xla" is the float32 reference (`fp8_linear_xla`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kernels import fp8_linear, registry
from kernels.common.fp8_formats import dequantize_weight_blocks
from sharding import Collectives

BLOCK = 128


def scale_of(module, name: str):
    """The scale grid of `module`'s weight `name` ([...] read), or None when the weight is not FP8."""
    s = getattr(module, name + "_scale", None)
    return None if s is None else s[...]


def local_grid(scale, width: int, axis: int, axes, comm: Collectives | None = None):
    """(this device's scale blocks along `axis`, the offset of its slice inside the first of them) for a weight
    axis of local `width` split over the mesh `axes` (this device's index from `comm`, the mesh's by default). A
    grid that already holds exactly this slice's blocks (sharded on 128 boundaries, or not split) comes back as is
    with offset 0."""
    if width % BLOCK == 0 and scale.shape[axis] == width // BLOCK:
        return scale, 0
    start = (comm or Collectives()).axis_index(axes) * width  # the slice's first global row along the flattened axis
    size = -(-(BLOCK - 1 + width) // BLOCK)  # the most blocks any rank's slice touches
    pad = [(0, size if i == axis % scale.ndim else 0) for i in range(scale.ndim)]
    padded = jnp.pad(scale, pad, mode="edge")  # blocks past the end are never used: any finite value
    sub = jax.lax.dynamic_slice_in_dim(padded, start // BLOCK, size, axis)
    return sub, (start % BLOCK).astype(jnp.int32)


def apply(module, name: str, x, *, n_in: int = 1, split=None, impl: str = "xla", comm: Collectives | None = None):
    """x [T, *in] @ module.<name> [*in, *out] -> [T, *out] (x's dtype). `split`: None, or ("in" | "out", mesh
    axes) when TP splits that flattened axis of an FP8 weight (the float path ignores it); `comm`: the step's
    collectives (this device's rank along those axes)."""
    w = getattr(module, name)[...]
    scale = scale_of(module, name)
    if scale is None:
        return jnp.tensordot(x, w, n_in)
    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    k, n = math.prod(in_shape), math.prod(out_shape)
    lead = x.shape[: x.ndim - n_in]
    x2, w2 = x.reshape(-1, k), w.reshape(k, n)
    k_off = n_off = 0
    if split is not None:
        side, axes = split
        if side == "in":
            scale, k_off = local_grid(scale, k, 0, axes, comm)
        else:
            scale, n_off = local_grid(scale, n, 1, axes, comm)
    if registry.decide("fp8_linear.model_form", x2, impl=impl) == "dequant":
        wd = dequantize_weight_blocks(w2, scale, k_off, n_off, dtype=x2.dtype)
        y = jnp.dot(x2, wd, preferred_element_type=jnp.float32).astype(x2.dtype)
    else:
        y = fp8_linear.fp8_linear(x2, w2, scale, form="w8a16", impl=impl, n_offset=n_off, k_offset=k_off,
                                  w_layout="kn")
    return y.reshape(*lead, *out_shape)
