"""Random parameters made directly on the devices (no checkpoint): for benchmarks and experiments."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp

from checkpoints.layout import param_specs
from checkpoints.random import init_stats

from .config import GlmDsaConfig
from .params import param_sharding, resolve_dtype
from .pytree import nest_params
from .step import resolve_parallel


def init_params(config: GlmDsaConfig, *, seed: int = 0, dtype="bfloat16", parallel=None) -> dict:
    """A params pytree of `config` drawn as `checkpoints.random` draws its checkpoints (same statistics),
    each parameter created sharded on the mesh of `parallel` by its own jitted generator."""
    parallel = resolve_parallel(parallel, config)
    sharding_for, dt = param_sharding(parallel), resolve_dtype(dtype)
    key = jax.random.key(seed)
    flat = {}
    for path, spec in param_specs(config).items():
        mean, std = init_stats(path)
        out_dtype = jnp.float32 if spec.fp32 else dt
        sharding = sharding_for(path, spec.shape)
        k = jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)
        make = jax.jit(lambda k, shape=spec.shape, m=mean, s=std, d=out_dtype:
                       (m + s * jax.random.normal(k, shape, jnp.float32)).astype(d), out_shardings=sharding)
        flat[path] = make(k)
    return nest_params(flat)
