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

impl "mosaic" ("mosaic_interpret" under the interpreter) runs form "w8a8" through the Pallas Mosaic GPU W8A8 grouped
GEMM with one group (`kernels.fp8_linear.mosaic`: 128-row tiles for prefill, swap-AB tiles for decode, rule
"fp8_linear.mosaic_layout"); the op "fp8_swiglu" (`fp8_swiglu`) is a SwiGLU MLP's gate and up as one such GEMM with
the SwiGLU epilogue. The model's FP8 linears take them as the form "w8a8_mosaic" of the rule "fp8_linear.model_form",
on a GPU only for the row classes named in `MOSAIC_ROWS` (prompt steps by default) or the environment's
GLM_DSA_FP8_LINEAR_MOSAIC.
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import registry
from ..common.fp8_formats import FP8, WEIGHT_BLOCK, block_count
from .reference import fp8_linear_xla, fp8_swiglu_xla

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


def check_linear(what: str, x, w_q, w_scale, form: str, w_layout: str, n_offset, k_offset) -> tuple[int, int]:
    """(K, N) of a linear's operands after refusing what `fp8_linear` does not take (TypeError for dtypes,
    ValueError naming the shapes, offsets, form or layout)."""
    if form not in FORMS:
        raise ValueError(f"{what}: unknown form {form!r} (available: {', '.join(FORMS)})")
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype) == FP8 or x.ndim < 1:
        raise TypeError(f"{what}: x must be a float16/bfloat16/float32 array [..., K], got {x.dtype} "
                        f"{tuple(x.shape)}")
    if w_layout not in ("nk", "kn"):
        raise ValueError(f"{what}: unknown w_layout {w_layout!r} (available: nk, kn)")
    kn = w_layout == "kn"
    axes = "[K, N]" if kn else "[N, K]"
    if jnp.dtype(w_q.dtype) != FP8:
        raise TypeError(f"{what}: w_q must be float8_e4m3fn {axes}, got {w_q.dtype} {tuple(w_q.shape)}")
    if w_q.ndim != 2 or w_q.shape[0 if kn else 1] != x.shape[-1]:
        raise ValueError(f"{what}: w_q {tuple(w_q.shape)} must be {axes} with K = x's last axis "
                         f"({tuple(x.shape)})")
    check_offset("n_offset", n_offset, what)
    check_offset("k_offset", k_offset, what)
    if kn:
        k, n = w_q.shape
        check_scale_grid(what, w_scale, k, n, k_offset, n_offset)
    else:
        n, k = w_q.shape
        check_scale_grid(what, w_scale, n, k, n_offset, k_offset)
    return k, n


def fp8_linear(x, w_q, w_scale, *, form: str = "w8a16", impl: str = "xla", n_offset=0, k_offset=0,
               w_layout: str = "nk", **kernel_options):
    """x.dtype [..., N]: ``x @ W^T`` for x [..., K] (float) and the block-scaled e4m3 weight `w_q` [N, K] with
    `w_scale` float32 [ceil((n_offset + N) / 128), ceil((k_offset + K) / 128)] (see the module docstring for the
    offsets of TP shards and the two forms). `w_layout` "kn": `w_q` is [K, N] and `w_scale` [K-blocks, N-blocks]
    (the model's [in, out] layout, so a loader never transposes), and the result is ``x @ W``.

    form: "w8a16" | "w8a8". impl (`kernels.registry`): "xla" (the float32 reference), "triton" (the Pallas
    kernel reading the e4m3 bytes), "triton_interpret" (that kernel interpreted: CPU tests), "mosaic" /
    "mosaic_interpret" (form "w8a8" only, offsets 0: the Mosaic GPU W8A8 grouped GEMM, `mosaic.fp8_matmul`).
    `kernel_options` go to `triton.fp8_matmul` (config, bm, bn, bk, k_split, num_warps, num_stages) or to
    `mosaic.fp8_matmul` (layout, default the rule "fp8_linear.mosaic_layout"; config; config_rows, default the
    registry's `config_rows`)."""
    k, n = check_linear("fp8_linear", x, w_q, w_scale, form, w_layout, n_offset, k_offset)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if impl in MOSAIC_IMPLS:
        kernel_options = _mosaic_options(x2.shape[0], kernel_options)
    y = registry.dispatch("fp8_linear", impl, x2, w_q, w_scale, form=form, n_offset=n_offset, k_offset=k_offset,
                          w_layout=w_layout, **kernel_options)
    return y.reshape(*lead, n)


