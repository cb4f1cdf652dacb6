"""The Pallas Triton merge of split-K partials (kernels/lse_merge/triton.py) against float64 numpy: under the Pallas
interpreter on CPU, natively on a GPU (the `kernel_impl` fixture), with the launch lowering checked on CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import lse_merge, registry
from kernels.lse_merge import triton as lse_merge_triton
from kernels.common.triton_common import lower_for_gpu, triton_calls

from test_lse_merge import _np_merge  # the float64 oracle of the xla merge (tests/kernels on sys.path)


def _partials(n, t, h, r, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    o = rng.normal(size=(n, t, h, r)).astype(dtype)
    lse = (rng.normal(size=(n, t, h)) * 6).astype(np.float32)
    lse[:, 0, 0] = -np.inf  # a head with every partial empty: (0, -inf)
    if n > 1:
        lse[0, -1, :] = np.nan  # NaN and +inf count as empty partials
        lse[-1, -1, 1] = np.inf
        o[0, -1, :] = np.nan  # an empty partial's o is never read into the sum
    return o, lse


@pytest.mark.parametrize("n,t,h,r", [(1, 2, 16, 64), (3, 2, 64, 512), (32, 1, 16, 128), (5, 9, 12, 48)])
def test_matches_float64_numpy(kernel_impl, n, t, h, r):
    """Every (row, head) merged as numpy merges it in float64; heads / columns that are not multiples of the
    blocks (12, 48) take smaller power-of-two blocks."""
    o, lse = _partials(n, t, h, r, seed=n + t)
    mo, ml = lse_merge.merge_splits(jnp.asarray(o), jnp.asarray(lse), impl=kernel_impl)
    want_o, want_lse = _np_merge(o, lse)
    np.testing.assert_allclose(np.asarray(mo), want_o, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(ml), want_lse, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(mo)[0, 0] == 0) and np.isneginf(np.asarray(ml)[0, 0])


@pytest.mark.parametrize("merge_impl", ["xla", "kernel"])
def test_the_o_of_an_empty_partial_is_never_used(kernel_impl, merge_impl):
    """A partial whose lse is -inf (an empty split: the Mosaic sparse MLA kernel skips those and may leave its o
    unwritten) changes nothing whatever its o holds (NaN, inf, huge): bit for bit the merge of the same partials
    with that o at 0, for padding rows (every split empty) and for real rows with some splits empty. (On the GPU the
    kernel also does not read it: the load is masked.)"""
    impl = kernel_impl if merge_impl == "kernel" else "xla"
    o, lse = _partials(4, 6, 16, 64, seed=3)
    lse = np.where(np.isfinite(lse), lse, 0.0).astype(np.float32)
    lse[:, 4:] = -np.inf  # padding rows: every split empty
    lse[1:3, 0] = -np.inf  # a real row whose middle splits are empty
    lse[3, 2, ::2] = -np.inf
    empty = np.isneginf(lse)
    clean = np.where(empty[..., None], 0.0, o).astype(np.float32)
    poison = clean.copy()
    poison[empty] = np.array([np.nan, np.inf, -np.inf, 3e38], np.float32)[np.arange(64) % 4]
    merge = jax.jit(functools.partial(lse_merge.merge_splits, impl=impl))
    want = [np.asarray(a) for a in merge(jnp.asarray(clean), jnp.asarray(lse))]
    got = [np.asarray(a) for a in merge(jnp.asarray(poison), jnp.asarray(lse))]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))
    assert np.all(got[0][4:] == 0) and not np.signbit(got[0][4:]).any() and np.all(np.isneginf(got[1][4:]))
    np.testing.assert_allclose(got[0], _np_merge(clean, lse)[0], rtol=2e-5, atol=2e-6)


def test_bf16_partials_are_read_as_float32(kernel_impl):
    o, lse = _partials(4, 3, 16, 64, seed=7)
    o16 = jnp.asarray(o, jnp.bfloat16)
    mo, _ = lse_merge.merge_splits(o16, jnp.asarray(lse), impl=kernel_impl)
    want_o, _ = _np_merge(np.asarray(o16.astype(jnp.float32)), lse)
    np.testing.assert_allclose(np.asarray(mo), want_o, rtol=2e-5, atol=2e-6)


def test_bad_inputs_are_value_errors_naming_them():
    o, lse = jnp.zeros((2, 3, 4, 8)), jnp.zeros((2, 3, 5))
    with pytest.raises(ValueError, match=r"lse \(2, 3, 5\)"):
        lse_merge_triton.merge_partials_triton(o, lse, interpret=True)
    with pytest.raises(ValueError, match="MAX_SPLITS"):
        lse_merge_triton.merge_partials_triton(jnp.zeros((65, 1, 4, 8)), jnp.zeros((65, 1, 4)), interpret=True)
    with pytest.raises(ValueError, match="block_h"):
        lse_merge_triton.MergeConfig(block_h=6)
    with pytest.raises(ValueError, match="unknown options"):
        lse_merge_triton.merge_partials_triton(jnp.zeros((2, 1, 4, 8)), jnp.zeros((2, 1, 4)), interpret=True,
                                               block_x=4)


def test_auto_is_the_kernel_on_a_gpu_where_it_takes_the_partials():
    o, lse = (jnp.asarray(a) for a in _partials(2, 1, 4, 8, seed=1))
    wide = jnp.zeros((65, 1, 4, 8)), jnp.zeros((65, 1, 4))  # more splits than the kernel takes
    with registry.deciding_for("cpu"):
        assert registry.resolve("lse_merge", "auto", o, lse) == "xla"
    with registry.deciding_for("gpu"):
        assert registry.resolve("lse_merge", "auto", o, lse) == "triton"
        assert registry.resolve("lse_merge", "auto", *wide) == "xla"


@pytest.mark.parametrize("t,grid", [(1, (1, 16, 4)), (32, (32, 4, 4))])
def test_lowers_to_one_launch(t, grid):
    """At the sparse MLA shapes (32 splits, H = 64, R = 512) the merge is one Triton launch on (rows, head blocks,
    column blocks): 4-head blocks below 8 rows, 16-head blocks from 8."""
    s = jax.ShapeDtypeStruct
    f = functools.partial(lse_merge_triton.merge_partials_triton)
    calls = triton_calls(lower_for_gpu(f, s((32, t, 64, 512), jnp.float32), s((32, t, 64), jnp.float32)))
    assert [(c.name, c.grid) for c in calls] == [("lse_merge", grid)]
