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


def axes_across_hosts(parallel: ParallelConfig, devices_per_host: int) -> list[str]:
    """The mesh axes whose collectives cross hosts when `make_mesh` lays the devices out in process order (host h
    holds devices h * devices_per_host ...): the mesh is (TP // DCP, DCP) row-major, so an axis crosses hosts when
    the devices along it (the others fixed) sit on more than one host."""
    if devices_per_host < 1 or parallel.tp % devices_per_host and devices_per_host % parallel.tp:
        raise ValueError(f"devices_per_host={devices_per_host} must divide tensor_parallel_size={parallel.tp} "
                         "(or be a multiple of it)")
    shape = parallel.mesh_shape
    strides = {TP: shape[DCP], DCP: 1}
    out = []
    for axis in (TP, DCP):
        hosts = {(i * strides[axis]) // devices_per_host for i in range(shape[axis])}
        if len(hosts) > 1:
            out.append(axis)
    return out
