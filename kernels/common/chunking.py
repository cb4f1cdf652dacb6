"""Run a per-row function over query rows in fixed-size chunks, bounding the workspace of long prefills."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def map_row_chunks(fn, args, chunk: int):
    """`fn(*args)` for arrays whose leading axis is T, evaluated `chunk` rows at a time.

    Rows are independent, so the result equals one call on all rows; T is padded up to a multiple of
    `chunk` with copies of row 0 and the padding is dropped.
    """
    t = args[0].shape[0]
    if t <= chunk:
        return fn(*args)
    n = -(-t // chunk)
    pad = n * chunk - t

    def split(a):
        if pad:
            a = jnp.concatenate([a, jnp.broadcast_to(a[:1], (pad,) + a.shape[1:])], axis=0)
        return a.reshape((n, chunk) + a.shape[1:])

    out = jax.lax.map(lambda xs: fn(*xs), tuple(split(a) for a in args))
    return jax.tree.map(lambda y: y.reshape((n * chunk,) + y.shape[2:])[:t], out)
