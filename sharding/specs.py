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
    # the MTP (nextn) layer (checkpoints.mtp_layout); its decoder block `mtp.block.*` follows the rows above
    (r"mtp\.(enorm|hnorm|eh_proj|head_norm)", P()),
    (r"mtp\.head", P(None, TP_AXES)),
]
_COMPILED = [(re.compile(pat + r"$"), spec) for pat, spec in _TABLE]


_MTP_BLOCK = "mtp.block."
_QREP = re.compile(r"layers\.\d+\.attn\.(q_b_proj|kv_b_proj)$")


def param_spec(path: str, q_replicate: bool = False, kmajor: bool = False) -> P:
    """The PartitionSpec of the parameter at `path`; an unknown path is an error, not a silent replicate.

    With query replication each DCP rank holds q_b_proj and kv_b_proj (W_UK, W_UV) for all heads of its DCP
    group: split over 'tp' only. `kmajor`: the leaf is stored with its last two axes swapped (an FP8 expert stack
    kept K-major, `checkpoints.layout.kept_fp8_spec`), so its spec is the table's with those two swapped."""
    if path.startswith(_MTP_BLOCK):  # the nextn layer's decoder block: partitioned as every decoder layer
        path = "layers.0." + path[len(_MTP_BLOCK):]
    if q_replicate and _QREP.match(path):
        return _swap_last(P(None, TP, None)) if kmajor else P(None, TP, None)
    for pat, spec in _COMPILED:
        if pat.match(path):
            return _swap_last(spec) if kmajor else spec
    raise KeyError(f"no partition spec for parameter {path!r}")


def _swap_last(spec: P) -> P:
    """`spec` of a 3-axis leaf with its last two entries swapped."""
    axes = tuple(spec) + (None,) * (3 - len(spec))
    return P(axes[0], axes[2], axes[1])


def cache_spec() -> P:
    """Paged caches [slots, width]: sharded by token over 'dcp', replicated over 'tp'."""
    return P(DCP, None)


def path_str(path) -> str:
    """'layers.3.attn.q_b_proj' from a pytree key path: the parameter path the table is keyed by."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


SCALE_SUFFIX = "_scale"  # an FP8 weight's block-scale grid: '<weight path>_scale' (checkpoints.quantization)


def fp8_scale_spec(weight_spec: P, weight_shape, fp8_grid: tuple[int, int, int], axis_sizes: dict[str, int]) -> P:
    """The PartitionSpec of an FP8 weight's scale grid [*lead, in-blocks, out-blocks] (`fp8_grid` = (lead, n_in,
    n_out) counts of the weight's axes, `checkpoints.layout.ParamSpec.fp8_grid`): a block axis is split like the
    weight axes it covers when each device's slice of them is a whole number of 128-blocks (every GLM-5.2 shard
    at TP <= 8); otherwise the grid is replicated there and each device slices its blocks by its rank (a shard
    that starts mid-block: glm_dsa.model.linear)."""
    lead, n_in, n_out = fp8_grid
    spec = tuple(weight_spec) + (None,) * (len(weight_shape) - len(weight_spec))
    out = list(spec[:lead])
    for axes in (range(lead, lead + n_in), range(lead + n_in, lead + n_in + n_out)):
        split = [a for a in axes if spec[a] is not None]
        mesh_axes = spec[split[0]] if split else None
        if mesh_axes is not None:
            names = mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)
            parts = 1
            for name in names:
                parts *= axis_sizes[name]
            width = 1
            for a in axes:
                width *= weight_shape[a]
            if width % parts or (width // parts) % 128:
                mesh_axes = None
        out.append(mesh_axes)
    return P(*out)


def param_partition_specs(params, q_replicate: bool = False, *, axis_sizes: dict[str, int] | None = None,
                          fp8_grids: dict[str, tuple[int, int, int]] | None = None, kmajor=frozenset()):
    """PartitionSpecs for a params pytree (nested dicts keyed as `checkpoints.layout` names), from the table. FP8
    scale leaves ('<weight>_scale') take `fp8_scale_spec` of their weight, from `fp8_grids` (weight path ->
    fp8_grid) and the mesh's `axis_sizes`; weights in `kmajor` are stored with their last two axes swapped."""
    flat = {path_str(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(params)}

    def spec_of(p, _):
        path = path_str(p)
        weight = path[: -len(SCALE_SUFFIX)]
        if path.endswith(SCALE_SUFFIX) and weight in flat and fp8_grids and weight in fp8_grids:
            return fp8_scale_spec(param_spec(weight, q_replicate, weight in kmajor), flat[weight].shape,
                                  fp8_grids[weight], axis_sizes or {})
        return param_spec(path, q_replicate, path in kmajor)
    return jax.tree_util.tree_map_with_path(spec_of, params)