def fp8_swiglu(x, w_gate, w_up, gate_scale, up_scale, *, impl: str = "xla", n_offset=0, k_offset=0,
               w_layout: str = "nk", **kernel_options):
    """x.dtype [..., N]: silu(x @ Wg^T) * (x @ Wu^T), a SwiGLU MLP's gate and up, both by the W8A8 rule (form
    "w8a8" of `fp8_linear`), the product formed in float32 and rounded once to x.dtype. The weights and grids as
    `fp8_linear` takes one (gate and up of one shape, one offset pair). impl: "xla" (`reference.fp8_swiglu_xla`),
    "mosaic" / "mosaic_interpret" (one Mosaic GPU grouped GEMM with the SwiGLU epilogue, `mosaic.fp8_swiglu`: offsets
    0; `kernel_options` layout, config, config_rows as for `fp8_linear`)."""
    _, n = check_linear("fp8_swiglu", x, w_gate, gate_scale, "w8a8", w_layout, n_offset, k_offset)
    check_linear("fp8_swiglu", x, w_up, up_scale, "w8a8", w_layout, n_offset, k_offset)
    if w_gate.shape != w_up.shape or gate_scale.shape != up_scale.shape:
        raise ValueError(f"fp8_swiglu: gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} (scale grids "
                         f"{tuple(gate_scale.shape)}, {tuple(up_scale.shape)}) must have one shape")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if impl in MOSAIC_IMPLS:
        kernel_options = _mosaic_options(x2.shape[0], kernel_options)
    y = registry.dispatch("fp8_swiglu", impl, x2, w_gate, w_up, gate_scale, up_scale, n_offset=n_offset,
                          k_offset=k_offset, w_layout=w_layout, **kernel_options)
    return y.reshape(*lead, n)


def _mosaic_options(t: int, options: dict) -> dict:
    """The Mosaic impls' options with the layout (rule "fp8_linear.mosaic_layout") and `config_rows` (the
    registry's, fixed in batch-invariant mode) filled in unless given."""
    options = dict(options)
    if options.get("layout") is None:
        options["layout"] = mosaic_layout(t)
    options.setdefault("config_rows", registry.config_rows(t))
    return options


def _triton_supports(x, w_q, w_scale, *, form="w8a16", **_):
    """The kernel takes float16/bfloat16/float32 rows (float32 W8A16 dots are IEEE float32) and non-empty operands."""
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        return f"x dtype {x.dtype} (want bfloat16, float16 or float32)"
    if x.shape[0] == 0 or w_q.shape[0] == 0 or w_q.shape[1] == 0:
        return f"empty operands x {tuple(x.shape)}, w_q {tuple(w_q.shape)}"
    return None


MOSAIC_IMPLS = ("mosaic", "mosaic_interpret")


def mosaic_supports(x, w_q, w_scale, *args, form: str = "w8a16", n_offset=0, k_offset=0, **_):
    """Why the Mosaic W8A8 GEMM cannot take these inputs (None when it can): form "w8a8" only (its one
    arithmetic), a shard starting on a block boundary (offsets the int 0), non-empty float16/bfloat16/float32 rows.
    Any widths: ragged ones are padded (`kernels.fp8_linear.mosaic`)."""
    del w_scale, args
    if form != "w8a8":
        return f"form {form!r}: the Mosaic kernel computes W8A8 only (form 'w8a8')"
    for name, off in (("n_offset", n_offset), ("k_offset", k_offset)):
        if not (_is_static(off) and off == 0):
            return f"{name} {off!r}: the Mosaic kernel takes shards starting on a 128-block boundary (offset 0)"
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        return f"x dtype {x.dtype} (want bfloat16, float16 or float32)"
    if x.shape[0] == 0 or w_q.shape[0] == 0 or w_q.shape[1] == 0:
        return f"empty operands x {tuple(x.shape)}, w_q {tuple(w_q.shape)}"
    return None


def _swiglu_supports(x, w_gate, w_up, gate_scale, up_scale, **kwargs):
    return mosaic_supports(x, w_gate, gate_scale, form="w8a8", **kwargs)


registry.register("fp8_linear", "xla", fp8_linear_xla)
registry.register_triton("fp8_linear", "kernels.fp8_linear.triton:fp8_matmul", supports=_triton_supports)
registry.register_auto("fp8_linear")
registry.register_mosaic("fp8_linear", "kernels.fp8_linear.mosaic:fp8_matmul", supports=mosaic_supports)
registry.register("fp8_swiglu", "xla", fp8_swiglu_xla)
registry.register_mosaic("fp8_swiglu", "kernels.fp8_linear.mosaic:fp8_swiglu", supports=_swiglu_supports)

MODEL_FORMS = ("dequant", "fp8_linear", "w8a8_mosaic")

#: The row classes for which the rule "fp8_linear.model_form" picks "w8a8_mosaic" (the Mosaic GPU W8A8 GEMM with one
#: group; a SwiGLU MLP's gate and up fused with the SwiGLU epilogue) on a GPU: "prefill" (DEQUANT_ROWS rows and
#: more, else "dequant") and "decode" (fewer, else "fp8_linear", the Triton W8A16 kernel): THE switch of the GPU
#: default for the dense FP8 linears. "prefill": with the routed experts' prompt steps on Mosaic as well, faster
#: than "dequant" in the engine's FP8 prefill (BENCHMARKS.md, End to end); decode keeps the Triton kernel (not
#: measured faster there). The environment variable GLM_DSA_FP8_LINEAR_MOSAIC ("prefill", "decode",
#: "prefill,decode" or "none") overrides it for a run (read when a step is traced). A switch of its own, not the
#: routed experts' (`kernels.moe.MOSAIC_ROWS`, GLM_DSA_MOE_MOSAIC): the dense linears have other shapes (one group,
#: the whole row count on one weight), pay a transpose of the model's [in, out] weight per call, and are measured
#: apart, so either may turn on without the other.
MOSAIC_ROWS: frozenset = frozenset({"prefill"})
MOSAIC_ENV = "GLM_DSA_FP8_LINEAR_MOSAIC"


