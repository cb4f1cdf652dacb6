"""Routed experts: every xla form and the Pallas Triton grouped GEMMs against a per-token loop (numpy, float64),
narrow expert widths (a tiny model's TP shard) in the kernel itself, the lowering at GLM-5.2 widths."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels import fp8_formats, moe
from kernels.moe import tiles as moe_tiles
from kernels.moe import triton as moe_triton
from kernels.common.triton_common import lower_for_gpu, triton_calls


def _oracle(x, experts, weights, wg, wu, wd):
    """y[t] = sum_j w[t, j] * down_e(silu(x gate_e) * (x up_e)), one token and expert at a time."""
    x, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, wg, wu, wd))
    y = np.zeros((x.shape[0], x.shape[1]))
    for t in range(x.shape[0]):
        for e, w in zip(np.asarray(experts[t]), np.asarray(weights[t], np.float64)):
            g, u = x[t] @ wg[e], x[t] @ wu[e]
            y[t] += w * ((g / (1 + np.exp(-g)) * u) @ wd[e])
    return y


def _inputs(t, k, n_exp, d, i, *, seed, skew=False, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    if skew:  # every token picks expert 3 (more rows than a tile) plus random others
        experts = np.stack([np.concatenate([[3], rng.choice([e for e in range(n_exp) if e != 3], k - 1,
                                                            replace=False)]) for _ in range(t)])
    else:
        experts = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)])
    w = rng.uniform(0.1, 1.0, size=(t, k))
    x = rng.normal(size=(t, d))
    wg, wu = (rng.normal(size=(n_exp, d, i)) / np.sqrt(d) for _ in range(2))
    wd = rng.normal(size=(n_exp, i, d)) / np.sqrt(i)
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(x), jnp.asarray(experts, jnp.int32), jnp.asarray(w, jnp.float32), cast(wg), cast(wu), cast(wd)


def _rel(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


def _run(impl, args, **options):
    with jax.default_matmul_precision("highest"):  # IEEE float32 on every backend (a GPU's default is TF32)
        return jax.jit(functools.partial(moe.routed_experts, impl=impl, **options))(*args)


@pytest.mark.parametrize("mode", moe.MODES)
def test_xla_forms_match_oracle(mode):
    args = _inputs(11, 3, 8, 32, 16, seed=1)
    with jax.default_matmul_precision("highest"):  # IEEE float32 on a GPU too (its default is TF32)
        assert _rel(moe.routed_experts(*args, mode=mode), _oracle(*args)) < 1e-5


@pytest.mark.parametrize("t,k,n_exp,skew,options", [
    (1, 2, 8, False, {}),             # decode, one token: two non-empty tiles
    (13, 4, 8, False, {}),            # experts with several rows, tiles padded
    (40, 2, 4, True, {"tile": 16}),   # expert 3 has 40 rows: three tiles of one expert
    (9, 3, 16, False, {"tile": 32, "bk_up": 16, "bn_up": 16, "bk_down": 16, "bn_down": 16}),  # many K steps
    (1, 2, 8, False, {"k_split": 2, "bk_up": 32}),       # split-K up projection, one token
    (13, 4, 8, False, {"k_split": 4, "bk_up": 16}),      # split-K with empty tiles beside full ones
])
def test_triton_matches_oracle(kernel_impl, t, k, n_exp, skew, options):
    args = _inputs(t, k, n_exp, 64, 32, seed=t * k, skew=skew)
    got = _run(kernel_impl, args, **options)
    assert got.shape == (t, 64) and got.dtype == jnp.float32
    assert _rel(got, _oracle(*args)) < 1e-5


def test_triton_bf16_close_to_oracle(kernel_impl):
    args = _inputs(24, 4, 8, 64, 32, seed=7, dtype=jnp.bfloat16)
    assert _rel(moe.routed_experts(*args, impl=kernel_impl), _oracle(*args)) < 2e-2


@pytest.mark.parametrize("d,i,options", [
    (64, 4, {}),                        # the tiny model's expert width 32 over TP = 8: one masked 16-wide block
    (24, 8, {}),                        # hidden 24: masked hidden steps and output columns too
    (40, 20, {"k_split": 2, "bk_up": 32}),  # widths past one block, not multiples of 16; split-K, masked D
])
def test_narrow_widths_run_in_the_kernel(impl, d, i, options):
    """Widths below or not a multiple of the 16-wide blocks: every impl matches the float64 oracle, and the
    kernel impl runs the kernels (moe_up, moe_down in its program), not a silent xla fallback."""
    args = _inputs(5, 2, 4, d, i, seed=d + i)
    opts = options if impl != "xla" else {}
    assert _rel(_run(impl, args, **opts), _oracle(*args)) < 1e-5
    jaxpr = str(jax.make_jaxpr(functools.partial(moe.routed_experts, impl=impl, **opts))(*args))
    kernels = ("moe_up_split_k" if options.get("k_split", 1) > 1 else "moe_up", "moe_down")
    assert all((f"name={n}" in jaxpr) == (impl != "xla") for n in kernels), impl


def test_tile_plan_covers_every_pair_once():
    experts = jnp.asarray(np.random.default_rng(3).integers(0, 6, size=(17, 3)), jnp.int32)
    src, tile_expert = moe_tiles.tile_plan(experts, 6, 4)
    src, tile_expert = np.asarray(src), np.asarray(tile_expert)
    assert sorted(src[src >= 0].tolist()) == list(range(17 * 3))
    tiles = src.reshape(-1, 4)
    for tile, e in zip(tiles, tile_expert):
        real = tile[tile >= 0]
        assert np.all(np.asarray(experts).reshape(-1)[real] == e)  # one expert per tile
        assert np.all(tile[: len(real)] >= 0)  # real rows first: a tile is empty iff its first row is -1


def test_bad_options_are_named(kernel_impl):
    args = _inputs(3, 2, 4, 64, 32, seed=0)
    with pytest.raises(ValueError, match="k_split 3"):
        moe.routed_experts(*args, impl=kernel_impl, k_split=3)
    with pytest.raises(ValueError, match="k_split 4 must be a power of two dividing D / bk_up = 2"):
        moe.routed_experts(*args, impl=kernel_impl, k_split=4, bk_up=32)
    with pytest.raises(ValueError, match=r"unknown options \['block_h'\]"):
        moe.routed_experts(*args, impl=kernel_impl, block_h=16)
    with pytest.raises(ValueError, match="bn_up 8 must be a power of two >= 16"):
        moe.routed_experts(*args, impl=kernel_impl, bn_up=8)
    with pytest.raises(ValueError, match="mode 'tiles' forces an xla form"):
        moe.routed_experts(*args, impl=kernel_impl, mode="tiles", tile=16)
    with pytest.raises(ValueError, match="swap_ab 'yes' must be a bool"):
        moe.routed_experts(*args, impl=kernel_impl, swap_ab="yes")
    with pytest.raises(ValueError, match="quant_h 2 must be a bool or None"):
        moe.routed_experts(*args, impl=kernel_impl, quant_h=2)
    with pytest.raises(ValueError, match="swap_ab is for form 'w8a8' over K-major"):
        moe.routed_experts(*args, impl=kernel_impl, swap_ab=True)  # bf16 experts
    with pytest.raises(ValueError, match="quant_h quantises h in the up kernel"):
        moe.routed_experts(*args, impl=kernel_impl, quant_h=True)


def test_bad_shapes_are_named():
    x, e, w, wg, wu, wd = _inputs(3, 2, 4, 32, 16, seed=0)
    with pytest.raises(ValueError, match="down"):
        moe.routed_experts(x, e, w, wg, wu, wd[:, :8], impl="triton_interpret")
    with pytest.raises(ValueError, match="weights"):
        moe.routed_experts(x, e, w[:, :1], wg, wu, wd)


def test_lowers_at_glm52_shapes():
    """The Pallas -> Triton lowering at GLM-5.2 widths (D 6144, I 2048, 256 experts) for decode and prefill:
    the up kernel on grid (I / bn_up, tiles), the down kernel on (D / bn_down, tiles), tiles = ceil(T k / tile)
    + min(E, T k); at T = 32 the split-K up kernel on (I / bn_up, tiles, k_split)."""
    s = jax.ShapeDtypeStruct
    for t in (32, 4096):
        args = (s((t, 6144), jnp.bfloat16), s((t, 8), jnp.int32), s((t, 8), jnp.float32),
                s((256, 6144, 2048), jnp.bfloat16), s((256, 6144, 2048), jnp.bfloat16),
                s((256, 2048, 6144), jnp.bfloat16))
        cfg = moe_triton.default_config(t, 8, 256, 6144, 2048)
        n_tiles = -(-t * 8 // cfg.tile) + min(256, t * 8)
        assert (t, cfg.tile, n_tiles) in ((32, 16, 272), (4096, 128, 512))
        calls = triton_calls(lower_for_gpu(moe_triton.grouped_swiglu, *args))
        assert [(c.name, c.grid) for c in calls] == [("moe_up", (2048 // cfg.bn_up, n_tiles, 1)),
                                                     ("moe_down", (6144 // cfg.bn_down, n_tiles, 1))]
        if t == 32:
            calls = triton_calls(lower_for_gpu(functools.partial(moe_triton.grouped_swiglu, k_split=4), *args))
            assert [(c.name, c.grid) for c in calls] == [("moe_up_split_k", (2048 // cfg.bn_up, n_tiles, 4)),
                                                         ("moe_down", (6144 // cfg.bn_down, n_tiles, 1))]


def test_narrow_widths_lower():
    """The masked loads and stores of narrow widths lower to Triton too (D 24, I 4: 16-wide blocks)."""
    s = jax.ShapeDtypeStruct
    args = (s((5, 24), jnp.float32), s((5, 2), jnp.int32), s((5, 2), jnp.float32), s((4, 24, 4), jnp.float32),
            s((4, 24, 4), jnp.float32), s((4, 4, 24), jnp.float32))
    calls = triton_calls(lower_for_gpu(moe_triton.grouped_swiglu, *args))
    assert [(c.name, c.grid) for c in calls] == [("moe_up", (1, 1 + 4, 1)), ("moe_down", (2, 1 + 4, 1))]


def test_float32_config_fits_shared_memory():
    """Hand count of the pipelined tiles of the float32 blocks (x rows + gate and up blocks, bytes x stages)."""
    for t in (1, 32, 2048):
        c = moe_triton.default_config(t, 8, 256, 6144, 2048, itemsize=4)
        up = (c.tile * c.bk_up + 2 * c.bk_up * c.bn_up) * 4 * c.num_stages
        down = (c.tile * c.bk_down + c.bk_down * c.bn_down) * 4 * c.num_stages
        assert max(up, down) <= 160 * 1024, c
    assert dataclasses.replace(c, k_split=2).k_split == 2


# ------------------------------------------------------------------------------ GPU (native Triton)

@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 32, 128, 2048])
def test_gpu_glm52_widths(kernel_impl, t):
    """Native kernels at GLM-5.2 widths (64 experts to keep the test small) against the xla forms in float32."""
    args = _inputs(t, 8, 64, 6144, 512, seed=t, dtype=jnp.bfloat16)
    want = moe.experts_xla(*(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args), mode="tiles")
    got = jax.jit(functools.partial(moe.routed_experts, impl=kernel_impl))(*args)
    assert _rel(got, np.asarray(want, np.float64)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t", [4, 2048])
def test_gpu_float32_weights(kernel_impl, t):
    """A float32 model at GLM-5.2 widths: the float32 block sizes fit shared memory, and the dots are IEEE
    float32 (the oracle under "highest" too: a GPU's float32 default is TF32)."""
    args = _inputs(t, 8, 32, 6144, 512, seed=t)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(moe.experts_xla(*args, mode="tiles"), np.float64)
    got = jax.jit(functools.partial(moe.routed_experts, impl=kernel_impl))(*args)
    assert _rel(got, want) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("d,i", [(64, 4), (24, 8), (1024, 40)])
def test_gpu_narrow_widths(kernel_impl, d, i):
    """The masked narrow-width blocks natively (the tiny models under TP), float32 and bf16."""
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        args = _inputs(37, 4, 8, d, i, seed=d + i, dtype=dtype)
        assert _rel(_run(kernel_impl, args), _oracle(*args)) < tol


# ------------------------------------------------------------------------------ FP8 experts (W8A16)

def _fp8_inputs(t, k, n_exp, d, i, i_off, *, seed, dtype=jnp.float32):
    """Routed experts with e4m3 weights: the expert-width slice [i_off, i_off + i) of block-quantised experts wider
    than it (a TP shard starting mid-block when i_off % 128 != 0), the scale sub-grids covering it, and the
    float64 dequantised weights for the oracle."""
    rng = np.random.default_rng(seed)
    wide = i_off + i + 9
    q, s, deq = [], [], []
    for shape, axis in (((n_exp, d, wide), 2), ((n_exp, d, wide), 2), ((n_exp, wide, d), 1)):
        w = rng.normal(size=shape) * rng.uniform(0.2, 3.0, size=shape[:2] + (1,)) / np.sqrt(d if axis == 2 else i)
        wq, ws = fp8_formats.quantize_weight_blocks(w)
        nb = fp8_formats.block_count(i, i_off)
        wq = wq[:, :, i_off:i_off + i] if axis == 2 else wq[:, i_off:i_off + i]
        ws = ws[:, :, :nb] if axis == 2 else ws[:, :nb]
        r, c = (0, i_off) if axis == 2 else (i_off, 0)
        q.append(wq)
        s.append(ws)
        deq.append(np.asarray(fp8_formats.dequantize_weight_blocks(wq, ws, r, c), np.float64))
    experts = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)])
    x = jnp.asarray(rng.normal(size=(t, d)), dtype)
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=(t, k)), jnp.float32)
    scales = dict(wg_scale=s[0], wu_scale=s[1], wd_scale=s[2], i_offset=i_off)
    return (x, jnp.asarray(experts, jnp.int32), w, *q), scales, deq


