"""A sum in a fixed order: what the kernels' wrappers use to add a few partials (split-K, a token's expert pairs)
outside a kernel, so that the order does not depend on the other axes' sizes."""

from __future__ import annotations

import functools

import jax.numpy as jnp


def ordered_sum(x, axis: int = 0):
    """x summed over `axis` as ((x[0] + x[1]) + x[2]) + ...: elementwise adds in index order, for a short axis
    (split-K partials, the k experts of a token). An XLA reduction would leave the order to the reduction emitter,
    which tiles by the whole shape (a row count among it): a batch-invariant decode step's row count is its bucket,
    and a row's sum must not follow it. In the dtype of `x`."""
    parts = [jnp.take(x, i, axis=axis) for i in range(x.shape[axis])]
    return functools.reduce(jnp.add, parts)
