"""Random parameters made directly on the devices (no checkpoint): for benchmarks and experiments."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from checkpoints.layout import param_specs
from checkpoints.random import init_stats
from sharding import param_spec

from .config import GlmDsaConfig
from .engine import resolve_dtype
from .step import mesh_for, nest_params, resolve_parallel


def init_params(config: GlmDsaConfig, *, seed: int = 0, dtype="bfloat16", parallel=None) -> dict:
    """A params pytree of `config` drawn as `checkpoints.random` draws its checkpoints (same statistics),
    each parameter created sharded on the mesh of `parallel` by its own jitted generator."""
    parallel = resolve_parallel(parallel, config)
    mesh, dt = mesh_for(parallel), resolve_dtype(dtype)
    key = jax.random.key(seed)
    flat = {}
    for path, spec in param_specs(config).items():
        mean, std = init_stats(path)
        out_dtype = jnp.float32 if spec.fp32 else dt
        sharding = NamedSharding(mesh, param_spec(path, parallel.q_replicate))
        k = jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)
        make = jax.jit(lambda k, shape=spec.shape, m=mean, s=std, d=out_dtype:
                       (m + s * jax.random.normal(k, shape, jnp.float32)).astype(d), out_shardings=sharding)
        flat[path] = make(k)
    return nest_params(flat)
