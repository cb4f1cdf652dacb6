"""Linear layers of the per-shard model from bf16 or FP8 weights (docs/math.md §11).

A module's weight `name` is either a float array in our [*in, *out] layout, or an e4m3 array in that layout with
a float32 block-scale grid `name + "_scale"` over its flattened input and output axes (checkpoints.quantization).
`apply` computes x @ W for both. For FP8 under TP, `split` says which flattened axis this device holds a slice of
and over which mesh axes: when the slice is a whole number of 128-blocks the grid arrives sharded with it (the
real model, `sharding.fp8_scale_spec`); otherwise the whole grid is replicated and each device cuts its blocks by
its rank, passing the slice's offset inside its first block to the kernel as a traced int.

Which FP8 form runs where is the kernels registry's rule "fp8_linear.model_form": decode-sized row counts read
the e4m3 bytes in the W8A16 kernel; prefill-sized ones dequantise the weight to the activations' dtype and run
XLA's GEMM; "w8a8_mosaic" (on a GPU for prompt steps by default: `kernels.fp8_linear.MOSAIC_ROWS`,
GLM_DSA_FP8_LINEAR_MOSAIC) runs the Mosaic GPU W8A8 GEMM, and `swiglu` then computes a SwiGLU MLP's gate and up
as one GEMM with the SwiGLU epilogue.
impl "xla" is the float32 reference (`fp8_linear_xla`).
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


def _operands(module, name: str, x, n_in: int, split, comm: Collectives | None):
    """(x [T, K], the weight [K, N], its local grid, n_offset, k_offset, out_shape) of FP8 weight `name`."""
    w = getattr(module, name)[...]
    scale = scale_of(module, name)
    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    k, n = math.prod(in_shape), math.prod(out_shape)
    x2, w2 = x.reshape(-1, k), w.reshape(k, n)
    k_off = n_off = 0
    if split is not None:
        side, axes = split
        if side == "in":
            scale, k_off = local_grid(scale, k, 0, axes, comm)
        else:
            scale, n_off = local_grid(scale, n, 1, axes, comm)
    return x2, w2, scale, n_off, k_off, out_shape


def _mosaic(impl: str) -> str:
    """The Mosaic impl in `impl`'s run mode: interpreted under an interpreted impl, native otherwise."""
    return "mosaic_interpret" if impl.endswith("_interpret") else "mosaic"


def _fp8_product(x2, w2, scale, n_off, k_off, form: str, impl: str):
    """x2 @ W in x2's dtype by the model form `form` (rule "fp8_linear.model_form")."""
    if form == "dequant":
        wd = dequantize_weight_blocks(w2, scale, k_off, n_off, dtype=x2.dtype)
        return at_decode_rows(lambda x_: jnp.dot(x_, wd, preferred_element_type=jnp.float32).astype(x_.dtype), x2)
    if form == "w8a8_mosaic":
        return fp8_linear.fp8_linear(x2, w2, scale, form="w8a8", impl=_mosaic(impl), n_offset=n_off,
                                     k_offset=k_off, w_layout="kn")
    return fp8_linear.fp8_linear(x2, w2, scale, form="w8a16", impl=impl, n_offset=n_off, k_offset=k_off,
                                 w_layout="kn")


def at_decode_rows(fn, *xs):
    """fn(*xs), where each of `xs` has the step's T rows on its leading axis, and so has every output of `fn`.

    In a batch-invariant decode step (`kernels.registry.invariant_decode_rows`) the rows are first padded with
    zeros to the decode kind's most rows D, `fn` runs on D rows, and its outputs are cut back to T: the decode
    steps are padded to power-of-two buckets of their rows (8 to D), and XLA picks a product's algorithm by its
    shape (cuBLAS: split-K and tiles by M, and with them a row's reduction order; `lax.top_k`'s algorithm by the
    rows too), so a product over T rows could round a row differently at each bucket. At D rows it is one
    computation whatever the bucket. Optimisation barriers keep XLA from moving the padding or the cut through
    `fn` (a slice of a dot becomes a dot of slices); they are there at D rows too, with nothing padded or cut, so
    that the step of the last bucket is the same program around `fn` as the others' (without them XLA got another
    program at D rows, free to fuse and order `fn` with its neighbours as it would not at the other buckets).
    Elsewhere (the default mode, prompt steps: one static shape each) `fn(*xs)` as it is. The model's XLA products
    over a step's rows go through here (the bf16 linears of `apply`, the indexer's head weights, the router and its
    top-k, the absorbed query and value products), and so do the decoder's RMSNorms (`layers._row_norm`: XLA
    compiles a row's sum by the whole shape too); the kernels' own products have launch configs fixed for the
    kind (`kernels.registry.config_rows`)."""
    most = registry.invariant_decode_rows()
    if most is None:
        return fn(*xs)
    t = xs[0].shape[0]
    if t > most:
        raise ValueError(f"at_decode_rows: a decode step of {t} rows, over the kind's {most}")
    # lax.slice_in_dim, not y[:t] (which traces no slice when it takes all the rows): the same equations at every
    # bucket, the last one padding zero rows and cutting none
    zero = lambda x: jnp.zeros((), x.dtype)
    padded = jax.lax.optimization_barrier(tuple(
        jax.lax.pad(x, zero(x), [(0, most - t, 0)] + [(0, 0, 0)] * (x.ndim - 1)) for x in xs))
    out = jax.lax.optimization_barrier(fn(*padded))
    return jax.tree.map(lambda y: jax.lax.slice_in_dim(y, 0, t), out)


