"""Routed SwiGLU experts (SPEC §2, MoE): y[t] = sum_j w[t, j] * down_e(silu(x[t] gate_e) * (x[t] up_e)), e = experts[t, j].

Weights: gate, up [E, D, I]; down [E, I, D] (I is this shard's slice under TP). Returns float32 [T, D].

Forms (`mode`, impl="xla"), each reading weights differently:
  "gather": gather the chosen experts' weights per (token, expert) pair: cheapest for a few pairs (decode, B = 1);
  "dense":  every expert over every token, masked by the routing weights: reads each expert once (mid batch);
  "tiles":  pairs sorted by expert into tiles of one expert each, one GEMM chain per tile in a scan (prefill);
  "ragged": one `jax.lax.ragged_dot` per projection (XLA's GPU lowering materialises a dense
            [rows, experts x width] product: kept as an option, not picked).
impl="triton" runs the same tile layout as one grouped-GEMM Pallas kernel per projection (kernels/moe_triton.py):
each non-empty tile reads its expert's weights once, so a decode step reads only the experts it uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MODES = ("gather", "dense", "tiles", "ragged")
DENSE_MAX_TOKENS = 256


def pick_mode(t: int, k: int, n_exp: int) -> str:
    """The xla form for T rows of k experts each among n_exp (static shapes)."""
    if t * k <= n_exp // 4:
        return "gather"
    return "dense" if t <= DENSE_MAX_TOKENS else "tiles"


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


def _tiles(x, experts, weights, wg, wu, wd):
    t, k = experts.shape
    tile = tile_rows(t, k, wg.shape[0])
    src, tile_expert = tile_plan(experts, wg.shape[0], tile)
    valid = src >= 0
    token = jnp.where(valid, src // k, 0)
    xs = jnp.where(valid[:, None], x[token], 0).reshape(tile_expert.shape[0], tile, -1)

    def one_tile(_, args):
        xt, e = args
        h = jax.nn.silu(xt @ wg[e]) * (xt @ wu[e])
        return None, (h @ wd[e]).astype(jnp.float32)

    _, y = jax.lax.scan(one_tile, None, (xs, tile_expert))
    w = jnp.where(valid, weights.reshape(-1)[jnp.maximum(src, 0)], 0.0)
    return jnp.zeros((t, x.shape[1]), jnp.float32).at[token].add(y.reshape(src.shape[0], -1) * w[:, None])


def experts_xla(x, experts, weights, wg, wu, wd, *, mode: str | None = None):
    """The routed experts by one XLA form (`mode`, default `pick_mode` by shape); float32 [T, D]."""
    t, k = experts.shape
    n_exp = wg.shape[0]
    mode = mode or pick_mode(t, k, n_exp)
    if mode == "tiles":
        return _tiles(x, experts, weights, wg, wu, wd)
    if mode == "gather":
        flat = experts.reshape(-1)
        xs = jnp.repeat(x, k, axis=0)
        h = jax.nn.silu(jnp.einsum("pd,pdi->pi", xs, wg[flat])) * jnp.einsum("pd,pdi->pi", xs, wu[flat])
        y = jnp.einsum("pi,pid->pd", h, wd[flat]).astype(jnp.float32) * weights.reshape(-1)[:, None]
        return y.reshape(t, k, -1).sum(1)
    if mode == "dense":
        combine = jnp.zeros((t, n_exp), jnp.float32).at[jnp.arange(t)[:, None], experts].add(weights)
        h = jax.nn.silu(jnp.einsum("td,edi->tei", x, wg)) * jnp.einsum("td,edi->tei", x, wu)
        h = h * combine[..., None].astype(h.dtype)  # unselected experts contribute exactly 0
        return jnp.einsum("tei,eid->td", h, wd, preferred_element_type=jnp.float32)
    if mode == "ragged":
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // k
        sizes = jnp.bincount(flat, length=n_exp).astype(jnp.int32)
        xs = x[token]
        g = jax.lax.ragged_dot(xs, wg, sizes)
        u = jax.lax.ragged_dot(xs, wu, sizes)
        y = jax.lax.ragged_dot(jax.nn.silu(g) * u, wd, sizes)
        y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        return jnp.zeros((t, x.shape[1]), jnp.float32).at[token].add(y)
    raise ValueError(f"moe: unknown mode {mode!r} (available: {', '.join(MODES)})")


def routed_experts(x, experts, weights, wg, wu, wd, *, impl: str = "xla", mode: str | None = None,
                   **kernel_options):
    """float32 [T, D]: the routed SwiGLU experts of rows `x` [T, D] at `experts` [T, k] (int) with routing
    `weights` [T, k]; gate/up [E, D, I], down [E, I, D].

    impl: "xla" (the forms above; `mode` forces one), "triton" (the grouped-GEMM Pallas kernel; falls back to
    xla when a width is below the kernel's 16-wide tiles), "triton_interpret" (that kernel interpreted: CPU
    tests). `kernel_options` go to `moe_triton.grouped_swiglu`."""
    e, d, i = wg.shape
    if x.shape[-1] != d or wu.shape != wg.shape or wd.shape != (e, i, d):
        raise ValueError(f"moe: x {x.shape}, gate {wg.shape}, up {wu.shape}, down {wd.shape} do not agree "
                         "(want x [T, D], gate/up [E, D, I], down [E, I, D])")
    if experts.shape != weights.shape or experts.shape[0] != x.shape[0]:
        raise ValueError(f"moe: experts {experts.shape} and weights {weights.shape} must both be [T={x.shape[0]}, k]")
    if impl == "xla" or mode is not None:
        return experts_xla(x, experts, weights, wg, wu, wd, mode=mode)
    if impl in ("triton", "triton_interpret"):
        from .moe_triton import grouped_swiglu, supported
        if not supported(d, i):
            return experts_xla(x, experts, weights, wg, wu, wd)
        return grouped_swiglu(x, experts, weights, wg, wu, wd, interpret=impl == "triton_interpret",
                              **kernel_options)
    raise ValueError(f"moe: unknown impl {impl!r} (available: 'xla', 'triton', 'triton_interpret')")
