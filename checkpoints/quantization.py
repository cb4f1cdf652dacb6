"""Which weights stay FP8 on the devices, and the leaves that makes (docs/math.md §11).

A weight kept in FP8 is two flat parameters: `path` (float8_e4m3fn, our layout and shape, sharded as the bf16
weight would be) and `path + "_scale"` (float32 block scales over its flattened input and output axes:
`layout.fp8_scale_shape`). Routed expert stacks are the exception: kept FP8 they are stored K-major, the
release's [E, out, in] with its scale grids [E, out-blocks, in-blocks] (`layout.kept_fp8_spec`), sharded as the
bf16 stack with its last two axes swapped. The plan is a frozenset of the kept paths, decided from `quantization`:
  None:   the checkpoint's own form: the linear weights it stores block-scaled stay FP8, the rest as stored;
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

QUANTIZATIONS = ("fp8", "none")
SCALE_SUFFIX = "_scale"
_DEQUANTIZED_AT_LOAD = re.compile(r"(.*\.)?attn\.kv_b_proj$")


def check_quantization(quantization) -> None:
    """None, "fp8" or "none"; anything else is a ValueError naming the choices."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None (the checkpoint's own form), 'fp8' or 'none', got "
                         f"{quantization!r}")


def scale_path(path: str) -> str:
    """The flat path of the scale grid of the FP8 weight at `path`."""
    return path + SCALE_SUFFIX


def fp8_eligible(spec: ParamSpec) -> bool:
    """Whether the model can compute from `spec` kept in FP8: a linear weight other than kv_b_proj."""
    return spec.fp8_grid is not None and not _DEQUANTIZED_AT_LOAD.match(spec.path)


def fp8_plan(specs: dict[str, ParamSpec], quantization, block_scaled: Callable[[ParamSpec], bool]
             ) -> frozenset[str]:
    """The paths kept FP8 under `quantization` (see the module doc); `block_scaled(spec)`: whether the checkpoint
    stores that parameter's tensors with block scales (asked only for quantization None)."""
    check_quantization(quantization)
    if quantization == "none":
        return frozenset()
    if quantization == "fp8":
        return frozenset(p for p, s in specs.items() if fp8_eligible(s))
    return frozenset(p for p, s in specs.items() if fp8_eligible(s) and block_scaled(s))


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
