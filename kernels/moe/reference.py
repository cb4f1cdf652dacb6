"""The routed experts' oracle (impl "xla"): the plain-jnp forms, each reading the weights differently (docs/math.md
§2, MoE; the forms are described in `kernels.moe`). FP8 experts run over the experts dequantised to float32.

A pair whose expert id is outside [0, n_exp) (`tiles.routed_pairs`: the model's padding rows) contributes exactly 0
in every form, whatever its weight and even where its row of x is not finite: each form selects (`jnp.where`)
rather than multiplies by a zero weight, since a clamped gather's weights times a NaN row would be NaN. The
routed pairs' results are those of the same form without the unrouted pairs, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import registry
from ..common.fp8_formats import dequantize_weight_blocks
from .tiles import routed_pairs, sort_pairs, tile_plan, tile_rows

MODES = ("gather", "dense", "tiles", "ragged")


DENSE_MAX_TOKENS = 256


def pick_mode(t: int, k: int, n_exp: int) -> str:
    """The xla form for T rows of k experts each among n_exp (static shapes): the rule "moe.xla_form"."""
    return registry.decide("moe.xla_form", t, k, n_exp)


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


def _experts_fp8_xla(x, experts, weights, wg, wu, wd, wg_scale, wu_scale, wd_scale, i_offset, mode):
    """The FP8 reference: the experts dequantised to float32 (in the "gather" form only the chosen ones, one
    weight set per (token, expert) pair), x in float32, then the bf16 path's form `mode` at highest precision
    (h stays float32 here; the kernels round it to x.dtype)."""
    t, k = experts.shape
    n_exp = wg.shape[0]
    mode = mode or pick_mode(t, k, n_exp)
    if mode == "gather":
        flat = experts.reshape(-1)  # unrouted ids clamp to an expert here; the gather form drops their results
        wg, wu, wd = (dequantize_weight_blocks(w[flat], s[flat], r, c) for w, s, r, c in
                      ((wg, wg_scale, 0, i_offset), (wu, wu_scale, 0, i_offset), (wd, wd_scale, i_offset, 0)))
        # one weight set per pair; unrouted pairs keep an id outside [0, T k) so the form below drops them
        experts = jnp.where(routed_pairs(experts, n_exp), jnp.arange(t * k, dtype=jnp.int32).reshape(t, k), t * k)
    else:
        wg = dequantize_weight_blocks(wg, wg_scale, 0, i_offset)
        wu = dequantize_weight_blocks(wu, wu_scale, 0, i_offset)
        wd = dequantize_weight_blocks(wd, wd_scale, i_offset, 0)
    with jax.default_matmul_precision("highest"):  # IEEE float32 on a GPU too (its default is TF32)
        return experts_xla(x.astype(jnp.float32), experts, weights, wg, wu, wd, mode=mode)


def experts_xla(x, experts, weights, wg, wu, wd, *, mode: str | None = None, wg_scale=None, wu_scale=None,
                wd_scale=None, i_offset=0):
    """The routed experts by one XLA form (`mode`, default `pick_mode` by shape); float32 [T, D]. FP8 experts
    (scales given): the same forms over the experts dequantised to float32 (`_experts_fp8_xla`)."""
    if wg_scale is not None:
        return _experts_fp8_xla(x, experts, weights, wg, wu, wd, wg_scale, wu_scale, wd_scale, i_offset, mode)
    t, k = experts.shape
    n_exp = wg.shape[0]
    mode = mode or pick_mode(t, k, n_exp)
    if mode == "tiles":
        return _tiles(x, experts, weights, wg, wu, wd)
    routed = routed_pairs(experts, n_exp)
    if mode == "gather":
        flat = experts.reshape(-1)  # unrouted ids: the gathers clamp them to an expert, whose result is dropped
        xs = jnp.repeat(x, k, axis=0)
        h = jax.nn.silu(jnp.einsum("pd,pdi->pi", xs, wg[flat])) * jnp.einsum("pd,pdi->pi", xs, wu[flat])
        y = jnp.einsum("pi,pid->pd", h, wd[flat]).astype(jnp.float32) * weights.reshape(-1)[:, None]
        return jnp.where(routed[..., None], y.reshape(t, k, -1), 0.0).sum(1)
    if mode == "dense":
        # unrouted pairs add nothing to `combine`: their index n_exp is out of range and dropped (a negative id
        # would wrap to an expert, so it is replaced too); a row with no routed pair is zeroed (selected, not
        # multiplied: it may be NaN), so its products are 0 and its output 0, not NaN x 0
        index = jnp.where(routed, experts, n_exp)
        combine = jnp.zeros((t, n_exp), jnp.float32).at[jnp.arange(t)[:, None], index].add(weights, mode="drop")
        x = jnp.where(routed.any(1, keepdims=True), x, jnp.zeros_like(x))
        h = jax.nn.silu(jnp.einsum("td,edi->tei", x, wg)) * jnp.einsum("td,edi->tei", x, wu)
        h = h * combine[..., None].astype(h.dtype)  # unselected experts contribute exactly 0
        return jnp.einsum("tei,eid->td", h, wd, preferred_element_type=jnp.float32)
    if mode == "ragged":
        # unrouted pairs sort last (key n_exp) into no group; their rows of xs are zeroed (x may be NaN there) and
        # their results dropped, whatever ragged_dot leaves in rows past the groups
        key, order, sizes = sort_pairs(experts, n_exp)
        token = order // k
        kept = (key[order] < n_exp)[:, None]
        xs = jnp.where(kept, x[token], jnp.zeros((), x.dtype))
        g = jax.lax.ragged_dot(xs, wg, sizes)
        u = jax.lax.ragged_dot(xs, wu, sizes)
        y = jax.lax.ragged_dot(jax.nn.silu(g) * u, wd, sizes)
        y = jnp.where(kept, y.astype(jnp.float32) * weights.reshape(-1)[order][:, None], 0.0)
        return jnp.zeros((t, x.shape[1]), jnp.float32).at[token].add(y)
    raise ValueError(f"moe: unknown mode {mode!r} (available: {', '.join(MODES)})")
