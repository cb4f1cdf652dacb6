"""Pallas Triton grouped GEMMs for the routed experts (kernels/moe.py), over the tile layout of `moe.tile_plan`.

Two kernels, each on a grid (column block, tile) whose tile index runs fastest, so the programs in flight share
a column block and consecutive tiles of one expert find its weight block in L2:
  up:   h[tile rows, n-block] = silu(x[tokens] @ gate_e) * (x[tokens] @ up_e), the x rows gathered by token;
  down: y[pair, d-block] = w_pair * (h[tile rows] @ down_e), stored at each row's (token, j) pair index.
Empty tiles (first row -1) do no work, so a decode step reads only the weights of the experts it uses.
The combine y[T, k, D].sum(1) is one XLA reduction outside.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .moe import tile_plan, tile_rows
from .sparse_mla_triton import col_range, dot, gather

_DROP = 2**30  # row index of masked stores: out of range, so the interpreter drops them too


def _block(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n, or 0 below 16 (the narrowest dot)."""
    b = cap
    while b >= 16 and n % b:
        b //= 2
    return b if b >= 16 else 0


def supported(d: int, i: int) -> bool:
    """Whether the kernels take these widths (hidden D, this shard's expert width I)."""
    return bool(_block(d, 16) and _block(i, 16))


