"""The device mesh {'tp': TP // DCP, 'dcp': DCP}."""

from __future__ import annotations

import functools

import jax
from jax.sharding import AxisType

from .axes import DCP, TP
from .parallel import ParallelConfig


def make_mesh(parallel: ParallelConfig, devices=None) -> jax.sharding.Mesh:
    """A mesh of `parallel.tp` devices (the first ones unless `devices` is given), axes (TP, DCP)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < parallel.tp:
        raise ValueError(f"tensor_parallel_size={parallel.tp} needs {parallel.tp} devices; only {len(devices)} "
                         f"available ({devices[0].platform if devices else 'none'})")
    shape = parallel.mesh_shape
    return jax.make_mesh((shape[TP], shape[DCP]), (TP, DCP), axis_types=(AxisType.Auto,) * 2,
                         devices=devices[: parallel.tp])


@functools.lru_cache(maxsize=None)
def mesh_for(parallel: ParallelConfig) -> jax.sharding.Mesh:
    """The mesh of `parallel` on the default devices, built once per ParallelConfig."""
    return make_mesh(parallel)