def mosaic_rows() -> frozenset:
    """The row classes whose dense FP8 linears run "w8a8_mosaic" on a GPU: GLM_DSA_FP8_LINEAR_MOSAIC if set, else
    `MOSAIC_ROWS` (`registry.switched_rows`)."""
    return registry.switched_rows(MOSAIC_ENV, MOSAIC_ROWS, "fp8_linear")


def model_form(x, *, impl: str, n_offset=0, k_offset=0) -> str:
    """How a model's FP8 linear of rows x [T, K] computes: the rule "fp8_linear.model_form"."""
    return registry.decide("fp8_linear.model_form", x, impl=impl, n_offset=n_offset, k_offset=k_offset)


def _model_form(platform: str, x, *, impl: str, n_offset=0, k_offset=0) -> str:
    """"dequant" from DEQUANT_ROWS rows under a kernel impl, else "fp8_linear"; "w8a8_mosaic" where set.

    "dequant": the weight dequantised to x's dtype, then XLA's GEMM; "fp8_linear": this op (W8A16 reads the e4m3
    bytes, the weight bytes being the cost at decode sizes), and always under impl "xla" (the float32 reference).
    "w8a8_mosaic" (the Mosaic GPU W8A8 GEMM, one group: 128-row tiles for prefill, swap-AB tiles for decode, rule
    "fp8_linear.mosaic_layout"; a SwiGLU MLP's gate and up as one GEMM with the SwiGLU epilogue) replaces them under
    a kernel impl on a GPU only for the row classes in `MOSAIC_ROWS` (prompt steps) or
    GLM_DSA_FP8_LINEAR_MOSAIC, and only for shards starting on a 128-block boundary (offsets 0: every GLM-5.2
    shard at TP <= 8; the others keep "dequant" / "fp8_linear"). It transposes the model's [in, out] e4m3 weight
    per call (the kernel reads K-major operands) and pads widths that are not whole tiles (kv_a's 576 outputs)."""
    if impl == "xla":
        return "fp8_linear"
    rows = "prefill" if x.shape[0] >= DEQUANT_ROWS else "decode"
    aligned = all(_is_static(o) and o == 0 for o in (n_offset, k_offset))
    if platform == "gpu" and aligned and rows in mosaic_rows():
        return "w8a8_mosaic"
    return "dequant" if rows == "prefill" else "fp8_linear"


def _model_form_invariant(platform: str, x, *, impl: str, n_offset=0, k_offset=0) -> str:
    """Batch-invariant decode steps: always this op ("fp8_linear"), whose rows are independent and whose launch
    config is fixed (`registry.config_rows`).

    Prompt steps take the default (`registry.DEFAULT`): "dequant" under a kernel impl at their rows (x's rows are
    the step's static padded rows), the weight dequantised to x's dtype (no rows involved) and then XLA's GEMM at
    that one shape, which is the form of every bf16 weight's projection in the mode: one compiled algorithm per
    shape, whose tiles and K split give each row the same K order wherever it sits and whatever the other rows
    hold ("w8a8_mosaic" where switched on: one group, no split of K, each row's K order fixed by its config)."""
    del platform, x, impl, n_offset, k_offset
    return "fp8_linear"


def mosaic_layout(t: int) -> str:
    """The tile layout of the Mosaic W8A8 GEMM for a dense linear of `t` rows: the rule "fp8_linear.mosaic_layout"."""
    return registry.decide("fp8_linear.mosaic_layout", t)


def _mosaic_layout(platform: str, t: int) -> str:
    """"grouped" (128-row tiles, rows on wgmma's M side) from DEQUANT_ROWS rows, "swap_ab" (weights on M) below.

    64+ rows fill wgmma's 64-row M side; fewer would leave most of it idle, so the weight rows go there and the rows
    on its N side (8 to 64)."""
    del platform
    return "grouped" if t >= DEQUANT_ROWS else "swap_ab"


def _mosaic_layout_invariant(platform: str, t: int) -> str:
    """Batch-invariant decode steps (impl "mosaic" asked for by name): "swap_ab" for every row count. Prompt steps
    take the default at their static padded rows ("grouped"): tiles of one group hold rows by position, and each
    row's K order is the config's whatever the other rows hold."""
    del platform, t
    return "swap_ab"


registry.register_rule("fp8_linear.model_form", "fp8_linear", _model_form, MODEL_FORMS,
                       invariant=_model_form_invariant, invariant_prompt=registry.DEFAULT)
registry.register_rule("fp8_linear.mosaic_layout", "fp8_linear", _mosaic_layout, ("grouped", "swap_ab"),
                       invariant=_mosaic_layout_invariant, invariant_prompt=registry.DEFAULT)
