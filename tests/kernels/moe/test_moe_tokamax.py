"""The MoE impl "tokamax" (kernels/moe/tokamax.py): FP8 K-major experts through tokamax's grouped GEMM, W8A16 in
float16 with power-of-two range steering.

Oracle: a float64 numpy model of the same quantised arithmetic, written from the module docstring's formulas
(rows scaled by 2**-e of their largest magnitude and rounded to float16; column scales steered by the stack's
largest scale and rounded to float16; e4m3 x scale rounded to float16; float64 sums rounded to float16; the
powers of two undone), plus the float32 reference of `moe.routed_experts(impl="xla")` for how near that
arithmetic stays to the exact function. On CPU the wrapper runs with a plain-jnp ragged dot in tokamax's place
(tokamax's kernel is Mosaic GPU code); the gpu tests run tokamax itself (its wheels carried to the GPU machine)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import fp8_formats, moe, registry
from kernels.moe import tokamax as moe_tokamax

from moe_inputs import fp8_expert_stacks  # the folder is on sys.path under pytest

RS = moe_tokamax.RS


def _inputs(t, k, n_exp, d, i, *, seed, x_scale=1.0):
    """K-major FP8 stacks (gate/up [E, I, D], down [E, D, I]) of block-quantised random weights, routing, x."""
    rng = np.random.default_rng(seed)
    stacks, grids = fp8_expert_stacks(rng, n_exp, d, i)
    experts = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)])
    x = rng.normal(size=(t, d)) * x_scale
    x[0] *= 3e5  # a row past float16's 65504: only the row steering keeps it finite
    if t > 2:
        x[2] = 0.0  # an all-zero row
    w = rng.uniform(0.1, 1.0, size=(t, k))
    return (jnp.asarray(x, jnp.bfloat16), jnp.asarray(experts, jnp.int32), jnp.asarray(w, jnp.float32), *stacks), \
        dict(wg_scale=grids[0], wu_scale=grids[1], wd_scale=grids[2])


def _f16(a):
    return np.asarray(a, np.float64).astype(np.float16).astype(np.float64)


def _oracle(x, experts, weights, wg, wu, wd, wg_scale, wu_scale, wd_scale):
    """float64 [T, D] of the module docstring's arithmetic, token by token and expert by expert."""
    x = np.asarray(x.astype(jnp.float32), np.float64)

    def prep(w, grid):
        w = np.asarray(w.astype(jnp.float32), np.float64)
        grid = np.asarray(grid, np.float64)
        es = np.frexp(grid.max())[1]
        cols = _f16(np.repeat(np.repeat(grid, 128, axis=1), 128, axis=2)[:, :w.shape[1], :w.shape[2]]
                    * 2.0 ** (RS - es))
        return _f16(w * cols), 2.0 ** (es - RS)  # e4m3 -> float16 is exact; the product rounds once

    (w16g, ug), (w16u, uu), (w16d, ud) = prep(wg, wg_scale), prep(wu, wu_scale), prep(wd, wd_scale)

    def project(a, w16, undo):
        amax = np.max(np.abs(a))
        ea = np.frexp(amax)[1] if amax > 0 else 0
        return _f16(w16 @ _f16(a * 2.0 ** -ea)) * 2.0 ** ea * undo

    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(np.asarray(experts[t])):
            g = project(x[t], w16g[e], ug)
            u = project(x[t], w16u[e], uu)
            h = g * 0.5 * (1 + np.tanh(g / 2)) * u  # silu, without exp's overflow
            out[t] += float(weights[t, j]) * project(h, w16d[e], ud)
    return out


def _jnp_dot(a16, w, c16, sizes):
    """tokamax's ragged dot in plain jnp (the kernel's arithmetic): rows grouped by expert, e4m3 -> float16 times
    the float16 column scale, float32 sums, a float16 result; like the kernel, whole 8-row groups only."""
    assert a16.shape[0] % 8 == 0, f"{a16.shape[0]} rows: the kernel's TMA row tiles take multiples of 8"
    group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(a16.shape[0]), side="right")
    w16 = (w.astype(jnp.float16) * jnp.repeat(jnp.swapaxes(c16, 1, 2), 128, axis=2)).astype(jnp.float32)
    out = jnp.einsum("mk,mnk->mn", a16.astype(jnp.float32), w16[group], precision="highest")
    return out.astype(jnp.float16)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("t,k,n_exp,d,i", [(5, 2, 4, 256, 128), (9, 3, 8, 128, 256), (8, 2, 4, 128, 128)])
def test_matches_the_float64_oracle_with_a_jnp_dot(t, k, n_exp, d, i):
    """Pairs not a multiple of 8 (10, 27: padded for the kernel) and a multiple (16)."""
    args, scales = _inputs(t, k, n_exp, d, i, seed=t)
    got = moe_tokamax.routed_experts(*args, **scales, dot=_jnp_dot)
    want = _oracle(*args, **scales)
    assert np.all(np.isfinite(np.asarray(got))), "a row past float16's range overflowed"
    assert _rel(got, want) < 2e-3  # with a plain float16 cast of x, row 0 (3e5) is inf and this fails
    if t > 2:
        assert np.all(np.asarray(got)[2] == 0)
    # and near the exact function of the same FP8 weights (the float32 reference), row 0 included
    ref = moe.routed_experts(*args, impl="xla", w_layout="nk", **scales)
    assert _rel(got, ref) < 5e-3
    assert _rel(np.asarray(got)[0], np.asarray(ref)[0]) < 5e-3


