"""Parameters onto the mesh: the one place that reads a checkpoint into sharded parameters, used by
`glm_dsa.load`, `python -m glm_dsa convert` and (for the placement rule) `init_params`."""

from __future__ import annotations

import os
from typing import Callable

import jax.numpy as jnp
from jax.sharding import NamedSharding

import checkpoints
from sharding import ParallelConfig, mesh_for, param_spec

from ..distributed import check_mesh_spans_processes
from .config import GlmDsaConfig
from .placement import leaf_spec, param_bytes_per_device
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


def param_sharding(parallel: ParallelConfig, config: GlmDsaConfig | None = None
                   ) -> Callable[[str, tuple], NamedSharding]:
    """`sharding_for(path, shape, kept=False)`: each parameter's sharding on the mesh of a resolved `parallel`,
    from the one partition table (`sharding.param_spec`); with `config`, FP8 scale grids and weights kept FP8
    (`kept`: their stored form, K-major for expert stacks) too (`leaf_spec`)."""
    mesh = mesh_for(parallel)
    if config is None:
        return lambda path, shape, kept=False: NamedSharding(mesh, param_spec(path, parallel.q_replicate))
    return lambda path, shape, kept=False: NamedSharding(mesh, leaf_spec(path, shape, config, parallel, kept=kept))


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


def checkpoint_fp8_plan(source, orbax: bool, config: GlmDsaConfig, quantization) -> checkpoints.QuantizationPlan:
    """The `QuantizationPlan` of loading the checkpoint directory `source` (from `checkpoint_source`; an HF one may
    be given as an open `checkpoints.HFCheckpoint`) under `quantization` (`checkpoints.quantization`): the weights
    it keeps FP8, known before anything is read but headers and metadata. `load_params` makes it once and the
    readers, `check_fits` and `info` read it."""
    if orbax:
        return checkpoints.orbax_io.stored_fp8_plan(source, quantization, config)
    ckpt = source if isinstance(source, checkpoints.HFCheckpoint) else checkpoints.HFCheckpoint(source)
    return checkpoints.loader.hf_fp8_plan(ckpt, checkpoints.param_specs(config), quantization)


def load_params(path: str | os.PathLike, *, parallel: ParallelConfig | None = None, dtype="bfloat16",
                progress: bool = True, mtp: bool = False, quantization=None,
                device_memory: int | None = None) -> tuple[GlmDsaConfig, ParallelConfig, dict]:
    """(config, resolved parallel, flat params) of the checkpoint directory `path` (see `checkpoint_source`), each
    parameter placed on the devices with its target sharding (each device reads only its slice), in `dtype`
    (the layout's float32 parameters stay float32); `mtp`: with the nextn layer's `mtp.*` parameters.

    quantization: None (the checkpoint's own form: FP8 weights stay FP8), "fp8" (quantise every linear weight at
    load), "none" (dequantise to `dtype`); see `checkpoints.quantization`. Before anything is allocated, the
    weights one device would hold are compared with `device_memory` bytes (default: what the first device reports
    free, when it reports it): a layout that cannot fit is a ValueError naming the need and the free bytes."""
    checkpoints.resolve_quantization(quantization)  # a bad value fails before anything is opened
    source, orbax = checkpoint_source(path)
    config = GlmDsaConfig.from_pretrained(source)
    parallel = resolve_parallel(parallel, config)
    # before any read: a process the mesh leaves out would fail placing its (absent) shards with JAX's own error
    check_mesh_spans_processes(mesh_for(parallel))
    dtype = resolve_dtype(dtype)
    # an HF checkpoint's headers are parsed once: for the plan and then for the read
    opened = source if orbax else checkpoints.HFCheckpoint(source)
    plan = checkpoint_fp8_plan(opened, orbax, config, quantization)
    check_fits(config, parallel, dtype=dtype, plan=plan, mtp=mtp, device_memory=device_memory, what=source)
    read = checkpoints.load_orbax_params if orbax else checkpoints.load_hf_params
    extra = {}
    if mtp:  # the nextn layer's `mtp.*` parameters too (glm_dsa.model.mtp)
        extra["mtp"] = True
    # the reader loads the plan's weights FP8 as decided here (the plan given as `quantization` is not redecided)
    flat = read(opened, config, dtype=dtype, progress=progress, sharding_for=param_sharding(parallel, config),
                quantization=plan, **extra)
    return config, parallel, flat


def has_mtp_layer(path: str | os.PathLike) -> bool:
    """Whether the checkpoint directory `path` (HF or orbax) holds a nextn (MTP) layer that `load_params(...,
    mtp=True)` can read: declared by its config and present (HF: the layer's `eh_proj` tensor; orbax: `mtp.*`)."""
    source, orbax = checkpoint_source(path)
    if orbax:
        return checkpoints.stored_mtp(source)
    config = GlmDsaConfig.from_pretrained(source)
    if not int(getattr(config, "num_nextn_predict_layers", 0) or 0):
        return False
    return f"model.layers.{config.num_hidden_layers}.eh_proj.weight" in checkpoints.HFCheckpoint(source)


def device_free_bytes() -> int | None:
    """Free bytes on the first local device as it reports them (None where it does not: CPU)."""
    import jax

    from .paged_cache import free_device_bytes
    try:
        return free_device_bytes(jax.local_devices()[0])
    except Exception:  # a backend without memory stats
        return None


def check_fits(config: GlmDsaConfig, parallel: ParallelConfig, *, dtype, plan, mtp: bool = False,
               device_memory: int | None = None, what: str = "the model") -> int:
    """The weight bytes per device of loading `config` on `parallel` with `plan` kept FP8; a ValueError naming
    the need and the free bytes when they exceed `device_memory` (default `device_free_bytes()`; None: no check)."""
    need = param_bytes_per_device(config, parallel, dtype=dtype, plan=plan, mtp=mtp)
    free = device_free_bytes() if device_memory is None else int(device_memory)
    if free is not None and need > free:
        gib = 2 ** 30
        raise ValueError(f"{what}: the weights need {need / gib:.2f} GiB per device at TP={parallel.tp} "
                         f"DCP={parallel.dcp} ({'FP8 for ' + str(len(plan)) + ' weights' if plan else 'no FP8'}, "
                         f"{jnp.dtype(dtype).name} for the rest) but a device has {free / gib:.2f} GiB free: use "
                         f"more devices (-tp), quantization='fp8', or a smaller dtype")
    return need
