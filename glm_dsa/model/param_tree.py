"""The params pytree: nested dicts keyed by the parts of the `checkpoints.layout` paths, layer keys as ints."""

from __future__ import annotations

import jax

from sharding.specs import path_str


def nest_params(flat: dict) -> dict:
    """{'layers.0.attn.q_a_proj': a} -> {'layers': {0: {'attn': {'q_a_proj': a}}}} (integer layer keys)."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        parts = [int(p) if p.isdigit() else p for p in path.split(".")]
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def flatten_params(params) -> dict:
    """The inverse of `nest_params`: {'layers.0.attn.q_a_proj': a, ...} in the pytree's leaf order."""
    return {path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
