"""Parallel configuration, the device mesh and the partition-spec table (knows the mesh, not the model)."""

from . import axes, dcp
from .axes import DCP, TP, TP_AXES
from .collectives import CollectiveCall, Collectives, StandInCollectives
from .mesh import make_mesh, mesh_for
from .parallel import ParallelConfig
from .specs import cache_spec, fp8_scale_spec, param_partition_specs, param_spec, path_str

__all__ = ["DCP", "TP", "TP_AXES", "CollectiveCall", "Collectives", "ParallelConfig", "StandInCollectives", "axes",
           "cache_spec", "dcp", "make_mesh", "mesh_for", "fp8_scale_spec", "param_partition_specs", "param_spec",
           "path_str"]
