"""Routed SwiGLU experts (docs/math.md §2, MoE): y[t] = sum_j w[t, j] * down_e(silu(x[t] gate_e) * (x[t] up_e)),
e = experts[t, j].

Weights: gate, up [E, D, I]; down [E, I, D] (I is this shard's slice under TP). Returns float32 [T, D].

Forms (`mode`, impl="xla"), each reading weights differently:
  "gather": gather the chosen experts' weights per (token, expert) pair: cheapest for a few pairs (decode, B = 1);
  "dense":  every expert over every token, masked by the routing weights: reads each expert once (mid batch);
  "tiles":  pairs sorted by expert into tiles of one expert each, one GEMM chain per tile in a scan (prefill);
  "ragged": one `jax.lax.ragged_dot` per projection (XLA's GPU lowering materialises a dense
            [rows, experts x width] product: kept as an option, not picked).
impl="triton" runs the same tile layout (kernels/moe_tiles.py) as one grouped-GEMM Pallas kernel per projection
(kernels/moe_triton.py):
each non-empty tile reads its expert's weights once, so a decode step reads only the experts it uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import registry
from .moe_tiles import tile_plan, tile_rows

MODES = ("gather", "dense", "tiles", "ragged")
DENSE_MAX_TOKENS = 256


def pick_mode(t: int, k: int, n_exp: int) -> str:
    """The xla form for T rows of k experts each among n_exp (static shapes)."""
    if t * k <= n_exp // 4:
        return "gather"
    return "dense" if t <= DENSE_MAX_TOKENS else "tiles"


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

    impl (`kernels.registry`): "xla" (the forms above), "triton" (the grouped-GEMM Pallas kernel, any widths),
    "triton_interpret" (that kernel interpreted: CPU tests). `mode` forces one xla form whatever `impl` says
    (the model's switch for comparing forms). `kernel_options` go to `moe_triton.grouped_swiglu` (config, tile,
    bn_up, bk_up, bn_down, bk_down, num_warps, num_stages, k_split)."""
    e, d, i = wg.shape
    if x.shape[-1] != d or wu.shape != wg.shape or wd.shape != (e, i, d):
        raise ValueError(f"moe: x {x.shape}, gate {wg.shape}, up {wu.shape}, down {wd.shape} do not agree "
                         "(want x [T, D], gate/up [E, D, I], down [E, I, D])")
    if experts.shape != weights.shape or experts.shape[0] != x.shape[0]:
        raise ValueError(f"moe: experts {experts.shape} and weights {weights.shape} must both be [T={x.shape[0]}, k]")
    if mode is not None:
        if kernel_options:
            raise ValueError(f"moe: mode {mode!r} forces an xla form, which takes no kernel options "
                             f"({sorted(kernel_options)})")
        registry.get("moe", impl)  # an unknown impl is an error even when `mode` overrides it
        return experts_xla(x, experts, weights, wg, wu, wd, mode=mode)
    return registry.dispatch("moe", impl, x, experts, weights, wg, wu, wd, **kernel_options)


registry.register("moe", "xla", experts_xla)
registry.register_triton("moe", "kernels.moe_triton:grouped_swiglu")