def test_refusals_name_the_constraint(monkeypatch):
    args, scales = _inputs(5, 2, 4, 256, 128, seed=2)
    monkeypatch.setattr(moe_tokamax, "missing", lambda: "tokamax is not importable (test)")
    with pytest.raises(ValueError, match="impl 'tokamax' does not support these inputs: tokamax is not importable"):
        moe.routed_experts(*args, impl="tokamax", w_layout="nk", **scales)
    monkeypatch.setattr(moe_tokamax, "missing", lambda: None)
    bf16 = [jnp.swapaxes(fp8_formats.dequantize_weight_blocks(w, s, dtype=jnp.bfloat16), 1, 2)
            for w, s in zip(args[3:], scales.values())]
    with pytest.raises(ValueError, match="is for FP8 experts"):
        moe.routed_experts(*args[:3], *bf16, impl="tokamax")
    kn = [jnp.swapaxes(w, 1, 2) for w in args[3:]]
    kn_scales = {n: jnp.swapaxes(s, 1, 2) for n, s in scales.items()}
    with pytest.raises(ValueError, match="takes K-major FP8 stacks"):
        moe.routed_experts(*args[:3], *kn, impl="tokamax", **kn_scales)
    with pytest.raises(ValueError, match="multiples of 128"):
        moe.routed_experts(args[0][:, :200], *args[1:3],
                           *(w[:, :, :200] if j < 2 else w[:, :200] for j, w in enumerate(args[3:])),
                           impl="tokamax", w_layout="nk",
                           **{n: (s[:, :, :2] if j < 2 else s[:, :2]) for j, (n, s) in enumerate(scales.items())})
    traced = moe_tokamax.supports(*args, **scales, i_offset=jnp.int32(0), w_layout="nk")
    assert "scale-block boundary" in traced  # a traced offset (a shard that may start mid-block) is refused
    with pytest.raises(ValueError, match="TokamaxMoEConfig.grid_minor_dim"):
        moe_tokamax.TokamaxMoEConfig(grid_minor_dim="k")
    with pytest.raises(ValueError, match="TokamaxMoEConfig.block_m"):
        moe_tokamax.TokamaxMoEConfig(block_m=12)


def test_auto_never_takes_tokamax(monkeypatch):
    """On a GPU with tokamax installed, "auto" runs the Triton kernel for the TP = 1 GLM-5.2 stacks at decode and
    prefill batches alike: with tokamax taken the engine's FP8 prefill was several times slower (BENCHMARKS.md,
    tokamax). Named, the impl still resolves to tokamax."""
    s = jax.ShapeDtypeStruct
    monkeypatch.setattr(registry, "on_gpu", lambda: True)
    monkeypatch.setattr(moe_tokamax, "missing", lambda: None)

    def pick(t, impl="auto"):
        dt = fp8_formats.FP8
        stacks = [s((256, 2048, 6144), dt), s((256, 2048, 6144), dt), s((256, 6144, 2048), dt)]
        scales = dict(wg_scale=s((256, 16, 48), jnp.float32), wu_scale=s((256, 16, 48), jnp.float32),
                      wd_scale=s((256, 48, 16), jnp.float32), i_offset=0)
        return registry.resolve("moe", impl, s((t, 6144), jnp.bfloat16), s((t, 8), jnp.int32),
                                s((t, 8), jnp.float32), *stacks, w_layout="nk", **scales)

    assert [pick(t) for t in (1, 8, 32, 128, 8192)] == ["triton"] * 5
    assert pick(32, "tokamax") == "tokamax"


# ------------------------------------------------------------------------------ GPU: tokamax itself

@pytest.mark.gpu
@pytest.mark.parametrize("t,k,n_exp,d,i", [(32, 8, 16, 512, 256), (7, 4, 8, 256, 128), (64, 8, 16, 2048, 256)])
def test_gpu_tokamax_matches_the_oracle(t, k, n_exp, d, i):
    if moe_tokamax.missing():
        pytest.fail(moe_tokamax.missing())  # the GPU runs carry tokamax's wheels: its absence is a set-up error
    args, scales = _inputs(t, k, n_exp, d, i, seed=t)
    got = jax.jit(lambda *a: moe.routed_experts(*a, impl="tokamax", w_layout="nk", **scales))(*args)
    want = _oracle(*args, **scales)
    assert np.all(np.isfinite(np.asarray(got)))
    assert _rel(got, want) < 2e-3


def test_padding_rows_contribute_nothing():
    """Rows marked padding (expert ids E, the model's sentinel, or -1; weights 0; x NaN): zero rows in the last
    group (the groups still cover every row) whose results are dropped: padding rows 0, the real rows the oracle's
    over the real rows alone and bit for bit those of the call without padding (a jnp stand-in for the kernel)."""
    args, scales = _inputs(9, 3, 8, 128, 256, seed=4)
    x, experts, w, *stacks = args
    pad, real = np.array([3, 6, 7]), np.array([0, 1, 2, 4, 5, 8])
    sentinel = jnp.asarray([[8] * 3, [-1] * 3, [8, -1, 8]], jnp.int32)
    padded = (x.at[pad].set(jnp.nan), experts.at[pad].set(sentinel), w.at[pad].set(0.0), *stacks)
    got = np.asarray(moe_tokamax.routed_experts(*padded, **scales, dot=_jnp_dot))
    before = np.asarray(moe_tokamax.routed_experts(*args, **scales, dot=_jnp_dot))
    assert np.all(got[pad] == 0)
    assert _rel(got[real], _oracle(*(a[real] for a in args[:3]), *stacks, **scales)) < 2e-3
    np.testing.assert_array_equal(got[real], before[real])
