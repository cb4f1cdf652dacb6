"""FP8 block-scaled linear layers (docs/math.md §11): y[T, N] = x[T, K] @ W^T from the e4m3 bytes of W.

Weight: `w_q` float8_e4m3fn [N, K], the release's [out, in] orientation, and `w_scale` float32
[ceil((n_offset + N) / 128), ceil((k_offset + K) / 128)], with W[n, k] = w_q[n, k] * w_scale[(n_offset + n) // 128,
(k_offset + k) // 128]. [out, in] is kept (not our bf16 layout's [in, out]) because Hopper's FP8 MMA wants both
operands K-major, a decode tile of a few output rows is then a run of whole contiguous rows, and a loader only
slices the release's tensors (no transpose of a 1-byte array). Edge blocks are ragged (N, K need not be multiples
of 128).

TP shards: pass the shard's local slice of `w_q` and the sub-grid of scales covering it; `n_offset` / `k_offset`
say where the slice's first row / column sits inside the first block of that sub-grid (0 for shards on 128
boundaries, every GLM-5.2 shard at TP <= 8). An offset may be a Python int (the scale grid's shape is then checked
exactly) or a traced int32 scalar (under `shard_map` each rank's offset is `axis_index * shard % 128`, and the
grid passed is the largest any rank needs: ceil((127 + N) / 128) blocks, checked as a range).

Forms:
  "w8a16": the e4m3 weight tile becomes x.dtype in registers (exact: e4m3 fits bf16/f16/f32), the dot accumulates
           in float32 per K step, and each step's partial is scaled by its block's weight scale
           (= x @ (w_q * s)^T in exact arithmetic). Decode: the weight bytes are the cost.
  "w8a8":  x is quantised per token per 128-column block of the weight (`fp8_formats.quantize_activation_blocks`:
           s_a = amax / 448, a_q = e4m3(x / s_a)); each block's e4m3 x e4m3 partial is promoted to float32 and
           scaled by s_a[t, g] * s_w[n // 128, g]. Prefill: FP8 tensor-core FLOPs.
The output is x.dtype (float32 accumulation). impl "xla" is the reference: both operands dequantised to float32
(the same quantised values; only float32 rounding differs from the blocked sums), one float32 matmul.
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import registry
from ..common.fp8_formats import FP8, WEIGHT_BLOCK, block_count
from .reference import fp8_linear_xla

FORMS = ("w8a16", "w8a8")
# rows from which a model's FP8 linear dequantises its weight and runs XLA's GEMM (the Pallas Triton MMA path
# reached about half of cuBLAS's bf16 FLOP rate at prefill sizes, W8A8 included; BENCHMARKS.md, FP8 weights)
DEQUANT_ROWS = 64


def _is_static(offset) -> bool:
    return isinstance(offset, int) and not isinstance(offset, bool)


def check_offset(name: str, offset, what: str = "fp8_linear") -> None:
    """An offset is an int in [0, 128) or an integer scalar array (traced: checked by the grid's range)."""
    if _is_static(offset):
        if not 0 <= offset < WEIGHT_BLOCK:
            raise ValueError(f"{what}: {name} {offset} must be in [0, {WEIGHT_BLOCK}) (the position of the local "
                             "slice's first row/column inside its first scale block)")
        return
    if not (hasattr(offset, "dtype") and jnp.issubdtype(offset.dtype, jnp.integer) and jnp.ndim(offset) == 0):
        raise TypeError(f"{what}: {name} must be an int or an integer scalar array, got {offset!r}")


def check_scale_grid(what: str, scale, rows: int, cols: int, row_offset=0, col_offset=0, lead=()) -> None:
    """Refuse a scale grid of the wrong dtype or shape for a weight of `rows` x `cols` (after `lead` axes) whose
    local slice starts at the given offsets (TypeError for the dtype, ValueError naming the shapes)."""
    if jnp.dtype(scale.dtype) != jnp.float32:
        raise TypeError(f"{what}: the scale grid must be float32, got {scale.dtype} (shape {tuple(scale.shape)})")
    if tuple(scale.shape[:-2]) != tuple(lead) or scale.ndim != len(lead) + 2:
        raise ValueError(f"{what}: scale grid {tuple(scale.shape)} must be [{', '.join(map(str, lead))}"
                         f"{', ' if lead else ''}row_blocks, col_blocks] for the weight's {rows} x {cols}")
    for axis, n, off, name in ((-2, rows, row_offset, "row"), (-1, cols, col_offset, "column")):
        got = scale.shape[axis]
        if _is_static(off):
            want = block_count(n, off)
            if got != want:
                raise ValueError(f"{what}: scale grid {tuple(scale.shape)} has {got} {name} blocks; {n} {name}s "
                                 f"from offset {off} need ceil(({off} + {n}) / {WEIGHT_BLOCK}) = {want}")
        else:
            lo, hi = block_count(n, 0), block_count(n, WEIGHT_BLOCK - 1)
            if not lo <= got <= hi:
                raise ValueError(f"{what}: scale grid {tuple(scale.shape)} has {got} {name} blocks; {n} {name}s "
                                 f"from a traced offset need between {lo} and {hi}")


def fp8_linear(x, w_q, w_scale, *, form: str = "w8a16", impl: str = "xla", n_offset=0, k_offset=0,
               w_layout: str = "nk", **kernel_options):
    """x.dtype [..., N]: ``x @ W^T`` for x [..., K] (float) and the block-scaled e4m3 weight `w_q` [N, K] with
    `w_scale` float32 [ceil((n_offset + N) / 128), ceil((k_offset + K) / 128)] (see the module docstring for the
    offsets of TP shards and the two forms). `w_layout` "kn": `w_q` is [K, N] and `w_scale` [K-blocks, N-blocks]
    (the model's [in, out] layout, so a loader never transposes), and the result is ``x @ W``.

    form: "w8a16" | "w8a8". impl (`kernels.registry`): "xla" (the float32 reference), "triton" (the Pallas
    kernel reading the e4m3 bytes), "triton_interpret" (that kernel interpreted: CPU tests). `kernel_options`
    go to `triton.fp8_matmul` (config, bm, bn, bk, k_split, num_warps, num_stages)."""
    if form not in FORMS:
        raise ValueError(f"fp8_linear: unknown form {form!r} (available: {', '.join(FORMS)})")
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype) == FP8 or x.ndim < 1:
        raise TypeError(f"fp8_linear: x must be a float16/bfloat16/float32 array [..., K], got {x.dtype} "
                        f"{tuple(x.shape)}")
    if w_layout not in ("nk", "kn"):
        raise ValueError(f"fp8_linear: unknown w_layout {w_layout!r} (available: nk, kn)")
    kn = w_layout == "kn"
    axes = "[K, N]" if kn else "[N, K]"
    if jnp.dtype(w_q.dtype) != FP8:
        raise TypeError(f"fp8_linear: w_q must be float8_e4m3fn {axes}, got {w_q.dtype} {tuple(w_q.shape)}")
    if w_q.ndim != 2 or w_q.shape[0 if kn else 1] != x.shape[-1]:
        raise ValueError(f"fp8_linear: w_q {tuple(w_q.shape)} must be {axes} with K = x's last axis "
                         f"({tuple(x.shape)})")
    check_offset("n_offset", n_offset)
    check_offset("k_offset", k_offset)
    if kn:
        k, n = w_q.shape
        check_scale_grid("fp8_linear", w_scale, k, n, k_offset, n_offset)
    else:
        n, k = w_q.shape
        check_scale_grid("fp8_linear", w_scale, n, k, n_offset, k_offset)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    y = registry.dispatch("fp8_linear", impl, x2, w_q, w_scale, form=form, n_offset=n_offset, k_offset=k_offset,
                          w_layout=w_layout, **kernel_options)
    return y.reshape(*lead, n)


