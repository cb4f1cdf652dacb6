"""Routed SwiGLU experts (docs/math.md §2, MoE): y[t] = sum_j w[t, j] * down_e(silu(x[t] gate_e) * (x[t] up_e)),
e = experts[t, j].

Weights: gate, up [E, D, I]; down [E, I, D] (I is this shard's slice under TP). Returns float32 [T, D].

Forms (`mode`, impl="xla"), each reading weights differently:
  "gather": gather the chosen experts' weights per (token, expert) pair: cheapest for a few pairs (decode, B = 1);
  "dense":  every expert over every token, masked by the routing weights: reads each expert once (mid batch);
  "tiles":  pairs sorted by expert into tiles of one expert each, one GEMM chain per tile in a scan (prefill);
  "ragged": one `jax.lax.ragged_dot` per projection (XLA's GPU lowering materialises a dense
            [rows, experts x width] product: kept as an option, not picked).
impl="triton" runs the same tile layout (kernels/moe/tiles.py) as one grouped-GEMM Pallas kernel per projection
(kernels/moe/triton.py):
each non-empty tile reads its expert's weights once, so a decode step reads only the experts it uses.
FP8 experts (e4m3 weights with float32 128 x 128 block scales, docs/math.md §11): `routed_experts(...,
wg_scale=, wu_scale=, wd_scale=, i_offset=)`; the kernels read the e4m3 bytes (W8A16: each tile dequantised in
registers), the xla forms run over the experts dequantised to float32 (the reference). `w_layout="nk"`: FP8
experts stored K-major (each expert in the release's [out, in] form, the scale grids untransposed).
impl="mosaic" runs FP8 K-major experts of whole blocks through the Pallas Mosaic GPU W8A8 grouped GEMM
(kernels/fp8_gemm/experts.py: e4m3 x e4m3 wgmma, SwiGLU fused into the gate/up GEMM; "mosaic_interpret" under the
interpreter); it is also the FP8 form "w8a8_mosaic" of the kernel impls, which the rule "moe.fp8_form" picks on a
GPU only for the row classes named in `MOSAIC_ROWS` (prompt steps by default) or the environment's
GLM_DSA_MOE_MOSAIC.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import registry
from ..common.fp8_formats import FP8, dequantize_weight_blocks
from ..fp8_linear import check_offset, check_scale_grid
from .reference import DENSE_MAX_TOKENS, MODES, experts_xla, pick_mode  # noqa: F401
from .tiles import tile_rows


def _xla_form(platform: str, t: int, k: int, n_exp: int) -> str:
    """"gather" for a few (token, expert) pairs, "dense" up to DENSE_MAX_TOKENS rows, "tiles" beyond."""
    del platform  # the xla forms are chosen by shape alone
    if t * k <= n_exp // 4:
        return "gather"
    return "dense" if t <= DENSE_MAX_TOKENS else "tiles"


def routed_experts(x, experts, weights, wg, wu, wd, *, impl: str = "xla", mode: str | None = None,
                   wg_scale=None, wu_scale=None, wd_scale=None, i_offset=0, w_layout: str = "kn", **kernel_options):
    """float32 [T, D]: the routed SwiGLU experts of rows `x` [T, D] at `experts` [T, k] (int) with routing
    `weights` [T, k]; gate/up [E, D, I], down [E, I, D].

    An expert id outside [0, E) (the model's sentinel E, one past the last expert, for a padding row) marks a
    pair computed nowhere: it is in no tile or group of any impl and contributes exactly 0, whatever its weight
    and its row of x (NaN included); a row with no routed pair comes out 0. The routed pairs' results are the
    same, bit for bit, as with the unrouted pairs absent. The registry's rules are unaffected: they choose from
    the static shapes (T padded rows), not from how many pairs are routed.

    impl (`kernels.registry`): "xla" (the forms above), "triton" (the grouped-GEMM Pallas kernel, any widths),
    "triton_interpret" (that kernel interpreted: CPU tests), "mosaic" /
    "mosaic_interpret" (FP8 K-major experts of whole blocks through the Mosaic GPU W8A8 grouped GEMM,
    `kernels.fp8_gemm.experts`; the form "w8a8_mosaic" of the kernel impls runs the same, natively or interpreted
    as the impl is, with the option `layout` "grouped" / "swap_ab", default the rule "moe.mosaic_layout", and
    `up_config` / `down_config`). `mode` forces one xla form whatever `impl` says
    (the model's switch for comparing forms). `kernel_options` go to `triton.grouped_swiglu` (config, tile,
    bn_up, bk_up, bn_down, bk_down, num_warps, num_stages, k_split, packed; for FP8 experts `form`, one of
    `FP8_FORMS`, default `fp8_form` by shape).

    FP8 experts (docs/math.md §11): gate/up/down float8_e4m3fn in the layout above (the HF [out, in] experts
    transposed and stacked, as `checkpoints.layout` does) with float32 block scales in the same orientation:
    `wg_scale`, `wu_scale` [E, ceil(D / 128), ceil((i_offset + I) / 128)], `wd_scale` [E, ceil((i_offset + I) /
    128), ceil(D / 128)] (the HF `weight_scale_inv` grids transposed and stacked). `i_offset` (an int in [0, 128)
    or a traced int32 scalar): where this TP shard's expert-width slice starts inside its first scale block.
    The kernels read the e4m3 bytes (`fp8_form`: W8A8 or W8A16 per shape) or, for prefill, run over the experts
    dequantised in x's dtype; "xla" is the float32 reference.

    `w_layout` "nk" (FP8 experts only; bf16/float32 experts are always "kn"): K-major stacks, each expert in the
    HF release's [out, in] form, gate/up [E, I, D] and down [E, D, I], with their scale grids in the same
    orientation (the HF grids stacked, not transposed): `wg_scale`, `wu_scale` [E, ceil((i_offset + I) / 128),
    ceil(D / 128)], `wd_scale` [E, ceil(D / 128), ceil((i_offset + I) / 128)]; `i_offset` as above (on the width
    axis, wherever it lies). The result is the same function of the same dequantised experts. Per path:
      xla (impl "xla" or a forced `mode`): the reference, over the stacks and grids swapped back to "kn";
      form "w8a8" (decode tiles of whole blocks): the kernels read the K-major bytes and grids as given (Hopper's
        fp8 MMA takes K-major B without a transpose);
      form "dequant" (prefill tiles): the experts dequantised in x's dtype in their stored orientation and
        swapped to "kn" (behind the same barrier as "kn" experts), then the bf16 kernels;
      form "w8a16" (ragged widths, a shard starting mid-block, or asked for): a "kn" copy of the stacks and grids
        per call, then the W8A16 kernels (see `_nk_to_kn`)."""
    if w_layout not in ("kn", "nk"):
        raise ValueError(f"moe: w_layout {w_layout!r} is not one of 'kn', 'nk'")
    nk = w_layout == "nk"
    if nk:
        e, i, d = wg.shape
        want = "gate/up [E, I, D], down [E, D, I] (w_layout 'nk')"
    else:
        e, d, i = wg.shape
        want = "gate/up [E, D, I], down [E, I, D]"
    if x.shape[-1] != d or wu.shape != wg.shape or wd.shape != ((e, d, i) if nk else (e, i, d)):
        raise ValueError(f"moe: x {x.shape}, gate {wg.shape}, up {wu.shape}, down {wd.shape} do not agree "
                         f"(want x [T, D], {want})")
    if experts.shape != weights.shape or experts.shape[0] != x.shape[0]:
        raise ValueError(f"moe: experts {experts.shape} and weights {weights.shape} must both be [T={x.shape[0]}, k]")
    fp8 = _check_fp8(x, wg, wu, wd, wg_scale, wu_scale, wd_scale, i_offset, nk)
    # "auto" -> the concrete impl, before the branches below read it
    impl = registry.resolve("moe", impl, x, experts, weights, wg, wu, wd, w_layout=w_layout, **fp8)
    if nk and (mode is not None or impl == "xla"):  # the xla reference: over the stacks swapped back to "kn"
        wg, wu, wd, fp8 = _nk_to_kn(wg, wu, wd, fp8)
        nk = False
    if mode is not None:
        if kernel_options:
            raise ValueError(f"moe: mode {mode!r} forces an xla form, which takes no kernel options "
                             f"({sorted(kernel_options)})")
        registry.get("moe", impl)  # an unknown impl is an error even when `mode` overrides it
        return experts_xla(x, experts, weights, wg, wu, wd, mode=mode, **fp8)
    if fp8 and impl != "xla":
        form = kernel_options.pop("form", None)
        if form is None:
            form = "w8a8_mosaic" if impl in MOSAIC_IMPLS else fp8_form(
                experts.shape[0], experts.shape[1], e, d, i, fp8["i_offset"], w_layout=w_layout)
        if form not in FP8_FORMS:
            raise ValueError(f"moe: form {form!r} is not one of {', '.join(map(repr, FP8_FORMS))}")
        if impl in MOSAIC_IMPLS and form != "w8a8_mosaic":
            raise ValueError(f"moe: impl {impl!r} runs form 'w8a8_mosaic' only; form {form!r} is the Triton kernels'")
        if form == "w8a8_mosaic":  # the Mosaic GPU W8A8 grouped GEMM (kernels/fp8_gemm/experts.py)
            if impl not in MOSAIC_IMPLS:  # a kernel impl asked for the form (or the rule chose it): the same run mode
                impl = "mosaic_interpret" if impl.endswith("_interpret") else "mosaic"
            layout = kernel_options.pop("layout", None) or mosaic_layout(experts.shape[0], experts.shape[1], e)
            kernel_options.setdefault("config_rows", registry.config_rows(experts.shape[0]))
            return registry.dispatch("moe", impl, x, experts, weights, wg, wu, wd, w_layout=w_layout, layout=layout,
                                     **fp8, **kernel_options)
        if form == "dequant":  # prefill: the bf16 kernels over the experts dequantised in x's dtype
            # the barrier ties the weights to this layer's rows: without it XLA dequantises every layer's experts
            # at the start of the step (they depend on nothing), all alive at once (55 GiB at TP = 1: OOM)
            x, wg, wu, wd = jax.lax.optimization_barrier((x, wg, wu, wd))
            off = fp8["i_offset"]
            # (row, column) offsets of each grid: the width axis is I, columns of gate/up and rows of down in
            # "kn", the other way round in "nk"
            offsets = ((off, 0), (off, 0), (0, off)) if nk else ((0, off), (0, off), (off, 0))
            wg, wu, wd = (dequantize_weight_blocks(w, fp8[n], r, c, x.dtype, convert=True) for w, n, (r, c) in
                          zip((wg, wu, wd), ("wg_scale", "wu_scale", "wd_scale"), offsets))
            if nk:  # the bf16 kernels take [E, K, N] stacks (a swap XLA can fuse into the dequantising pass)
                wg, wu, wd = (jnp.swapaxes(w, 1, 2) for w in (wg, wu, wd))
            return registry.dispatch("moe", impl, x, experts, weights, wg, wu, wd, **kernel_options)
        if nk and form == "w8a8":
            kernel_options["w_layout"] = "nk"
        elif nk:  # W8A16 reads [E, K, N] stacks only
            wg, wu, wd, fp8 = _nk_to_kn(wg, wu, wd, fp8)
        kernel_options["form"] = form
    return registry.dispatch("moe", impl, x, experts, weights, wg, wu, wd, **fp8, **kernel_options)


def _nk_to_kn(wg, wu, wd, fp8: dict):
    """K-major FP8 stacks (gate/up [E, I, D], down [E, D, I]) and their grids -> the [E, K, N] form (gate/up
    [E, D, I], down [E, I, D], grids swapped alike). A full transposed copy of every expert per call: only the
    xla reference and the W8A16 kernels take it, and W8A16 is picked for ragged widths or a shard starting
    mid-block only (the test models, GLM-5.2 at TP >= 32), where that cost is accepted; the production shapes run
    W8A8 on the K-major bytes (decode) or dequantise in one pass (prefill)."""
    wg, wu, wd = (jnp.swapaxes(w, 1, 2) for w in (wg, wu, wd))
    fp8 = dict(fp8, **{n: jnp.swapaxes(fp8[n], 1, 2) for n in ("wg_scale", "wu_scale", "wd_scale")})
    return wg, wu, wd, fp8


FP8_FORMS = ("w8a8", "w8a16", "dequant", "w8a8_mosaic")
MOSAIC_IMPLS = ("mosaic", "mosaic_interpret")

#: The row classes for which the rule "moe.fp8_form" picks "w8a8_mosaic" (the Mosaic GPU W8A8 grouped GEMM,
#: kernels/fp8_gemm) on a GPU, for FP8 K-major experts of whole blocks: "prefill" (tiles of 64+ rows per expert, else
#: "dequant") and "decode" (else "w8a8", the Triton kernels): THE switch of the GPU default. "prefill": faster than
#: "dequant" in the engine's FP8 prefill (BENCHMARKS.md, End to end); not "decode", where the Triton W8A8 kernels
#: are faster (BENCHMARKS.md, Experts and FP8 GEMMs). The environment variable GLM_DSA_MOE_MOSAIC ("prefill",
#: "decode", "prefill,decode" or "none") overrides it for a run (read when a step is traced), so an engine benchmark
#: can compare both forms.
MOSAIC_ROWS: frozenset = frozenset({"prefill"})
MOSAIC_ENV = "GLM_DSA_MOE_MOSAIC"


def mosaic_rows() -> frozenset:
    """The row classes whose FP8 experts run "w8a8_mosaic" on a GPU: GLM_DSA_MOE_MOSAIC if set, else
    `MOSAIC_ROWS` (`registry.switched_rows`)."""
    return registry.switched_rows(MOSAIC_ENV, MOSAIC_ROWS, "moe")


def fp8_form(t: int, k: int, n_exp: int, d: int, i: int, i_offset, *, w_layout: str = "kn") -> str:
    """How the grouped-GEMM kernels compute FP8 experts at T rows of k experts each: the rule "moe.fp8_form"."""
    return registry.decide("moe.fp8_form", t, k, n_exp, d, i, i_offset, w_layout=w_layout)


def _fp8_form(platform: str, t: int, k: int, n_exp: int, d: int, i: int, i_offset, *, w_layout: str = "kn") -> str:
    """"w8a8" for decode tiles, "dequant" for prefill tiles, "w8a16" for ragged shards; "w8a8_mosaic" where set.

    "w8a8_mosaic" is picked on a GPU only where `mosaic_rows()` names the row class.

    Decode-sized tiles (under 64 rows) of whole 128-blocks on a block boundary take "w8a8" (rows quantised per
    128-block, e4m3 x e4m3 on the fp8 tensor cores: faster than the bf16 kernel there, where W8A16's in-register
    conversion is slower than bf16); prefill-sized tiles take "dequant" (the experts dequantised in x's dtype,
    then the bf16 kernels: both FP8 Triton kernels run well under the bf16 kernel's rate there); ragged widths or
    a shard starting mid-block take "w8a16" (BENCHMARKS.md, FP8 weights). "w8a8_mosaic" (the Mosaic GPU W8A8
    grouped GEMM: grouped row tiles for prefill, swap-AB tiles for decode, rule "moe.mosaic_layout") replaces
    "dequant" / "w8a8" for K-major stacks (w_layout "nk", the model's) on a GPU only for the row classes in
    `MOSAIC_ROWS` (prompt steps) or GLM_DSA_MOE_MOSAIC."""
    aligned = isinstance(i_offset, int) and i_offset == 0 and d % 128 == 0 and i % 128 == 0
    if not aligned:
        return "w8a16"
    rows = "prefill" if tile_rows(t, k, n_exp) >= 64 else "decode"
    if platform == "gpu" and w_layout == "nk" and rows in mosaic_rows():
        return "w8a8_mosaic"
    return "dequant" if rows == "prefill" else "w8a8"


def mosaic_layout(t: int, k: int, n_exp: int) -> str:
    """The tile layout of the Mosaic W8A8 experts at T rows of k experts each: the rule "moe.mosaic_layout"."""
    return registry.decide("moe.mosaic_layout", t, k, n_exp)


def _mosaic_layout(platform: str, t: int, k: int, n_exp: int) -> str:
    """"grouped" (128-row tiles, rows on wgmma's M side) for prefill-sized tiles, "swap_ab" (weights on M) below.

    Tiles of 64+ rows per expert (as "moe.fp8_form" counts them) fill wgmma's 64-row M side with rows; fewer rows
    per expert would leave most of it idle, so the weights go there and the rows on its N side (8 to 64)."""
    del platform
    return "grouped" if tile_rows(t, k, n_exp) >= 64 else "swap_ab"


def _check_fp8(x, wg, wu, wd, wg_scale, wu_scale, wd_scale, i_offset, nk: bool = False) -> dict:
    """{} for bf16/float32 experts; the scale keywords for FP8 ones, after checking every weight is e4m3 with its
    float32 scale grid of the right shape for the layout (`nk`: K-major stacks and grids) (TypeError /
    ValueError naming the tensor)."""
    names = ("gate", "up", "down")
    ws, scales = (wg, wu, wd), (wg_scale, wu_scale, wd_scale)
    is_fp8 = [jnp.dtype(w.dtype) == FP8 for w in ws]
    if nk and not any(is_fp8):
        raise ValueError(f"moe: w_layout 'nk' is for FP8 experts (float8_e4m3fn); these are {wg.dtype}, "
                         "which take the 'kn' layout")
    if not any(is_fp8):
        given = [f"{n}_scale" for n, s in zip(names, scales) if s is not None]
        if given:
            raise ValueError(f"moe: {', '.join(given)} given but the experts are {wg.dtype}, not float8_e4m3fn "
                             "(a scale without its FP8 weight)")
        if not (isinstance(i_offset, int) and i_offset == 0):
            raise ValueError(f"moe: i_offset {i_offset!r} applies to FP8 experts only")
        return {}
    if not all(is_fp8):
        raise TypeError(f"moe: FP8 experts need gate, up and down all float8_e4m3fn, got {wg.dtype}, {wu.dtype}, "
                        f"{wd.dtype}")
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype) == FP8:
        raise TypeError(f"moe: x must be float16/bfloat16/float32 with FP8 experts, got {x.dtype}")
    missing = [f"{n}_scale" for n, s in zip(names, scales) if s is None]
    if missing:
        raise ValueError(f"moe: FP8 experts without their block scales: {', '.join(missing)} missing")
    check_offset("i_offset", i_offset, "moe")
    e = wg.shape[0]
    for n, w, s in zip(names, ws, scales):
        # the offset sits on the width axis: gate/up columns and down rows in "kn", the other way round in "nk"
        width_rows = (n == "down") != nk
        rows, cols = w.shape[1:]
        roff, coff = (i_offset, 0) if width_rows else (0, i_offset)
        check_scale_grid(f"moe: {n}_scale", s, rows, cols, roff, coff, lead=(e,))
    return dict(wg_scale=wg_scale, wu_scale=wu_scale, wd_scale=wd_scale, i_offset=i_offset)


def _choose(platform: str, x, experts, weights, wg, wu, wd, *, w_layout: str = "kn", **fp8) -> str:
    """The Triton grouped GEMM on a GPU, xla elsewhere."""
    del x, experts, weights, wg, wu, wd, w_layout, fp8
    return "triton" if platform == "gpu" else "xla"


registry.register("moe", "xla", experts_xla)
registry.register_triton("moe", "kernels.moe.triton:grouped_swiglu")
def _xla_form_invariant(platform: str, t: int, k: int, n_exp: int) -> str:
    """Batch-invariant mode: "gather" for every row count (each (row, expert) pair on its own, the k results
    summed in a fixed order), never the dense form's sum over every expert that more rows switch to.

    Prompt steps too (no `invariant_prompt`): the default there, "tiles", adds each token's k pair results back
    with a scatter-add over repeated token indices, which XLA's GPU scatter runs in atomics order (so does
    "ragged"), not batch-independent; "dense" would be at a fixed shape, but holds [T, experts, width]. The xla
    forms are the reference (the CPU's impl), not the GPU's prefill path, so their cost there is not the mode's."""
    del platform, t, k, n_exp
    return "gather"


def _fp8_form_invariant(platform: str, t: int, k: int, n_exp: int, d: int, i: int, i_offset, *,
                        w_layout: str = "kn") -> str:
    """Batch-invariant decode steps: "w8a8" for every row count where the shard is of whole 128-blocks on a block
    boundary, else "w8a16" (as `_fp8_form` for decode tiles), not the forms the mean rows per expert picks.

    "w8a8" quantises each row per 128-block by its own amax and reads K-major stacks (the model's) as they are
    stored; "w8a16" reads [E, K, N] stacks only, so for the model's K-major experts it would cost a transposed
    copy of every expert per step (on an H100, 20 ms of each 4-layer bench-preset decode step: BENCHMARKS.md,
    batch-invariant mode's cost).

    Prompt steps take the default (`registry.DEFAULT`): the form of `_fp8_form` for T, the step's static padded
    rows (`experts.shape[0]`), through `tile_rows(T, k, n_exp)`, the MEAN rows per expert of T padded rows, a
    static number, never the real rows an expert got; at GLM-5.2's 8192 rows, 8 of 256 experts: 128-row tiles,
    "dequant". Each form is batch-independent at a fixed T: "dequant" dequantises the weights (no rows involved)
    and runs the bf16 grouped GEMM; "w8a8" quantises each row per 128-block by its own amax (x before the up
    kernel, h in it or between the kernels); "w8a8_mosaic" the same, through the Mosaic grouped GEMM (only where
    `mosaic_rows()` names prefill). In every one the expert tiles' boundaries move with how many rows each expert
    got, but a row's K steps (bk_up, bk_down, fixed by the launch config, `registry.config_rows`) run in one order
    whatever tile or tile position it lands in, split-K partials (decode configs only) are summed in split order,
    and each token's k pair results are summed in a fixed order in XLA."""
    del platform, t, k, n_exp, w_layout
    aligned = isinstance(i_offset, int) and i_offset == 0 and d % 128 == 0 and i % 128 == 0
    return "w8a8" if aligned else "w8a16"


def _mosaic_layout_invariant(platform: str, t: int, k: int, n_exp: int) -> str:
    """Batch-invariant decode steps (impl "mosaic" asked for by name): "swap_ab" for every row count. Prompt steps
    take the default (`registry.DEFAULT`): by `tile_rows` of the step's static padded rows ("grouped" at 8192
    rows of GLM-5.2); both layouts compute a row's K blocks in one order whatever tile it lands in."""
    del platform, t, k, n_exp
    return "swap_ab"


registry.register_auto("moe", _choose, invariant=registry.ROW_FREE)
registry.register_rule("moe.xla_form", "moe", _xla_form, MODES, invariant=_xla_form_invariant)
registry.register_rule("moe.fp8_form", "moe", _fp8_form, FP8_FORMS, invariant=_fp8_form_invariant,
                       invariant_prompt=registry.DEFAULT)
registry.register_rule("moe.mosaic_layout", "moe", _mosaic_layout, ("grouped", "swap_ab"),
                       invariant=_mosaic_layout_invariant, invariant_prompt=registry.DEFAULT)
registry.register_mosaic("moe", "kernels.fp8_gemm.experts:routed_experts",
                         supports="kernels.fp8_gemm.experts:supports")