def _gate_up(src_ref, te_ref, x_ref, wg_ref, wu_ref, *, tile, n0, bn, k0, steps, k, bk, interpret):
    """float32 (x @ gate_e, x @ up_e) [tile, bn] of columns [n0, n0 + bn) over hidden columns
    [k0, k0 + steps * bk), the x rows gathered by the tile's tokens (padding rows read as zeros). Program ids
    are read by the caller, outside its `pl.when` (the interpreter cannot evaluate them inside)."""
    src = src_ref[...]
    e = te_ref[0]
    valid = src >= 0
    token = jnp.where(valid, src // k, 0)

    def body(s, acc):
        c0 = k0 + s * bk
        xt = gather(x_ref, token, col_range(c0, bk), valid, interpret)  # [tile, bk]
        return (acc[0] + dot(xt, wg_ref[e, pl.ds(c0, bk), pl.ds(n0, bn)]),
                acc[1] + dot(xt, wu_ref[e, pl.ds(c0, bk), pl.ds(n0, bn)]))

    z = jnp.zeros((tile, bn), jnp.float32)
    return jax.lax.fori_loop(0, steps, body, (z, z))


def _up_kernel(src_ref, te_ref, x_ref, wg_ref, wu_ref, h_ref, *, k, bk, interpret):
    tile, bn = h_ref.shape
    n0 = pl.program_id(0) * bn

    @pl.when(src_ref[0] >= 0)
    def _():
        g, u = _gate_up(src_ref, te_ref, x_ref, wg_ref, wu_ref, tile=tile, n0=n0, bn=bn, k0=0,
                        steps=x_ref.shape[1] // bk, k=k, bk=bk, interpret=interpret)
        h_ref[...] = (jax.nn.silu(g) * u).astype(h_ref.dtype)


def _up_partial_kernel(src_ref, te_ref, x_ref, wg_ref, wu_ref, g_ref, u_ref, *, k, bk, interpret):
    """Split-K form of the up kernel (few tiles: decode at small batch): program (n, m, c) sums hidden columns
    [c * D / k_split, +D / k_split) into float32 partials of gate and up; SwiGLU after the sum, outside."""
    tile, bn = g_ref.shape
    n0 = pl.program_id(0) * bn
    steps = x_ref.shape[1] // bk // pl.num_programs(2)
    k0 = pl.program_id(2) * steps * bk

    @pl.when(src_ref[0] >= 0)
    def _():
        g_ref[...], u_ref[...] = _gate_up(src_ref, te_ref, x_ref, wg_ref, wu_ref, tile=tile, n0=n0, bn=bn, k0=k0,
                                          steps=steps, k=k, bk=bk, interpret=interpret)

    @pl.when(src_ref[0] < 0)
    def _():  # defined values for the rows of empty tiles, which the sum outside reads
        g_ref[...] = jnp.zeros((tile, bn), jnp.float32)
        u_ref[...] = jnp.zeros((tile, bn), jnp.float32)


def _down_kernel(src_ref, te_ref, w_ref, h_ref, wd_ref, y_ref, *, bn, bk):
    tile = src_ref.shape[0]
    n0 = pl.program_id(0) * bn
    m0 = pl.program_id(1) * tile

    @pl.when(src_ref[0] >= 0)
    def _():
        src = src_ref[...]
        e = te_ref[0]

        def body(s, acc):
            return acc + dot(h_ref[pl.ds(m0, tile), pl.ds(s * bk, bk)], wd_ref[e, pl.ds(s * bk, bk), pl.ds(n0, bn)])

        acc = jax.lax.fori_loop(0, h_ref.shape[1] // bk, body, jnp.zeros((tile, bn), jnp.float32))
        y = (acc * w_ref[...][:, None]).astype(y_ref.dtype)
        valid = src >= 0
        rows = jnp.where(valid, src, _DROP)  # out of range: the interpreter drops masked rows too
        plgpu.store(y_ref.at[rows[:, None], col_range(n0, bn)[None, :]], y, mask=valid[:, None])


def default_config(t: int, k: int, n_exp: int, d: int, i: int, itemsize: int = 2) -> dict:
    """Tile rows and block widths: decode-sized tiles stream weights (wide K steps, deep pipelines); prefill
    tiles of 128 rows feed the tensor cores. float32 weights (`itemsize` 4: the reference models) take 64 x 32
    blocks in 2 stages, since the bf16 blocks would ask for more shared memory than a CTA has."""
    tile = tile_rows(t, k, n_exp)
    if itemsize >= 4:
        return {"tile": tile, "bn_up": _block(i, 64), "bk_up": _block(d, 32), "bn_down": _block(d, 64),
                "bk_down": _block(i, 32), "num_warps": 8 if tile >= 64 else 4, "num_stages": 2, "k_split": 1}
    big = tile >= 64
    return {"tile": tile, "bn_up": _block(i, 128 if big else 64), "bk_up": _block(d, 64 if big else 128),
            "bn_down": _block(d, 128 if big else 64), "bk_down": _block(i, 64 if big else 128),
            "num_warps": 8 if big else 4, "num_stages": 3 if big else 4, "k_split": 1}


def grouped_swiglu(x, experts, weights, wg, wu, wd, *, interpret: bool = False, **options):
    """float32 [T, D]: the routed experts by the two grouped-GEMM kernels; `options` override
    `default_config` (tile, bn_up, bk_up, bn_down, bk_down, num_warps, num_stages, k_split: the up projection
    split over k_split programs along the hidden size, a launch option for few tiles)."""
    t, k = experts.shape
    n_exp, d, i = wg.shape
    cfg = default_config(t, k, n_exp, d, i, jnp.dtype(wg.dtype).itemsize)
    unknown = set(options) - set(cfg)
    if unknown:
        raise ValueError(f"moe triton: unknown options {sorted(unknown)} (known: {sorted(cfg)})")
    cfg.update(options)
    tile = cfg["tile"]
    src, tile_expert = tile_plan(experts, n_exp, tile)
    n_tiles = tile_expert.shape[0]
    pair_w = jnp.where(src >= 0, weights.reshape(-1).astype(jnp.float32)[jnp.maximum(src, 0)], 0.0)
    params = plgpu.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    tile_specs = [pl.BlockSpec((tile,), lambda n, m: (m,)), pl.BlockSpec((1,), lambda n, m: (m,))]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)

    bn, ks = cfg["bn_up"], cfg["k_split"]
    if ks < 1 or ks & (ks - 1) or d % (ks * cfg["bk_up"]):
        raise ValueError(f"moe triton: k_split {ks} must be a power of two dividing D / bk_up = {d // cfg['bk_up']}")
    if ks == 1:
        h = pl.pallas_call(
            functools.partial(_up_kernel, k=k, bk=cfg["bk_up"], interpret=interpret),
            grid=(i // bn, n_tiles),
            in_specs=tile_specs + [any_spec] * 3,
            out_specs=pl.BlockSpec((tile, bn), lambda n, m: (m, n)),
            out_shape=jax.ShapeDtypeStruct((n_tiles * tile, i), x.dtype),
            compiler_params=params, interpret=interpret, name="moe_up",
        )(src, tile_expert, x, wg, wu)
    else:
        part = jax.ShapeDtypeStruct((ks, n_tiles * tile, i), jnp.float32)
        g, u = pl.pallas_call(
            functools.partial(_up_partial_kernel, k=k, bk=cfg["bk_up"], interpret=interpret),
            grid=(i // bn, n_tiles, ks),
            in_specs=[pl.BlockSpec((tile,), lambda n, m, c: (m,)), pl.BlockSpec((1,), lambda n, m, c: (m,))]
            + [any_spec] * 3,
            out_specs=[pl.BlockSpec((None, tile, bn), lambda n, m, c: (c, m, n))] * 2,
            out_shape=[part, part],
            compiler_params=params, interpret=interpret, name="moe_up_split_k",
        )(src, tile_expert, x, wg, wu)
        h = (jax.nn.silu(g.sum(0)) * u.sum(0)).astype(x.dtype)

    bn = cfg["bn_down"]
    y = pl.pallas_call(
        functools.partial(_down_kernel, bn=bn, bk=cfg["bk_down"]),
        grid=(d // bn, n_tiles),
        in_specs=tile_specs + [pl.BlockSpec((tile,), lambda n, m: (m,)), any_spec, any_spec],
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((t * k, d), x.dtype),
        compiler_params=params, interpret=interpret, name="moe_down",
    )(src, tile_expert, pair_w, h, wd)
    return y.astype(jnp.float32).reshape(t, k, d).sum(1)
