"""Parallel configuration, the device mesh and the partition-spec table (knows the mesh, not the model)."""

from . import dcp
from .mesh import make_mesh
from .parallel import ParallelConfig
from .specs import TP_AXES, cache_spec, param_spec

__all__ = ["dcp", "ParallelConfig", "TP_AXES", "cache_spec", "make_mesh", "param_spec"]
