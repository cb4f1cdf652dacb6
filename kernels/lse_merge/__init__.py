"""Merge partial attention results by their log-sum-exp (docs/math.md §6): the identity of a split is (0, -inf)."""

from __future__ import annotations

import jax.numpy as jnp

from .. import registry


def merge_partials(o, lse, axis: int = 0):
    """Combine partials `o` [..., N, ..., D] / `lse` [..., N, ...] along `axis` (of lse; o has a trailing D).

    NaN or +inf lse count as empty (-inf). Returns (o, lse) with `axis` removed; an all-empty set gives
    (0, -inf) and never NaN. Computed in float32; o is returned in float32.
    """
    lse = lse.astype(jnp.float32)
    lse = jnp.where(jnp.isnan(lse) | (lse == jnp.inf), -jnp.inf, lse)
    m = jnp.max(lse, axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m)  # exp(-inf) = 0 for empty partials
    total = jnp.sum(w, axis=axis, keepdims=True)
    merged_lse = jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    scale = jnp.where(total > 0, w / jnp.where(total > 0, total, 1.0), 0.0)
    o_axis = axis if axis >= 0 else axis - 1
    o_merged = jnp.sum(jnp.where(scale[..., None] > 0, scale[..., None] * o.astype(jnp.float32), 0.0), axis=o_axis)
    return o_merged, jnp.squeeze(merged_lse, axis=axis)


def merge_splits(o, lse, *, impl: str = "xla", **kernel_options):
    """The merge of split-K partials o [N, T, H, R] / lse [N, T, H] over N (the attention kernels' second step):
    (o [T, H, R] float32, lse [T, H]). impl (`kernels.registry`): "xla" (`merge_partials(axis=0)`, the oracle),
    "triton" / "triton_interpret" (one Pallas Triton launch, `kernels.lse_merge.triton`; `kernel_options` are its
    launch fields), "auto" (the kernel on a GPU where it takes the partials, else xla)."""
    return registry.dispatch("lse_merge", impl, o, lse, **kernel_options)


def _merge_splits_xla(o, lse):
    return merge_partials(o, lse, axis=0)


def choose_impl(platform: str, o, lse, **kernel_options) -> str:
    """The Triton merge on a GPU where it takes the partials (one launch against XLA's five passes), else xla."""
    if platform != "gpu":
        return "xla"
    try:
        registry.check("lse_merge", "triton", o, lse)
        return "triton"
    except ValueError:
        return "xla"


registry.register("lse_merge", "xla", _merge_splits_xla)
registry.register_triton("lse_merge", "kernels.lse_merge.triton:merge_partials_triton",
                         supports="kernels.lse_merge.triton:supports")
registry.register_auto("lse_merge", choose_impl)
