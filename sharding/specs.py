"""The one table of partition specs, keyed by parameter path (see checkpoints.layout for the paths)."""

from __future__ import annotations

import re

import jax
from jax.sharding import PartitionSpec as P

from .axes import DCP, TP, TP_AXES

_TABLE: list[tuple[str, P]] = [
    (r"embed", P()),
    (r"final_norm", P()),
    (r"lm_head", P(None, TP_AXES)),
    (r"layers\.\d+\.(input_norm|post_norm)", P()),
    (r"layers\.\d+\.attn\.(q_a_proj|q_a_norm|kv_a_proj|kv_a_norm)", P()),
    (r"layers\.\d+\.attn\.(q_b_proj|kv_b_proj)", P(None, TP_AXES, None)),
    (r"layers\.\d+\.attn\.o_proj", P(TP_AXES, None, None)),
    (r"layers\.\d+\.attn\.indexer\.\w+", P()),
    (r"layers\.\d+\.mlp\.(gate|up)", P(None, TP_AXES)),
    (r"layers\.\d+\.mlp\.down", P(TP_AXES, None)),
    (r"layers\.\d+\.moe\.(router|router_bias)", P()),
    (r"layers\.\d+\.moe\.experts_(gate|up)", P(None, None, TP_AXES)),
    (r"layers\.\d+\.moe\.experts_down", P(None, TP_AXES, None)),
    (r"layers\.\d+\.moe\.shared_(gate|up)", P(None, TP_AXES)),
    (r"layers\.\d+\.moe\.shared_down", P(TP_AXES, None)),
]
_COMPILED = [(re.compile(pat + r"$"), spec) for pat, spec in _TABLE]


_QREP = re.compile(r"layers\.\d+\.attn\.(q_b_proj|kv_b_proj)$")


def param_spec(path: str, q_replicate: bool = False) -> P:
    """The PartitionSpec of the parameter at `path`; an unknown path is an error, not a silent replicate.

    With query replication each DCP rank holds q_b_proj and kv_b_proj (W_UK, W_UV) for all heads of its DCP
    group: split over 'tp' only."""
    if q_replicate and _QREP.match(path):
        return P(None, TP, None)
    for pat, spec in _COMPILED:
        if pat.match(path):
            return spec
    raise KeyError(f"no partition spec for parameter {path!r}")


def cache_spec() -> P:
    """Paged caches [slots, width]: sharded by token over 'dcp', replicated over 'tp'."""
    return P(DCP, None)


def path_str(path) -> str:
    """'layers.3.attn.q_b_proj' from a pytree key path: the parameter path the table is keyed by."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def param_partition_specs(params, q_replicate: bool = False):
    """PartitionSpecs for a params pytree (nested dicts keyed as `checkpoints.layout` names), from the table."""
    return jax.tree_util.tree_map_with_path(lambda p, _: param_spec(path_str(p), q_replicate), params)
