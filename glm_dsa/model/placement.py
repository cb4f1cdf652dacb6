"""Where each parameter leaf lives on the mesh, bf16 and FP8 alike: the partition table's spec for weights, and for
an FP8 weight's scale grid ('<weight>_scale', checkpoints.quantization) the spec `sharding.fp8_scale_spec` derives
from its weight's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

import checkpoints
from sharding import ParallelConfig, fp8_scale_spec, param_partition_specs, param_spec, path_str
from sharding.specs import SCALE_SUFFIX

from .config import GlmDsaConfig


@functools.lru_cache(maxsize=None)
def _specs(config: GlmDsaConfig) -> dict:
    specs = dict(checkpoints.param_specs(config))
    if int(getattr(config, "num_nextn_predict_layers", 0) or 0):
        from checkpoints.mtp_layout import mtp_param_specs
        specs.update(mtp_param_specs(config))
    return specs


@functools.lru_cache(maxsize=None)
def fp8_grids(config: GlmDsaConfig) -> dict[str, tuple[int, int, int]]:
    """Weight path -> `fp8_grid` of every parameter that can be kept FP8 (checkpoints.layout), MTP layer's included."""
    return {p: s.fp8_grid for p, s in _specs(config).items() if s.fp8_grid is not None}


def _kmajor(path: str, config: GlmDsaConfig) -> bool:
    """Whether the weight at `path`, kept FP8, is stored K-major (`checkpoints.layout.kept_fp8_spec`)."""
    spec = _specs(config).get(path)
    return spec is not None and spec.fp8_kmajor


def leaf_spec(path: str, shape: tuple, config: GlmDsaConfig, parallel: ParallelConfig, *,
              kept: bool = False) -> PartitionSpec:
    """The PartitionSpec of the parameter leaf `path` (of global `shape`) on the mesh of a resolved `parallel`.
    `kept`: the leaf is a weight kept FP8 (its stored form may be K-major); a scale grid implies it."""
    weight = path[: -len(SCALE_SUFFIX)]
    if path.endswith(SCALE_SUFFIX) and weight in fp8_grids(config):
        stored = checkpoints.kept_fp8_spec(_specs(config)[weight])
        return fp8_scale_spec(param_spec(weight, parallel.q_replicate, stored.kmajor), stored.shape,
                              stored.fp8_grid, parallel.mesh_shape)
    return param_spec(path, parallel.q_replicate, kept and _kmajor(path, config))


def partition_specs(params, config: GlmDsaConfig, parallel: ParallelConfig):
    """PartitionSpecs of a params pytree (bf16 and FP8 leaves) on the mesh of a resolved `parallel`: a float8
    leaf is a weight kept FP8, K-major where the layout says so."""
    kept = {path_str(p) for p, leaf in jax.tree_util.tree_leaves_with_path(params)
            if jnp.dtype(leaf.dtype) == jnp.float8_e4m3fn}
    return param_partition_specs(params, parallel.q_replicate, axis_sizes=parallel.mesh_shape,
                                 fp8_grids=fp8_grids(config), kmajor={p for p in kept if _kmajor(p, config)})


def local_shape(shape: tuple, spec: PartitionSpec, axis_sizes: dict[str, int]) -> tuple[int, ...]:
    """The shape of one device's shard of a `shape` array split by `spec` (axes that do not divide: ceil)."""
    out = []
    for i, d in enumerate(shape):
        axes = spec[i] if i < len(spec) else None
        names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        parts = 1
        for name in names:
            parts *= axis_sizes[name]
        out.append(-(-d // parts))
    return tuple(out)


def param_bytes_per_device(config: GlmDsaConfig, parallel: ParallelConfig, *, dtype, plan=frozenset(),
                           mtp: bool = False) -> int:
    """Bytes of parameters each device holds (the largest over devices: shards are even) for `config` on a
    resolved `parallel` in compute `dtype`, with the weights in `plan` kept FP8 (1 byte each plus their float32
    scale grids) and the layout's float32 parameters in float32. Counts QREP's replicated q_b / kv_b."""
    import numpy as np

    specs = dict(checkpoints.param_specs(config))
    if mtp:
        from checkpoints.mtp_layout import mtp_param_specs
        specs.update(mtp_param_specs(config))
    leaves = checkpoints.stored_leaves(specs, frozenset(plan))
    itemsize = {"fp8": 1, "scale": 4, "fp32": 4, "weight": np.dtype(dtype).itemsize}
    total = 0
    for path, (shape, kind) in leaves.items():
        n = 1
        spec = leaf_spec(path, shape, config, parallel, kept=kind == "fp8")
        for d in local_shape(shape, spec, parallel.mesh_shape):
            n *= d
        total += n * itemsize[kind]
    return total
