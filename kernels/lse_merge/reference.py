"""The LSE merge of partial attention results (docs/math.md §6), in plain jnp: the DCP merge, the xla merge of
split-K partials, and the oracle of the Triton merge."""

from __future__ import annotations

import jax.numpy as jnp

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


def merge_splits_xla(o, lse):
    """The split-K merge as the op's xla impl: `merge_partials` over axis 0."""
    return merge_partials(o, lse, axis=0)