def _triton_supports(x, w_q, w_scale, *, form="w8a16", **_):
    """The kernel takes float16/bfloat16/float32 rows (float32 W8A16 dots are IEEE float32) and non-empty operands."""
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        return f"x dtype {x.dtype} (want bfloat16, float16 or float32)"
    if x.shape[0] == 0 or w_q.shape[0] == 0 or w_q.shape[1] == 0:
        return f"empty operands x {tuple(x.shape)}, w_q {tuple(w_q.shape)}"
    return None


registry.register("fp8_linear", "xla", fp8_linear_xla)
registry.register_triton("fp8_linear", "kernels.fp8_linear.triton:fp8_matmul", supports=_triton_supports)
def _model_form(platform: str, x, *, impl: str) -> str:
    """A model's FP8 linear layer: "dequant" from DEQUANT_ROWS rows under a kernel impl, else "fp8_linear".

    "dequant": the weight dequantised to x's dtype, then XLA's GEMM; "fp8_linear": this op (W8A16 reads the e4m3
    bytes, the weight bytes being the cost at decode sizes), and always under impl "xla" (the float32 reference)."""
    del platform  # by rows and impl, as the model asked for them
    return "dequant" if impl != "xla" and x.shape[0] >= DEQUANT_ROWS else "fp8_linear"


registry.register_auto("fp8_linear")
def _model_form_invariant(platform: str, x, *, impl: str) -> str:
    """Batch-invariant decode steps: always this op ("fp8_linear"), whose rows are independent and whose launch
    config is fixed (`registry.config_rows`).

    Prompt steps take the default (`registry.DEFAULT`): "dequant" under a kernel impl at their rows (x's rows are
    the step's static padded rows), the weight dequantised to x's dtype (no rows involved) and then XLA's GEMM at
    that one shape, which is the form of every bf16 weight's projection in the mode: one compiled algorithm per
    shape, whose tiles and K split give each row the same K order wherever it sits and whatever the other rows
    hold."""
    del platform, x, impl
    return "fp8_linear"


registry.register_rule("fp8_linear.model_form", "fp8_linear", _model_form, ("dequant", "fp8_linear"),
                       invariant=_model_form_invariant, invariant_prompt=registry.DEFAULT)
