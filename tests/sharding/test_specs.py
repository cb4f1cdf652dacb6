"""The axis names, the mesh and the partition table applied to a params pytree (hand-written expectations)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from checkpoints.layout import param_specs
from glm_dsa import configs
from glm_dsa.model.param_tree import flatten_params, nest_params
from sharding import DCP, TP, TP_AXES, ParallelConfig, cache_spec, make_mesh, mesh_for, param_partition_specs


def test_axis_names_and_mesh():
    assert (TP, DCP, TP_AXES) == ("tp", "dcp", ("tp", "dcp"))
    mesh = make_mesh(ParallelConfig(8, 2))
    assert mesh.axis_names == (TP, DCP) and dict(mesh.shape) == {TP: 4, DCP: 2}
    assert mesh.devices.ravel().tolist() == jax.devices()[:8]
    assert mesh_for(ParallelConfig(4, 4)) is mesh_for(ParallelConfig(4, 4))  # one mesh per config
    assert dict(mesh_for(ParallelConfig(4, 4)).shape) == {TP: 1, DCP: 4}


@pytest.mark.parametrize("q_replicate", [False, True])
def test_param_partition_specs_of_a_nested_params_tree(q_replicate):
    flat = {path: np.zeros((), np.float32) for path in param_specs(configs.tiny)}
    params = nest_params(flat)
    assert params["layers"][1]["attn"]["q_b_proj"] is flat["layers.1.attn.q_b_proj"]  # integer layer keys
    assert flatten_params(params).keys() == flat.keys()
    specs = param_partition_specs(params, q_replicate)
    heads = P(None, "tp", None) if q_replicate else P(None, ("tp", "dcp"), None)
    assert specs["layers"][1]["attn"]["q_b_proj"] == heads and specs["layers"][0]["attn"]["kv_b_proj"] == heads
    assert specs["layers"][0]["attn"]["o_proj"] == P(("tp", "dcp"), None, None)
    assert specs["layers"][0]["attn"]["q_a_proj"] == P() and specs["embed"] == P()
    assert specs["lm_head"] == P(None, ("tp", "dcp"))
    assert cache_spec() == P("dcp", None)
