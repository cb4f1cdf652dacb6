"""Rotary position embedding (docs/math.md §2): interleaved pairs (GLM default) or neox halves."""

from __future__ import annotations

import jax.numpy as jnp


def rope_cos_sin(positions, dim: int, theta: float):
    """cos, sin of `positions * theta^(-2i/dim)` for i < dim/2, float32 [..., dim/2]."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    ang = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, cos, sin, *, interleave: bool = True):
    """Rotate the last axis of `x` (width dim) by the angles behind `cos`/`sin` ([..., dim/2], broadcastable).

    Interleaved: pairs (x[2i], x[2i+1]) -> (a cos - b sin, b cos + a sin), written back interleaved.
    Neox: pairs (x[i], x[i + dim/2]). Computed in float32, returned in x's dtype.
    """
    xf = x.astype(jnp.float32)
    if interleave:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(xf.shape)
    else:
        half = xf.shape[-1] // 2
        a, b = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return out.astype(x.dtype)