@pytest.mark.parametrize("t,k,n_exp,d,i,i_off,options", [
    (3, 2, 8, 256, 192, 0, {}),                       # whole hidden blocks, a ragged width block
    (13, 4, 8, 130, 40, 100, {}),                     # ragged hidden, a width shard across a block boundary
    (3, 2, 8, 256, 256, 0, {"k_split": 2, "bk_up": 64}),  # split-K up projection
    (3, 2, 8, 256, 192, 64, {"bk_down": 64}),         # offset on a step boundary: the aligned down loads
    (3, 2, 8, 256, 256, 0, {"bn_down": 256, "bk_down": 32}),  # down blocks wider than one scale block
])
def test_fp8_matches_oracle(impl, t, k, n_exp, d, i, i_off, options):
    """FP8 experts in float32 rows: every impl within float32 rounding of the float64 oracle over the
    dequantised weights (a wrong block index, scale or offset is O(1)); the kernel impl runs the kernels."""
    args, scales, deq = _fp8_inputs(t, k, n_exp, d, i, i_off, seed=t + i + i_off)
    opts = dict(options, form="w8a16") if impl != "xla" else {}  # the W8A16 kernels (fp8_form may pick W8A8)
    got = _run(impl, args, **scales, **opts)
    assert got.shape == (t, d) and got.dtype == jnp.float32
    assert _rel(got, _oracle(args[0], args[1], args[2], *deq)) < 2e-6
    jaxpr = str(jax.make_jaxpr(functools.partial(moe.routed_experts, impl=impl, **scales, **opts))(*args))
    assert ("name=moe_down" in jaxpr) == (impl != "xla")


