"""The tile layout of the routed experts' (token, expert) pairs, shared by the xla "tiles" form (kernels/moe/reference.py)
and the grouped-GEMM kernels (kernels/moe/triton.py): pairs sorted by expert, each expert's run padded to whole
tiles of one expert each."""

from __future__ import annotations

import jax.numpy as jnp


def tile_rows(t: int, k: int, n_exp: int) -> int:
    """Rows per expert tile: about the mean rows per expert, a power of two in [16, 128]."""
    per_expert = max(1, (t * k) // n_exp)
    return min(128, max(16, 1 << (per_expert - 1).bit_length()))


def tile_plan(experts, n_exp: int, tile: int):
    """Layout of the (token, expert) pairs sorted by expert, each expert's run padded to whole tiles.

    Returns (src, tile_expert): src int32 [n_tiles * tile], the pair index (token * k + j) at each padded row or
    -1; tile_expert int32 [n_tiles], the expert of each tile (tiles past the last are all -1 rows). A tile's
    padding rows come after its real rows, so a tile is empty exactly when its first row is -1.
    n_tiles = ceil(P / tile) + min(E, P) bounds sum_e ceil(size_e / tile) for P = T * k pairs."""
    t, k = experts.shape
    p = t * k
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group = flat[order]
    sizes = jnp.bincount(flat, length=n_exp)
    padded = (sizes + tile - 1) // tile * tile
    start = jnp.cumsum(padded) - padded
    dest = start[group] + jnp.arange(p) - (jnp.cumsum(sizes) - sizes)[group]
    n_tiles = -(-p // tile) + min(n_exp, p)
    src = jnp.full((n_tiles * tile,), -1, jnp.int32).at[dest].set(order.astype(jnp.int32))
    # one broadcast compare, not the default binary-search loop (a while loop of ~9 launches on a GPU)
    tile_expert = jnp.searchsorted(start + padded, jnp.arange(n_tiles) * tile, side="right", method="compare_all")
    return src, jnp.minimum(tile_expert, n_exp - 1).astype(jnp.int32)
