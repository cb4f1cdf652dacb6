"""Which weights stay FP8 on the devices, and the leaves that makes (docs/math.md §11).

A weight kept in FP8 is two flat parameters: `path` (float8_e4m3fn, our layout and shape, sharded as the bf16
weight would be) and `path + "_scale"` (float32 block scales over its flattened input and output axes:
`layout.fp8_scale_shape`). Routed expert stacks are the exception: kept FP8 they are stored K-major, the
release's [E, out, in] with its scale grids [E, out-blocks, in-blocks] (`layout.kept_fp8_spec`), sharded as the
bf16 stack with its last two axes swapped. The plan (`QuantizationPlan`: a frozenset of the kept paths with the
setting that chose them) is decided once from `quantization` (`resolve_quantization` reads the argument):
  None:   the checkpoint's own form (setting "checkpoint"): the linear weights it stores block-scaled stay FP8, the
          rest as stored;
  "fp8":  every linear weight is quantised at load (128 x 128 blocks, the release's choice of tensors: all
          linear layers but embeddings, lm_head, router gate and indexer weights_proj, which have no FP8 form);
  "none": nothing: FP8 tensors are dequantised to the compute dtype (reference runs).
One exception in every plan: `kv_b_proj` (W_UK and W_UV of the absorbed attention) is dequantised once at load.
The absorbed form contracts it per head over the release's *output* axis (q_nope @ W_UK) as well as its input
axis (o @ W_UV), which a [K, N]-blocked GEMM kernel does not cover, and it is about 3% of a layer's bytes.
"""

from __future__ import annotations

import inspect
import re
from typing import Callable

from .layout import ParamSpec, fp8_scale_shape, kept_fp8_spec

#: the values `quantization` takes besides None (the checkpoint's own form)
QUANTIZATIONS = ("fp8", "none")
#: the setting None resolves to: a name, so that None (keep the checkpoint's form) and "none" (dequantise) differ
CHECKPOINT_FORM = "checkpoint"
SCALE_SUFFIX = "_scale"
_DEQUANTIZED_AT_LOAD = re.compile(r"(.*\.)?attn\.kv_b_proj$")


def resolve_quantization(quantization) -> str:
    """The one reading of a `quantization` argument: None -> "checkpoint" (the checkpoint's own form), "fp8" and
    "none" as they are, a `QuantizationPlan` -> its setting. Anything else (a typo, the string "None", a bool) is a
    ValueError naming `quantization` and the accepted values."""
    if quantization is None:
        return CHECKPOINT_FORM
    if isinstance(quantization, QuantizationPlan):
        return quantization.setting
    if isinstance(quantization, str) and quantization in QUANTIZATIONS:
        return quantization
    raise ValueError(f"quantization must be None (the checkpoint's own form), 'fp8' or 'none', got "
                     f"{quantization!r}")


def check_quantization(quantization) -> None:
    """None, "fp8", "none" or a `QuantizationPlan`; anything else is `resolve_quantization`'s ValueError."""
    resolve_quantization(quantization)


class QuantizationPlan(frozenset):
    """The quantization setting resolved once: the flat paths of the weights kept FP8 (the plan is that frozenset
    and compares equal to it) and `setting`, what chose them ("checkpoint", "fp8" or "none").

    Made by `fp8_plan` before anything is read but headers and metadata; `glm_dsa.load` makes one and hands it to
    the HF or orbax reader (`quantization=plan`), which load exactly those weights FP8 instead of deciding again;
    `python -m glm_dsa info` counts bytes from it.
    """

    def __new__(cls, paths=(), setting: str = "none"):
        if setting not in (CHECKPOINT_FORM, *QUANTIZATIONS):
            raise ValueError(f"QuantizationPlan setting must be one of {(CHECKPOINT_FORM, *QUANTIZATIONS)}, "
                             f"got {setting!r}")
        plan = super().__new__(cls, paths)
        plan.setting = setting
        return plan

    def __reduce__(self):
        return type(self), (frozenset(self), self.setting)

    def __repr__(self) -> str:
        return f"QuantizationPlan({self.setting!r}, {len(self)} FP8 weights)"

    def without_prefix(self, prefix: str) -> QuantizationPlan:
        """The plan less the paths under `prefix` (e.g. "mtp.": the nextn layer, which is always dequantised)."""
        return QuantizationPlan((p for p in self if not p.startswith(prefix)), self.setting)


def scale_path(path: str) -> str:
    """The flat path of the scale grid of the FP8 weight at `path`."""
    return path + SCALE_SUFFIX


def fp8_eligible(spec: ParamSpec) -> bool:
    """Whether the model can compute from `spec` kept in FP8: a linear weight other than kv_b_proj."""
    return spec.fp8_grid is not None and not _DEQUANTIZED_AT_LOAD.match(spec.path)


def fp8_plan(specs: dict[str, ParamSpec], quantization, block_scaled: Callable[[ParamSpec], bool]
             ) -> QuantizationPlan:
    """The `QuantizationPlan` of `quantization` (see the module doc) over `specs`; `block_scaled(spec)`: whether the
    checkpoint stores that parameter's tensors with block scales (asked only for quantization None). A plan given
    as `quantization` is the plan already decided: returned as it is."""
    if isinstance(quantization, QuantizationPlan):
        return quantization
    setting = resolve_quantization(quantization)
    if setting == "none":
        return QuantizationPlan((), setting)
    if setting == "fp8":
        return QuantizationPlan((p for p, s in specs.items() if fp8_eligible(s)), setting)
    return QuantizationPlan((p for p, s in specs.items() if fp8_eligible(s) and block_scaled(s)), setting)


def stored_leaves(specs: dict[str, ParamSpec], plan: frozenset[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every flat leaf the model holds under `plan`: path -> (shape, kind) with kind "fp8" (an e4m3 weight, in its
    stored form `layout.kept_fp8_spec`), "scale" (its float32 grid), "fp32" (kept float32) or "weight" (the
    compute dtype)."""
    out = {}
    for path, spec in specs.items():
        if path in plan:
            kept = kept_fp8_spec(spec)
            out[path] = (kept.shape, "fp8")
            out[scale_path(path)] = (fp8_scale_shape(kept), "scale")
        else:
            out[path] = (spec.shape, "fp32" if spec.fp32 else "weight")
    return out


def kept_sharding(sharding_for: Callable, path: str, spec: ParamSpec):
    """The sharding `sharding_for` gives the weight of the (logical) `spec` kept FP8, in its stored form
    (`kept_fp8_spec`): asked as `sharding_for(path, stored_shape, kept=True)` when the callback takes `kept`; a
    callback that knows only our [in, out] layout (`sharding_for(path, shape)`) is asked for that layout, and a
    NamedSharding it returns has its last two axes swapped for a K-major stack."""
    kept = kept_fp8_spec(spec)
    try:
        params = inspect.signature(sharding_for).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature: assume the full protocol
        params = ()
    if not params or any(p.name == "kept" or p.kind == p.VAR_KEYWORD for p in params):
        return sharding_for(path, kept.shape, kept=True)
    sharding = sharding_for(path, spec.shape)
    from jax.sharding import NamedSharding, PartitionSpec

    if not kept.kmajor or not isinstance(sharding, NamedSharding):
        return sharding
    axes = tuple(sharding.spec) + (None,) * (len(spec.shape) - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*axes[:-2], axes[-1], axes[-2]))
