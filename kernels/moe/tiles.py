"""The tile layout of the routed experts' (token, expert) pairs, shared by the xla "tiles" form (kernels/moe/reference.py)
and the grouped-GEMM kernels (kernels/moe/triton.py): pairs sorted by expert, each expert's run padded to whole
tiles of one expert each."""

from __future__ import annotations

import jax.numpy as jnp


def tile_rows(t: int, k: int, n_exp: int) -> int:
    """Rows per expert tile: about the mean rows per expert, a power of two in [16, 128]."""
    per_expert = max(1, (t * k) // n_exp)
    return min(128, max(16, 1 << (per_expert - 1).bit_length()))


def routed_pairs(experts, n_exp: int):
    """bool, experts' shape: the (token, expert) pairs routed to an expert, i.e. with an id in [0, n_exp). An id
    outside it (the model's sentinel n_exp for a padding row) marks a pair computed nowhere."""
    return (experts >= 0) & (experts < n_exp)


def sort_pairs(experts, n_exp: int):
    """(key, order, sizes) of the (token, expert) pairs of `experts` [T, k] flattened row-major: key int [T k], each
    pair's expert, or n_exp for an unrouted one (`routed_pairs`: negative ids too); order, the pairs sorted by key
    (stable), so every expert's run comes in pair order and the unrouted pairs after all of them; sizes int32
    [n_exp], each expert's pair count (the unrouted pairs counted in none). The routed pairs' places in `order` are
    those of the same pairs without the unrouted ones."""
    flat = experts.reshape(-1)
    key = jnp.where(routed_pairs(flat, n_exp), flat, n_exp)
    order = jnp.argsort(key, stable=True)
    return key, order, jnp.bincount(key, length=n_exp + 1)[:n_exp].astype(jnp.int32)


def tile_plan(experts, n_exp: int, tile: int):
    """Layout of the (token, expert) pairs sorted by expert, each expert's run padded to whole tiles.

    Returns (src, tile_expert): src int32 [n_tiles * tile], the pair index (token * k + j) at each padded row or
    -1; tile_expert int32 [n_tiles], the expert of each tile (tiles past the last are all -1 rows). A tile's
    padding rows come after its real rows, so a tile is empty exactly when its first row is -1. A pair whose
    expert id is outside [0, n_exp) (`routed_pairs`) gets no row: it is in no tile, so nothing computes it.
    n_tiles = ceil(P / tile) + min(E, P) bounds sum_e ceil(size_e / tile) for P = T * k pairs (a static bound:
    with unrouted pairs the tiles past the last used one are empty)."""
    t, k = experts.shape
    p = t * k
    key, order, sizes = sort_pairs(experts, n_exp)  # unrouted pairs last, in no expert's run
    group = key[order]
    padded = (sizes + tile - 1) // tile * tile
    start = jnp.cumsum(padded) - padded
    n_tiles = -(-p // tile) + min(n_exp, p)
    # group n_exp would gather start[n_exp] clamped to the last expert's: give those pairs a row past the end
    # instead, which the scatter below drops (mode "drop" said, not left to jnp's default)
    first = jnp.cumsum(sizes) - sizes
    dest = jnp.where(group < n_exp, start[jnp.minimum(group, n_exp - 1)] + jnp.arange(p)
                     - first[jnp.minimum(group, n_exp - 1)], n_tiles * tile)
    src = jnp.full((n_tiles * tile,), -1, jnp.int32).at[dest].set(order.astype(jnp.int32), mode="drop")
    # one broadcast compare, not the default binary-search loop (a while loop of ~9 launches on a GPU)
    tile_expert = jnp.searchsorted(start + padded, jnp.arange(n_tiles) * tile, side="right", method="compare_all")
    return src, jnp.minimum(tile_expert, n_exp - 1).astype(jnp.int32)