@pytest.mark.parametrize("mode", moe.MODES)
def test_fp8_xla_forms(mode):
    args, scales, deq = _fp8_inputs(5, 2, 8, 130, 40, 100, seed=2)
    assert _rel(moe.routed_experts(*args, mode=mode, **scales), _oracle(args[0], args[1], args[2], *deq)) < 2e-6


def test_fp8_bf16_rows(kernel_impl):
    """bf16 rows (h stored in bf16 between the kernels): within bf16 rounding of the oracle."""
    args, scales, deq = _fp8_inputs(24, 4, 8, 256, 128, 0, seed=7, dtype=jnp.bfloat16)
    got = moe.routed_experts(*args, impl=kernel_impl, form="w8a16", **scales)
    assert _rel(got, _oracle(args[0], args[1], args[2], *deq)) < 2e-2


@pytest.mark.parametrize("t,options", [(24, {}), (5, {"k_split": 2}), (40, {"tile": 64, "bn_up": 64, "bn_down": 64})])
def test_fp8_packed_words(kernel_impl, t, options):
    """The uint16-word form of FP8 experts (two e4m3 columns a word: the form of expert stacks of 2**31+
    elements, whose int32 offsets would overflow), forced on a small stack: the same oracle, split-K and
    128-row tiles included."""
    args, scales, deq = _fp8_inputs(t, 4, 8, 256, 128, 0, seed=11 + t, dtype=jnp.bfloat16)
    got = moe.routed_experts(*args, impl=kernel_impl, packed=True, form="w8a16", **scales, **options)
    assert _rel(got, _oracle(args[0], args[1], args[2], *deq)) < 2e-2
    with pytest.raises(ValueError, match="need the blocks to divide the widths"):
        bad, bad_scales, _ = _fp8_inputs(3, 2, 4, 130, 40, 0, seed=0)
        moe.routed_experts(*bad, impl=kernel_impl, packed=True, **bad_scales)


