"""Parameters onto the mesh: the one place that reads a checkpoint into sharded parameters, used by
`glm_dsa.load`, `python -m glm_dsa convert` and (for the placement rule) `init_params`."""

from __future__ import annotations

import os
from typing import Callable

import jax.numpy as jnp
from jax.sharding import NamedSharding

import checkpoints
from sharding import ParallelConfig, mesh_for, param_spec

from .config import GlmDsaConfig
from .step import resolve_parallel

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


def resolve_dtype(dtype) -> jnp.dtype:
    """'bfloat16' | 'float32' | 'float16' or a jnp dtype -> jnp.dtype."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return jnp.dtype(DTYPES[dtype])
    try:
        d = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be one of {sorted(DTYPES)} or a jnp dtype, got {dtype!r}") from None
    if d not in (jnp.dtype(v) for v in DTYPES.values()):
        raise ValueError(f"dtype must be a floating dtype among {sorted(DTYPES)}, got {d}")
    return d


def param_sharding(parallel: ParallelConfig) -> Callable[[str, tuple], NamedSharding]:
    """`sharding_for(path, shape)`: each parameter's sharding on the mesh of a resolved `parallel`, from the one
    partition table (`sharding.param_spec`)."""
    mesh = mesh_for(parallel)
    return lambda path, shape: NamedSharding(mesh, param_spec(path, parallel.q_replicate))


def checkpoint_source(path: str | os.PathLike) -> tuple[str, bool]:
    """(the directory to read, whether it is orbax) for a checkpoint directory given by the user: an HF
    safetensors directory, or an orbax directory (its newest committed version). Relative paths are fine."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint directory at {path!r}")
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is a file; give the checkpoint directory that holds it "
                         f"({os.path.dirname(os.path.abspath(path))!r})")
    if checkpoints.is_orbax_checkpoint(path):
        return os.fspath(checkpoints.committed_checkpoint(path)), True
    return path, False


def load_params(path: str | os.PathLike, *, parallel: ParallelConfig | None = None, dtype="bfloat16",
                progress: bool = True) -> tuple[GlmDsaConfig, ParallelConfig, dict]:
    """(config, resolved parallel, flat params) of the checkpoint directory `path` (see `checkpoint_source`), each
    parameter placed on the devices with its target sharding (each device reads only its slice), in `dtype`
    (the layout's float32 parameters stay float32)."""
    source, orbax = checkpoint_source(path)
    config = GlmDsaConfig.from_pretrained(source)
    parallel = resolve_parallel(parallel, config)
    read = checkpoints.load_orbax_params if orbax else checkpoints.load_hf_params
    flat = read(source, config, dtype=resolve_dtype(dtype), progress=progress,
                sharding_for=param_sharding(parallel))
    return config, parallel, flat
