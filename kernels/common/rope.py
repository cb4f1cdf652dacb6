"""Rotary position embedding (docs/math.md §2): interleaved pairs (GLM default) or neox halves, with plain
frequencies `theta^(-2i/dim)` or YaRN's blend of them (docs/math.md §13, DeepSeek-V3.2)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class YarnRope:
    """YaRN frequencies (HF `rope_type: yarn`): the plain frequencies `theta^(-2i/dim)` (extrapolation) blended
    with the same divided by `factor` (interpolation) by a linear ramp over the frequency index i between the
    dims that complete `beta_fast` and `beta_slow` rotations within `original_max_position_embeddings`.

    Passed where a rope base `theta` is taken (`rope_cos_sin`, the fused norm + rope op's `rope_theta`). It does
    not include YaRN's attention factor on cos / sin nor the softmax-scale correction: the model's config does
    (`GlmDsaConfig.softmax_scale`), and refuses a cos / sin factor other than 1."""

    theta: float
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def correction_range(self, dim: int) -> tuple[float, float]:
        """(low, high) frequency indices of the ramp: the dim completing `beta_fast` resp. `beta_slow` rotations
        over the original context, floored / ceiled when `truncate`, clipped to [0, dim - 1]."""
        def dim_of(rotations):
            return dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(self.theta))
        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def inv_freq(self, dim: int):
        """float32 [dim / 2]: `interp * (1 - e) + extrap * e`, e = 1 - clip((i - low) / (high - low), 0, 1)."""
        pos_freqs = jnp.float32(self.theta) ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
        extrap = 1.0 / pos_freqs
        interp = 1.0 / (jnp.float32(self.factor) * pos_freqs)
        low, high = self.correction_range(dim)
        if low == high:
            high += 0.001  # as HF: no zero-width ramp
        ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
        extrap_weight = 1.0 - ramp
        return interp * (1.0 - extrap_weight) + extrap * extrap_weight


def inv_freq(dim: int, theta: float | YarnRope):
    """float32 [dim / 2] rotation frequencies: `theta^(-2i/dim)` for a plain base, else the YaRN blend."""
    if isinstance(theta, YarnRope):
        return theta.inv_freq(dim)
    return 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def rope_cos_sin(positions, dim: int, theta: float | YarnRope):
    """cos, sin of `positions * inv_freq(dim, theta)` (i < dim/2), float32 [..., dim/2]; `theta` is a plain rope
    base or a `YarnRope`."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq(dim, theta)
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