def _np_quantize_rows(a):
    """numpy float64 of W8A8's activation quantisation (docs/math.md §11), independent of kernels.common.fp8_formats:
    per row and 128-column block s = max(amax / 448, FLT_MIN) (float32), q = e4m3(a / s) (float32 IEEE division,
    round to nearest even by ml_dtypes). Returns (decoded q as float64, s as float64 [rows, blocks])."""
    a = np.asarray(a, np.float32)
    rows, cols = a.shape
    blk = a.reshape(rows, cols // 128, 128)
    s = np.maximum(np.abs(blk).max(-1) / np.float32(448), np.float32(1.1754944e-38)).astype(np.float32)
    q = (blk / s[..., None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float64).reshape(rows, cols)
    return q, s.astype(np.float64)


def _oracle_w8a8(x, experts, weights, qg, qu, qd, sg, su, sd, h_dtype):
    """float64 numpy of the W8A8 routed experts: x and h quantised per row and 128-block, each 128-K partial of
    the e4m3 products scaled by the row's and the weight block's scales; h rounded to `h_dtype` first (the
    kernels store it in the rows' dtype between the two GEMMs). Decodes only the experts the rows use."""
    dec = lambda q: np.asarray(jnp.asarray(q).astype(jnp.float32), np.float64)  # noqa: E731 (e4m3 -> exact)
    xq, xs = _np_quantize_rows(np.asarray(jnp.asarray(x).astype(jnp.float32)))
    experts = np.asarray(experts)

    def gemm(aq, as_, wq, ws):  # rows [R, K] x weight [K, N], 128-K partials each scaled
        out = np.zeros((aq.shape[0], wq.shape[1]))
        for kb in range(wq.shape[0] // 128):
            part = aq[:, kb * 128:(kb + 1) * 128] @ wq[kb * 128:(kb + 1) * 128]
            out += part * as_[:, kb:kb + 1] * np.repeat(ws[kb], 128)[None, :wq.shape[1]]
        return out

    y = np.zeros((x.shape[0], qg.shape[1]))
    for e in np.unique(experts):
        rows, slot = np.nonzero(experts == e)
        wg, wu, wd = dec(qg[e]), dec(qu[e]), dec(qd[e])
        sge, sue, sde = (np.asarray(a[e], np.float64) for a in (sg, su, sd))
        g, u = gemm(xq[rows], xs[rows], wg, sge), gemm(xq[rows], xs[rows], wu, sue)
        h = np.asarray((g / (1 + np.exp(-g)) * u).astype(np.float32).astype(h_dtype), np.float32)
        hq, hs = _np_quantize_rows(h)
        y[rows] += np.asarray(weights, np.float64)[rows, slot][:, None] * gemm(hq, hs, wd, sde)
    return y


@pytest.mark.parametrize("t,options", [
    (3, {}),
    (24, {"packed": True}),                                  # uint16 words, fp8 operands from the two bytes
    (5, {"k_split": 2}),                                     # split-K up projection
    (40, {"tile": 64, "bn_up": 256, "bn_down": 256, "bk_up": 64, "bk_down": 64}),  # wide blocks, 64-K steps
])
def test_fp8_w8a8_matches_oracle(kernel_impl, t, options):
    """form "w8a8": rows quantised per 128-block and e4m3 x e4m3 GEMMs, against a float64 oracle of that
    arithmetic. W8A16 on the same inputs is ~3% away (the activation rounding), so the bound tells the forms
    apart; a wrong activation scale or block index is O(1)."""
    args, scales, deq = _fp8_inputs(t, 4, 8, 256, 256, 0, seed=21 + t, dtype=jnp.bfloat16)
    want = _oracle_w8a8(*args, scales["wg_scale"], scales["wu_scale"], scales["wd_scale"], ml_dtypes.bfloat16)
    got = _run(kernel_impl, args, form="w8a8", **scales, **options)
    assert _rel(got, want) < 2e-3
    w8a16 = _run(kernel_impl, args, form="w8a16", **scales)
    assert _rel(w8a16, want) > 1e-2  # the oracle is W8A8's, not W8A16's
    with pytest.raises(ValueError, match="must divide the widths"):
        moe.routed_experts(*args, impl=kernel_impl, form="w8a8", bn_up=512, **scales)
    with pytest.raises(ValueError, match="form 'w8a8' needs FP8 experts of whole 128-blocks"):
        bad, bad_scales, _ = _fp8_inputs(3, 2, 4, 130, 40, 0, seed=0)
        moe.routed_experts(*bad, impl=kernel_impl, form="w8a8", **bad_scales)


@pytest.mark.parametrize("t,options", [
    (5, {}),
    (24, {}),                                                # the decode default from 16 rows: quant_h, swap_ab
    (40, {"tile": 64, "bn_up": 256, "bn_down": 256, "bk_up": 64}),
    (24, {"packed": True}),                                  # uint16 words of two K values
    (5, {"packed": True, "k_split": 2, "bk_up": 64, "bk_down": 64}),
    (5, {"swap_ab": True}),                                  # weights on the MMA's M side
    (24, {"swap_ab": True, "packed": True}),
    (5, {"swap_ab": True, "k_split": 2, "bn_up": 64, "bk_up": 64, "bn_down": 256}),
    (24, {"quant_h": True, "k_split": 1}),                   # h quantised in the up kernel
    (5, {"quant_h": True, "swap_ab": True, "packed": True, "k_split": 1}),
])
def test_fp8_w8a8_k_major_stacks(kernel_impl, on_gpu, t, options):
    """W8A8 over K-major stacks (w_layout "nk": each expert [out, in] as released, the scale grids in the same
    orientation), plain and as uint16 words of two K values (the form of 2**31+ element stacks), gives the W8A8
    oracle; W8A16 refuses that layout."""
    args, scales, deq = _fp8_inputs(t, 4, 8, 256, 256, 0, seed=31 + t, dtype=jnp.bfloat16)
    x, e, w, qg, qu, qd = args
    want = _oracle_w8a8(*args, scales["wg_scale"], scales["wu_scale"], scales["wd_scale"], ml_dtypes.bfloat16)
    t_ = lambda q: jnp.swapaxes(q, 1, 2)  # noqa: E731
    sc = {k: t_(v) for k, v in scales.items() if k != "i_offset"}  # the grids in the stacks' orientation
    with jax.default_matmul_precision("highest"):
        got = moe_triton.grouped_swiglu(x, e, w, t_(qg), t_(qu), t_(qd), form="w8a8", w_layout="nk",
                                        interpret=kernel_impl.endswith("interpret"), **sc, **options)
    # CPU: float32 partials; a GPU's fp8 tensor cores sum a 128-K partial with ~14 mantissa bits (docs/math.md §11):
    # 7.2e-3 seen on the H200 with 64-row tiles. A wrong scale or block is O(1), W8A16 ~3% away.
    assert _rel(got, want) < (1e-2 if on_gpu else 5e-3)
    with pytest.raises(ValueError, match="for form 'w8a8'"):
        moe_triton.grouped_swiglu(x, e, w, t_(qg), t_(qu), t_(qd), w_layout="nk", interpret=True, **sc)


@pytest.mark.parametrize("options", [{}, {"swap_ab": True}])
def test_fp8_w8a8_quant_h_is_the_unfused_rule(kernel_impl, options):
    """quant_h (h quantised per row and 128-block inside the up kernel) gives bit for bit the output of the unfused
    path (h stored in the rows' dtype, then `quantize_activation_blocks` in XLA) under the interpreter: the same
    rounding, the same IEEE divisions, the same down kernel (on a GPU, within a few e4m3 roundings). Needs 128-wide
    up blocks and no split-K, else a ValueError names it."""
    args, scales, _ = _fp8_inputs(24, 4, 8, 256, 384, 0, seed=5, dtype=jnp.bfloat16)
    x, e, w, qg, qu, qd = args
    t_ = lambda q: jnp.swapaxes(q, 1, 2)  # noqa: E731
    sc = {k: t_(v) for k, v in scales.items() if k != "i_offset"}
    run = functools.partial(moe_triton.grouped_swiglu, x, e, w, t_(qg), t_(qu), t_(qd), form="w8a8", w_layout="nk",
                            interpret=kernel_impl.endswith("interpret"), **sc, **options)
    got, want = np.asarray(run(quant_h=True, k_split=1)), np.asarray(run(k_split=1))
    if kernel_impl.endswith("interpret"):  # the same jnp ops: bit for bit
        np.testing.assert_array_equal(got, want)
    else:  # the H200 rounded a few h values to the neighbouring e4m3 value at the probe's shape (2.3e-3 apart)
        assert _rel(got, want) < 5e-3
    with pytest.raises(ValueError, match="quant_h quantises h in the up kernel"):
        run(quant_h=True, k_split=2)
    with pytest.raises(ValueError, match="quant_h quantises h in the up kernel"):
        run(quant_h=True, k_split=1, bn_up=64)


def _k_major(args, scales):
    """The FP8 inputs of `_fp8_inputs` as K-major stacks (gate/up [E, I, D], down [E, D, I]) with their scale grids
    in the same orientation, as the model stores them (w_layout "nk")."""
    t_ = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
    return ((*args[:3], *(t_(q) for q in args[3:])),
            dict(scales, **{n: t_(scales[n]) for n in ("wg_scale", "wu_scale", "wd_scale")}))


def _f8_transposes(fn, *args) -> int:
    """How many e4m3 transposes the jaxpr of `fn(*args)` holds (the "nk" -> "kn" copies)."""
    return len(re.findall(r"f8_e4m3fn\[[0-9,]*\] = transpose", str(jax.make_jaxpr(fn)(*args))))


@pytest.mark.parametrize("t,d,i,i_off,mode", [
    (3, 256, 256, 0, None),       # whole blocks
    (5, 130, 40, 100, None),      # ragged hidden, a width shard across a block boundary
    (5, 130, 40, 100, "gather"),  # a forced form
])
def test_fp8_k_major_xla(t, d, i, i_off, mode):
    """routed_experts(w_layout="nk") by the xla reference: the float64 oracle of the same dequantised experts."""
    args, scales, deq = _fp8_inputs(t, 2, 8, d, i, i_off, seed=41 + t + i_off)
    nk_args, nk_scales = _k_major(args, scales)
    got = moe.routed_experts(*nk_args, mode=mode, w_layout="nk", **nk_scales)
    assert _rel(got, _oracle(args[0], args[1], args[2], *deq)) < 2e-6


def test_fp8_k_major_traced_offset(impl):
    """A traced i_offset with K-major stacks and worst-case grids: the xla reference, and the kernels by the
    W8A16 path (a traced offset is not known to be on a block boundary)."""
    args, scales, deq = _fp8_inputs(6, 2, 4, 130, 40, 100, seed=3)
    nk_args, nk_scales = _k_major(args, scales)
    f = jax.jit(lambda off, *a: moe.routed_experts(*a, impl=impl, w_layout="nk", **dict(nk_scales, i_offset=off)))
    assert _rel(f(jnp.int32(100), *nk_args), _oracle(args[0], args[1], args[2], *deq)) < 2e-6


def test_fp8_k_major_w8a8_decode(kernel_impl):
    """Decode tiles of whole blocks: fp8_form's W8A8 runs on the K-major bytes (no e4m3 transpose in the
    program), the W8A8 oracle; an explicit form="w8a8" the same program. D != I, so grids read on the wrong axes
    fail."""
    args, scales, deq = _fp8_inputs(5, 4, 8, 256, 384, 0, seed=5, dtype=jnp.bfloat16)
    assert moe.fp8_form(5, 4, 8, 256, 384, 0) == "w8a8"
    want = _oracle_w8a8(*args, scales["wg_scale"], scales["wu_scale"], scales["wd_scale"], ml_dtypes.bfloat16)
    nk_args, nk_scales = _k_major(args, scales)
    assert _rel(_run(kernel_impl, nk_args, w_layout="nk", **nk_scales), want) < 5e-3
    programs = [str(jax.make_jaxpr(functools.partial(moe.routed_experts, impl=kernel_impl, w_layout="nk",
                                                     **nk_scales, **form))(*nk_args))
                for form in ({}, {"form": "w8a8"})]
    assert programs[0] == programs[1]
    assert not re.search(r"f8_e4m3fn\[[0-9,]*\] = transpose", programs[0])


@pytest.mark.parametrize("t,d,i,i_off,dtype,form,tol", [
    (80, 256, 384, 0, jnp.bfloat16, {}, 1e-2),               # 40 rows per expert: fp8_form's pick
    (13, 130, 40, 100, jnp.float32, {"form": "dequant"}, 2e-6),  # asked for: ragged, a mid-block shard
])
def test_fp8_k_major_dequant_prefill(kernel_impl, t, d, i, i_off, dtype, form, tol):
    """Prefill tiles: the K-major experts dequantised in x's dtype and swapped to [E, K, N] for the bf16
    kernels (no e4m3 transpose, no e4m3 into the kernels), within x's rounding of the float64 oracle."""
    args, scales, deq = _fp8_inputs(t, 4, 8, d, i, i_off, seed=6 + t, dtype=dtype)
    assert form or moe.fp8_form(t, 4, 8, d, i, i_off) == "dequant"
    nk_args, nk_scales = _k_major(args, scales)
    got = _run(kernel_impl, nk_args, w_layout="nk", **nk_scales, **form)
    assert _rel(got, _oracle(args[0], args[1], args[2], *deq)) < tol
    fn = functools.partial(moe.routed_experts, impl=kernel_impl, w_layout="nk", **nk_scales, **form)
    assert _f8_transposes(fn, *nk_args) == 0
    assert "float8_e4m3fn" not in str(jax.make_jaxpr(fn)(*nk_args)).split("pallas_call")[1]


@pytest.mark.parametrize("t,d,i,i_off,form", [
    (13, 130, 40, 100, {}),                  # ragged widths, a shard starting mid-block: fp8_form's W8A16
    (3, 256, 256, 0, {"form": "w8a16"}),     # asked for on whole blocks
])
def test_fp8_k_major_w8a16(kernel_impl, t, d, i, i_off, form):
    """W8A16 over K-major stacks: a [E, K, N] copy of the stacks, then the W8A16 kernels; float32 rows within
    float32 rounding of the float64 oracle."""
    args, scales, deq = _fp8_inputs(t, 4, 8, d, i, i_off, seed=51 + t)
    assert form or moe.fp8_form(t, 4, 8, d, i, i_off) == "w8a16"
    nk_args, nk_scales = _k_major(args, scales)
    got = _run(kernel_impl, nk_args, w_layout="nk", **nk_scales, **form)
    assert _rel(got, _oracle(args[0], args[1], args[2], *deq)) < 2e-6
    fn = functools.partial(moe.routed_experts, impl=kernel_impl, w_layout="nk", **nk_scales, **form)
    assert _f8_transposes(fn, *nk_args) == 3


def test_fp8_k_major_bad_inputs_are_named():
    args, scales, _ = _fp8_inputs(3, 2, 4, 130, 40, 0, seed=0)
    nk_args, nk_scales = _k_major(args, scales)
    x, e, w, qg, qu, qd = nk_args
    with pytest.raises(ValueError, match="w_layout 'nk' is for FP8 experts"):
        moe.routed_experts(x, e, w, *(a.astype(jnp.bfloat16) for a in (qg, qu, qd)), w_layout="nk")
    with pytest.raises(ValueError, match=r"w_layout 'ik' is not one of"):
        moe.routed_experts(*nk_args, w_layout="ik", **nk_scales)
    with pytest.raises(ValueError, match=r"gate/up \[E, I, D\], down \[E, D, I\] \(w_layout 'nk'\)"):
        moe.routed_experts(*args, w_layout="nk", **nk_scales)  # [E, K, N] stacks called K-major
    # the [E, K-blocks, N-blocks] grids with K-major stacks: gate [4, 40, 130] needs [4, 1, 2], not [4, 2, 1]
    with pytest.raises(ValueError, match=r"gate_scale: scale grid \(4, 2, 1\) has 2 row blocks; 40 rows"):
        moe.routed_experts(*nk_args, w_layout="nk", **scales)
    with pytest.raises(ValueError, match=r"down_scale: scale grid \(4, 1, 2\) has 1 row blocks; 130 rows"):
        moe.routed_experts(*nk_args, w_layout="nk", **dict(nk_scales, wd_scale=scales["wd_scale"]))
    with pytest.raises(ValueError, match="form 'w4a4' is not one of"):
        moe.routed_experts(*nk_args, impl="triton_interpret", w_layout="nk", form="w4a4", **nk_scales)


def test_fp8_form_dispatch(kernel_impl):
    """The default FP8 form by shape (`moe.fp8_form`): W8A8 for decode tiles of whole blocks (the W8A8 oracle),
    the bf16 kernels over dequantised experts for prefill tiles (the float64 oracle of the dequantised weights,
    within bf16 rounding), W8A16 for ragged widths; an unknown form is an error naming it."""
    assert moe.fp8_form(32, 8, 256, 6144, 2048, 0) == "w8a8"
    assert moe.fp8_form(8192, 8, 256, 6144, 2048, 0) == "dequant"
    assert moe.fp8_form(32, 8, 256, 6144, 2048, 64) == moe.fp8_form(32, 8, 256, 6144, 200, 0) == "w8a16"
    args, scales, deq = _fp8_inputs(5, 4, 8, 256, 256, 0, seed=5, dtype=jnp.bfloat16)
    want = _oracle_w8a8(*args, scales["wg_scale"], scales["wu_scale"], scales["wd_scale"], ml_dtypes.bfloat16)
    assert _rel(moe.routed_experts(*args, impl=kernel_impl, **scales), want) < 5e-3
    args, scales, deq = _fp8_inputs(80, 4, 8, 256, 256, 0, seed=6, dtype=jnp.bfloat16)  # 40 rows per expert
    assert moe.fp8_form(80, 4, 8, 256, 256, 0) == "dequant"
    got = moe.routed_experts(*args, impl=kernel_impl, **scales)
    assert _rel(got, _oracle(args[0], args[1], args[2], *deq)) < 1e-2
    jaxpr = str(jax.make_jaxpr(functools.partial(moe.routed_experts, impl=kernel_impl, **scales))(*args))
    assert "float8_e4m3fn" not in jaxpr.split("pallas_call")[1]  # the kernels see bf16 weights
    with pytest.raises(ValueError, match="form 'w4a4' is not one of"):
        moe.routed_experts(*args, impl=kernel_impl, form="w4a4", **scales)


def test_fp8_traced_offset(kernel_impl):
    """A traced i_offset (each shard_map rank's own) with scale grids of the worst case's block count."""
    args, scales, deq = _fp8_inputs(6, 2, 4, 130, 40, 100, seed=3)
    want = _oracle(args[0], args[1], args[2], *deq)
    f = jax.jit(lambda off, *a: moe.routed_experts(*a, impl=kernel_impl, **dict(scales, i_offset=off)))
    assert _rel(f(jnp.int32(100), *args), want) < 2e-6


def test_fp8_bad_inputs_are_named():
    args, scales, _ = _fp8_inputs(3, 2, 4, 130, 40, 0, seed=0)
    x, e, w, qg, qu, qd = args
    with pytest.raises(ValueError, match="without their block scales: up_scale missing"):
        moe.routed_experts(*args, **dict(scales, wu_scale=None))
    with pytest.raises(ValueError, match="a scale without its FP8 weight"):
        moe.routed_experts(x, e, w, *(a.astype(jnp.float32) for a in (qg, qu, qd)), wg_scale=scales["wg_scale"])
    with pytest.raises(TypeError, match="all float8_e4m3fn"):
        moe.routed_experts(x, e, w, qg, qu, qd.astype(jnp.bfloat16), **scales)
    with pytest.raises(TypeError, match="down_scale: the scale grid must be float32"):
        moe.routed_experts(*args, **dict(scales, wd_scale=scales["wd_scale"].astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match=r"gate_scale: scale grid \(4, 2, 2\) has 2 column blocks; 40 columns"):
        moe.routed_experts(*args, **dict(scales, wg_scale=jnp.ones((4, 2, 2), jnp.float32)))
    with pytest.raises(ValueError, match=r"up_scale: scale grid \(2, 1\) must be \[4, row_blocks, col_blocks\]"):
        moe.routed_experts(*args, **dict(scales, wu_scale=jnp.ones((2, 1), jnp.float32)))
    with pytest.raises(ValueError, match="bk_up and bk_down <= 128"):
        moe.routed_experts(*args, impl="triton_interpret", bk_up=256, **scales)


@pytest.mark.parametrize("form", ["w8a16", "w8a8", "w8a8_nk"])
@pytest.mark.parametrize("t", [1, 32, 4096])
def test_fp8_full_width_stack_lowers_as_packed_words(t, form):
    """GLM-5.2's whole expert stack on one device (256 x 6144 x 2048 e4m3, 3.2 GB: past 2**31 elements) takes the
    uint16-word form by default and lowers, decode and prefill (split-K included)."""
    s = jax.ShapeDtypeStruct
    f8 = jnp.float8_e4m3fn
    nk = form == "w8a8_nk"  # K-major stacks: gate/up [E, I, D], down [E, D, I]
    gu, dn = ((256, 2048, 6144), (256, 6144, 2048)) if nk else ((256, 6144, 2048), (256, 2048, 6144))
    # scale grids in the stacks' orientation: nk gate/up [E, I-blocks 16, D-blocks 48], down [E, 48, 16]
    sgu, sdn = ((256, 16, 48), (256, 48, 16)) if nk else ((256, 48, 16), (256, 16, 48))
    args = (s((t, 6144), jnp.bfloat16), s((t, 8), jnp.int32), s((t, 8), jnp.float32),
            s(gu, f8), s(gu, f8), s(dn, f8), s(sgu, jnp.float32), s(sgu, jnp.float32), s(sdn, jnp.float32))

    def fn(x, e, w, g, u, d, sg, su, sd):
        return moe_triton.grouped_swiglu(x, e, w, g, u, d, wg_scale=sg, wu_scale=su, wd_scale=sd,
                                         form="w8a8" if nk else form, w_layout="nk" if nk else "kn")
    text = lower_for_gpu(fn, *args)
    assert "ui16" in text or "u16" in text  # the words the kernels read
    assert {c.name for c in triton_calls(text)} >= {"moe_down"}


def test_fp8_k_major_wide_blocks_lower():
    """K-major W8A8 with column blocks wider than one scale block (each column's scale gathered from the grid's
    middle axis, [E, N-blocks, K-blocks]) lowers at GLM-5.2 TP = 8 widths, plain and as uint16 words."""
    s = jax.ShapeDtypeStruct
    f8 = jnp.float8_e4m3fn
    args = (s((32, 6144), jnp.bfloat16), s((32, 8), jnp.int32), s((32, 8), jnp.float32),
            s((256, 256, 6144), f8), s((256, 256, 6144), f8), s((256, 6144, 256), f8),
            s((256, 2, 48), jnp.float32), s((256, 2, 48), jnp.float32), s((256, 48, 2), jnp.float32))
    for packed in (False, True):
        def fn(x, e, w, g, u, d, sg, su, sd):
            return moe_triton.grouped_swiglu(x, e, w, g, u, d, wg_scale=sg, wu_scale=su, wd_scale=sd, form="w8a8",
                                             w_layout="nk", packed=packed, k_split=1, bn_up=256, bn_down=256, bk_up=64,
                                             bk_down=64)
        calls = triton_calls(lower_for_gpu(fn, *args))
        assert [c.name for c in calls] == ["moe_up", "moe_down"]


def test_fp8_lowers_at_glm52_shapes():
    """The FP8 kernels lower at GLM-5.2 widths under TP = 8 (D 6144, I 2048 / 8, 256 experts), decode and
    prefill, on the bf16 path's grids."""
    s = jax.ShapeDtypeStruct
    f8 = jnp.float8_e4m3fn
    for t in (32, 4096):
        args = (s((t, 6144), jnp.bfloat16), s((t, 8), jnp.int32), s((t, 8), jnp.float32),
                s((256, 6144, 256), f8), s((256, 6144, 256), f8), s((256, 256, 6144), f8),
                s((256, 48, 2), jnp.float32), s((256, 48, 2), jnp.float32), s((256, 2, 48), jnp.float32))
        cfg = moe_triton.default_config(t, 8, 256, 6144, 256)
        n_tiles = -(-t * 8 // cfg.tile) + min(256, t * 8)

        def fn(x, e, w, g, u, d, sg, su, sd):
            return moe_triton.grouped_swiglu(x, e, w, g, u, d, wg_scale=sg, wu_scale=su, wd_scale=sd)

        calls = triton_calls(lower_for_gpu(fn, *args))
        assert [(c.name, c.grid) for c in calls] == [("moe_up", (256 // cfg.bn_up, n_tiles, 1)),
                                                     ("moe_down", (6144 // cfg.bn_down, n_tiles, 1))]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 32, 128])
def test_gpu_fp8_glm52_widths(kernel_impl, t):
    """Native FP8 kernels at GLM-5.2 widths (256 experts of 6144 x 2048, bf16 rows) against the float64 oracle;
    tokens route among 16 experts so the oracle dequantises only those (T = 128: prefill-sized tiles)."""
    n_exp, d, i, k = 256, 6144, 2048, 8
    rng = np.random.default_rng(t)
    keys = jax.random.split(jax.random.key(t), 6)
    qs, ss = [], []
    for j, shape in enumerate(((n_exp, d, i), (n_exp, d, i), (n_exp, i, d))):
        bits = jax.random.randint(keys[j], shape, 0, 0x7F, jnp.uint8) | jnp.uint8(0x80 * (j % 2))
        qs.append(jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn))
        ss.append(jax.random.uniform(keys[3 + j], (n_exp, -(-shape[1] // 128), -(-shape[2] // 128)), jnp.float32,
                                     0.5e-4, 2e-4))
    pool = rng.choice(n_exp, 16, replace=False)
    experts = jnp.asarray(np.stack([rng.choice(pool, k, replace=False) for _ in range(t)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
    x = jax.random.normal(keys[5], (t, d), jnp.bfloat16)
    def run(**form):
        return jax.jit(functools.partial(moe.routed_experts, impl=kernel_impl, **form))(
            x, experts, w, *qs, wg_scale=ss[0], wu_scale=ss[1], wd_scale=ss[2])

    want_w8a8 = _oracle_w8a8(x, experts, w, *qs, *ss, ml_dtypes.bfloat16)
    assert _rel(run(), want_w8a8) < 5e-3  # fp8_form's pick at decode; the output is stored in bf16: ~2e-3 off
    got = run(form="w8a16")
    want = np.zeros((t, d))
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    for e in np.unique(np.asarray(experts)):
        deq = [np.asarray(fp8_formats.dequantize_weight_blocks(q[e], s[e]), np.float64) for q, s in zip(qs, ss)]
        rows, slot = np.nonzero(np.asarray(experts) == e)
        g, u = xf[rows] @ deq[0], xf[rows] @ deq[1]
        want[rows] += np.asarray(w)[rows, slot][:, None] * ((g / (1 + np.exp(-g)) * u) @ deq[2])
    assert _rel(got, want) < 2e-2


@pytest.mark.parametrize("t,form", [(80, "dequant"), (16, "w8a8")])
def test_batch_invariant_prompt_step_rows_do_not_depend_on_the_batch(kernel_impl, t, form):
    """Batch-invariant prompt steps take the default FP8 form for the step's T rows (`moe.fp8_form` by the mean
    rows per expert of T, a static number: "dequant" for 40 rows per expert, "w8a8" for 8) and the default launch
    config for T: a group of rows, in a step of T rows, is bitwise the same whatever the other rows route to (the
    experts' tile boundaries move) and wherever the group sits. K-major FP8 experts, as the model keeps them."""
    from kernels import registry
    k, n_exp, d, i = 4, 8, 256, 256
    args, scales, _ = _fp8_inputs(t, k, n_exp, d, i, 0, seed=9, dtype=jnp.bfloat16)
    nk_args, nk_scales = _k_major(args, scales)
    x, experts, weights, *w = nk_args
    rows = 5  # the group: its rows, experts and routing weights fixed
    rng = np.random.default_rng(10)

    def place(at, seed):
        """A step of t rows: the group at rows [at, at + rows), the others routed by `seed` (skewed to few experts
        by odd seeds, so the tiles differ)."""
        r = np.random.default_rng(seed)
        xs = np.asarray(r.normal(size=(t, d)), np.float32)
        if seed % 2:
            ex = np.stack([np.concatenate([[0, 1], r.choice(np.arange(2, n_exp), k - 2, replace=False)])
                           for _ in range(t)])
        else:
            ex = np.stack([r.choice(n_exp, k, replace=False) for _ in range(t)])
        ws = r.uniform(0.1, 1.0, size=(t, k))
        xs[at:at + rows], ex[at:at + rows], ws[at:at + rows] = (np.asarray(x[:rows], np.float32),
                                                                 np.asarray(experts[:rows]), np.asarray(weights[:rows]))
        return jnp.asarray(xs, jnp.bfloat16), jnp.asarray(ex, jnp.int32), jnp.asarray(ws, jnp.float32)

    outs = []
    with registry.batch_invariant(rows=t, prompt_rows=t), registry.record() as log:
        f = jax.jit(functools.partial(moe.routed_experts, impl=kernel_impl, w_layout="nk", **nk_scales))
        for at, seed in ((0, 1), (t - rows, 2), (int(rng.integers(1, t - rows)), 3)):
            outs.append(np.asarray(f(*place(at, seed), *w))[at:at + rows])
    assert {(d.rule, d.choice, d.step_kind) for d in log if d.rule == "moe.fp8_form"} == {("moe.fp8_form", form,
                                                                                         "prompt")}
    for got in outs[1:]:
        np.testing.assert_array_equal(got, outs[0])
    assert np.all(np.isfinite(outs[0])) and np.any(outs[0] != 0)


# ------------------------------------------------------------------------------ padding rows (unrouted pairs)

PAD_ROWS = [1, 4, 5, 9]  # of 10 rows; row 9's pairs carry -1, the others the model's sentinel E


def _padded(args, n_exp):
    """args with rows PAD_ROWS marked padding as the model marks them: expert ids outside [0, E) and weights 0,
    and their x rows NaN (a pair computed into any real row would show it). Returns (padded args, real rows)."""
    x, experts, weights, *rest = args
    pad = np.asarray(PAD_ROWS)
    real = np.setdiff1d(np.arange(x.shape[0]), pad)
    sentinel = np.where(pad[:, None] == 9, -1, n_exp)
    return (x.at[pad].set(jnp.nan), experts.at[pad].set(jnp.asarray(sentinel, jnp.int32)), weights.at[pad].set(0.0),
            *rest), real


def _check_padded(got, want_real, real, tol, before=None):
    """Real rows within `tol` of the oracle over the real rows alone; padding rows exactly 0; with `before` (the
    same call with the padding rows routed to real experts, finite x) the real rows bit for bit as there."""
    got = np.asarray(got)
    pad = np.setdiff1d(np.arange(got.shape[0]), real)
    assert np.all(got[pad] == 0), got[pad]
    assert _rel(got[real], want_real) < tol
    if before is not None:
        np.testing.assert_array_equal(got[real], np.asarray(before)[real])


def test_tile_plan_gives_unrouted_pairs_no_row():
    """experts [[0, 1], [S, S], [1, 2]] (S = 3 = E, or -1) at 2-row tiles: pairs 2 and 3 get no row; every other
    pair's row is where it would be without them (expert 0: [0, -], expert 1: [1, 4], expert 2: [5, -])."""
    want_src = [0, -1, 1, 4, 5, -1] + [-1] * 6  # n_tiles = ceil(6 / 2) + min(3, 6) = 6, a static bound
    for pad in ([3, 3], [-1, 3], [-1, -1], [7, 100]):
        src, tile_expert = moe_tiles.tile_plan(jnp.asarray([[0, 1], pad, [1, 2]], jnp.int32), 3, 2)
        assert np.asarray(src).tolist() == want_src, pad
        assert np.asarray(tile_expert).tolist() == [0, 1, 2, 2, 2, 2], pad
    np.testing.assert_array_equal(moe_tiles.routed_pairs(jnp.asarray([[0, 2], [3, -1]]), 3), [[True, True],
                                                                                              [False, False]])


@pytest.mark.parametrize("mode", moe.MODES + (None,))
def test_padding_rows_xla(mode):
    """Every xla form: unrouted pairs contribute exactly 0 (padding rows 0, their NaN rows nowhere in the real
    rows), the real rows the oracle's over the real rows alone and bit for bit those of the unpadded call."""
    args = _inputs(10, 3, 8, 32, 16, seed=4)
    padded, real = _padded(args, 8)
    with jax.default_matmul_precision("highest"):
        got = moe.routed_experts(*padded, mode=mode)
        before = moe.routed_experts(*args, mode=mode)
    _check_padded(got, _oracle(*(a[real] for a in args[:3]), *args[3:]), real, 1e-5, before)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_padding_rows_triton(kernel_impl, dtype, tol):
    """The grouped-GEMM kernels over bf16 / float32 experts: padding rows' pairs are in no tile (their NaN rows reach
    no real row, their outputs are 0) and the real rows are bit for bit those of the unpadded call."""
    args = _inputs(10, 3, 8, 64, 32, seed=5, dtype=dtype)
    padded, real = _padded(args, 8)
    got, before = _run(kernel_impl, padded, tile=16), _run(kernel_impl, args, tile=16)
    _check_padded(got, _oracle(*(a[real] for a in args[:3]), *args[3:]), real, tol, before)


@pytest.mark.parametrize("kernel,w_layout,form", [
    (False, "kn", None), (False, "nk", None),  # the xla reference
    (True, "kn", "w8a16"), (True, "kn", "w8a8"), (True, "nk", "w8a8"), (True, "nk", "dequant"), (True, "nk", "w8a16"),
])
def test_padding_rows_fp8(kernel_impl, kernel, w_layout, form):
    """FP8 experts, each form of the kernels and the xla reference, over both stacks' layouts: padding rows 0, the
    real rows the oracle's over the real rows alone (W8A8: its float64 rule) and bit for bit those of the unpadded
    call."""
    impl = kernel_impl if kernel else "xla"
    dtype = jnp.bfloat16 if form == "w8a8" else jnp.float32
    args, scales, deq = _fp8_inputs(10, 2, 8, 256, 256, 0, seed=8, dtype=dtype)
    padded, real = _padded(args, 8)
    if form == "w8a8":
        want, tol = _oracle_w8a8(*(a[real] for a in args[:3]), *args[3:], scales["wg_scale"], scales["wu_scale"],
                                 scales["wd_scale"], ml_dtypes.bfloat16), 5e-3
    else:
        want, tol = _oracle(*(a[real] for a in args[:3]), *deq), 2e-6
    if w_layout == "nk":
        args, scales = _k_major(args, scales)
        padded, _ = _padded(args, 8)
    opts = dict(scales, w_layout=w_layout, **({} if form is None else {"form": form}))
    _check_padded(_run(impl, padded, **opts), want, real, tol, _run(impl, args, **opts))
