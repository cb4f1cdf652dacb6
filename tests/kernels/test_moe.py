"""Routed experts: every xla form and the Pallas Triton grouped GEMMs against a per-token loop (numpy, float64)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import moe, moe_triton, sparse_mla_triton

ON_GPU = jax.default_backend() == "gpu"
IMPL = "triton" if ON_GPU else "triton_interpret"


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


@pytest.mark.parametrize("mode", moe.MODES)
def test_xla_forms_match_oracle(mode):
    args = _inputs(11, 3, 8, 32, 16, seed=1)
    assert _rel(moe.routed_experts(*args, mode=mode), _oracle(*args)) < 1e-5


@pytest.mark.parametrize("t,k,n_exp,skew,options", [
    (1, 2, 8, False, {}),             # decode, one token: two non-empty tiles
    (13, 4, 8, False, {}),            # experts with several rows, tiles padded
    (40, 2, 4, True, {"tile": 16}),   # expert 3 has 40 rows: three tiles of one expert
    (9, 3, 16, False, {"tile": 32, "bk_up": 16, "bn_up": 16, "bk_down": 16, "bn_down": 16}),  # many K steps
    (1, 2, 8, False, {"k_split": 2, "bk_up": 32}),       # split-K up projection, one token
    (13, 4, 8, False, {"k_split": 4, "bk_up": 16}),      # split-K with empty tiles beside full ones
])
def test_triton_matches_oracle(t, k, n_exp, skew, options):
    args = _inputs(t, k, n_exp, 64, 32, seed=t * k, skew=skew)
    got = moe.routed_experts(*args, impl=IMPL, **options)
    assert got.shape == (t, 64) and got.dtype == jnp.float32
    assert _rel(got, _oracle(*args)) < 1e-5


def test_triton_bf16_close_to_oracle():
    args = _inputs(24, 4, 8, 64, 32, seed=7, dtype=jnp.bfloat16)
    assert _rel(moe.routed_experts(*args, impl=IMPL), _oracle(*args)) < 2e-2


def test_tile_plan_covers_every_pair_once():
    experts = jnp.asarray(np.random.default_rng(3).integers(0, 6, size=(17, 3)), jnp.int32)
    src, tile_expert = moe.tile_plan(experts, 6, 4)
    src, tile_expert = np.asarray(src), np.asarray(tile_expert)
    assert sorted(src[src >= 0].tolist()) == list(range(17 * 3))
    tiles = src.reshape(-1, 4)
    for tile, e in zip(tiles, tile_expert):
        real = tile[tile >= 0]
        assert np.all(np.asarray(experts).reshape(-1)[real] == e)  # one expert per tile
        assert np.all(tile[: len(real)] >= 0)  # real rows first: a tile is empty iff its first row is -1


def test_narrow_widths_fall_back_to_xla():
    args = _inputs(5, 2, 4, 24, 8, seed=2)  # I = 8 < the 16-wide dots
    assert not moe_triton.supported(24, 8)
    assert _rel(moe.routed_experts(*args, impl=IMPL), _oracle(*args)) < 1e-5


def test_bad_k_split_is_named():
    with pytest.raises(ValueError, match="k_split 3"):
        moe.routed_experts(*_inputs(3, 2, 4, 64, 32, seed=0), impl=IMPL, k_split=3)


def test_bad_shapes_are_named():
    x, e, w, wg, wu, wd = _inputs(3, 2, 4, 32, 16, seed=0)
    with pytest.raises(ValueError, match="down"):
        moe.routed_experts(x, e, w, wg, wu, wd[:, :8], impl=IMPL)
    with pytest.raises(ValueError, match="weights"):
        moe.routed_experts(x, e, w[:, :1], wg, wu, wd)


def test_lowers_at_glm52_shapes():
    """The Pallas -> Triton lowering at GLM-5.2 widths (D 6144, I 2048, 256 experts) for decode and prefill."""
    s = jax.ShapeDtypeStruct
    for t in (32, 4096):
        args = (s((t, 6144), jnp.bfloat16), s((t, 8), jnp.int32), s((t, 8), jnp.float32),
                s((256, 6144, 2048), jnp.bfloat16), s((256, 6144, 2048), jnp.bfloat16),
                s((256, 2048, 6144), jnp.bfloat16))
        assert "triton" in sparse_mla_triton.lower_for_gpu(moe_triton.grouped_swiglu, *args)
        if t == 32:
            f = functools.partial(moe_triton.grouped_swiglu, k_split=4)
            assert "moe_up_split_k" in sparse_mla_triton.lower_for_gpu(f, *args)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 32, 128, 2048])
def test_gpu_glm52_widths(t):
    """Native kernels at GLM-5.2 widths (64 experts to keep the test small) against the xla forms in float32."""
    args = _inputs(t, 8, 64, 6144, 512, seed=t, dtype=jnp.bfloat16)
    want = moe.experts_xla(*(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args), mode="tiles")
    got = jax.jit(functools.partial(moe.routed_experts, impl="triton"))(*args)
    assert _rel(got, np.asarray(want, np.float64)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t", [4, 2048])
def test_gpu_float32_weights(t):
    """A float32 model at GLM-5.2 widths: the float32 block sizes fit shared memory, and the dots are IEEE
    float32 (the oracle under "highest" too: a GPU's float32 default is TF32)."""
    args = _inputs(t, 8, 32, 6144, 512, seed=t)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(moe.experts_xla(*args, mode="tiles"), np.float64)
    got = jax.jit(functools.partial(moe.routed_experts, impl="triton"))(*args)
    assert _rel(got, want) < 1e-4


def test_float32_config_fits_shared_memory():
    """Hand count of the pipelined tiles of the float32 blocks (x rows + gate and up blocks, bytes x stages)."""
    for t in (1, 32, 2048):
        c = moe_triton.default_config(t, 8, 256, 6144, 2048, itemsize=4)
        up = (c["tile"] * c["bk_up"] + 2 * c["bk_up"] * c["bn_up"]) * 4 * c["num_stages"]
        down = (c["tile"] * c["bk_down"] + c["bk_down"] * c["bn_down"]) * 4 * c["num_stages"]
        assert max(up, down) <= 160 * 1024, c