def apply(module, name: str, x, *, n_in: int = 1, split=None, impl: str = "xla", comm: Collectives | None = None):
    """x [T, *in] @ module.<name> [*in, *out] -> [T, *out] (x's dtype). `split`: None, or ("in" | "out", mesh
    axes) when TP splits that flattened axis of an FP8 weight (the float path ignores it); `comm`: the step's
    collectives (this device's rank along those axes). A float weight's product is XLA's, over the decode kind's
    rows in a batch-invariant decode step (`at_decode_rows`); an FP8 weight's is the kernels' (rule
    "fp8_linear.model_form")."""
    if scale_of(module, name) is None:
        w = getattr(module, name)[...]
        return at_decode_rows(lambda x_: jnp.tensordot(x_, w, n_in), x)
    lead = x.shape[: x.ndim - n_in]
    x2, w2, scale, n_off, k_off, out_shape = _operands(module, name, x, n_in, split, comm)
    form = fp8_linear.model_form(x2, impl=impl, n_offset=n_off, k_offset=k_off)
    y = _fp8_product(x2, w2, scale, n_off, k_off, form, impl)
    return y.reshape(*lead, *out_shape)


def _fused_swiglu(module, gate: str, up: str, x, split, impl: str, comm: Collectives | None):
    """silu(gate(x)) * up(x) as one Mosaic GEMM with the SwiGLU epilogue (`kernels.fp8_linear.fp8_swiglu`) where
    both weights are FP8, the rule "fp8_linear.model_form" gives "w8a8_mosaic" and they split alike (one offset
    pair serves both); None otherwise."""
    if scale_of(module, gate) is None or scale_of(module, up) is None:
        return None
    xg, wg, sg, n_off, k_off, out_shape = _operands(module, gate, x, 1, split, comm)
    if fp8_linear.model_form(xg, impl=impl, n_offset=n_off, k_offset=k_off) != "w8a8_mosaic":
        return None
    _, wu, su, *_ = _operands(module, up, x, 1, split, comm)
    if wg.shape != wu.shape or sg.shape != su.shape:
        return None
    h = fp8_linear.fp8_swiglu(xg, wg, wu, sg, su, impl=_mosaic(impl), n_offset=n_off, k_offset=k_off, w_layout="kn")
    return h.reshape(*x.shape[:-1], *out_shape)


def swiglu(module, names, x, *, impl: str = "xla", comm: Collectives | None = None, axes=None):
    """down(silu(gate(x)) * up(x)) from `module`'s three weights `names` (bf16 or FP8; gate/up split on their output,
    down on its input over the mesh `axes`). FP8 gate and up that the rule "fp8_linear.model_form" gives
    "w8a8_mosaic" run as one Mosaic GEMM with the SwiGLU epilogue (`_fused_swiglu`); otherwise each is a linear of
    its own (`apply`)."""
    gate, up, down = names
    split = None if axes is None else ("out", axes)
    h = _fused_swiglu(module, gate, up, x, split, impl, comm)
    if h is None:
        g = apply(module, gate, x, split=split, impl=impl, comm=comm)
        u = apply(module, up, x, split=split, impl=impl, comm=comm)
        h = jax.nn.silu(g) * u
    return apply(module, down, h, split=None if axes is None else ("in", axes), impl=impl, comm=comm)
