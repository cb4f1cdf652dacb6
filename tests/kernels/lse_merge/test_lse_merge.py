"""LSE merge of partial attention results (docs/math.md §6) against float64 numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels import lse_merge


def _np_merge(o, lse):
    """float64: o = sum_i exp(lse_i - L) o_i, L = log sum_i exp(lse_i), over axis 0; empty -> (0, -inf)."""
    o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    lse = np.where(np.isnan(lse) | (lse == np.inf), -np.inf, lse)
    m = lse.max(0)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lse - m_safe)
    total = w.sum(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        merged_lse = np.where(total > 0, m_safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
        scale = np.where(total > 0, w / np.where(total > 0, total, 1.0), 0.0)
    return (scale[..., None] * np.nan_to_num(o)).sum(0), merged_lse


@pytest.mark.parametrize("n", [1, 2, 5])
def test_matches_numpy(n):
    rng = np.random.default_rng(n)
    o = rng.normal(size=(n, 3, 4, 8)).astype(np.float32)
    lse = (rng.normal(size=(n, 3, 4)) * 5).astype(np.float32)
    lse[:, 0, 0] = -np.inf  # every partial empty
    if n > 1:
        lse[0, 1, :] = -np.inf  # one empty partial
    mo, ml = lse_merge.merge_partials(jnp.asarray(o), jnp.asarray(lse), axis=0)
    want_o, want_lse = _np_merge(o, lse)
    np.testing.assert_allclose(np.asarray(mo), want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ml), want_lse, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(mo)[0, 0] == 0) and np.isneginf(np.asarray(ml)[0, 0])


def test_merge_sanitises_nan_and_inf():
    o = jnp.asarray(np.array([[[1.0, 2.0]], [[np.nan, np.nan]], [[5.0, 6.0]]], np.float32))
    lse = jnp.asarray(np.array([[0.0], [np.nan], [np.inf]], np.float32))
    mo, ml = lse_merge.merge_partials(o, lse, axis=0)
    np.testing.assert_allclose(np.asarray(mo), [[1.0, 2.0]])
    np.testing.assert_allclose(np.asarray(ml), [0.0])


def test_merge_along_a_later_axis():
    rng = np.random.default_rng(0)
    o = rng.normal(size=(3, 4, 6)).astype(np.float32)  # partials on axis 1 of lse [3, 4]
    lse = rng.normal(size=(3, 4)).astype(np.float32)
    mo, ml = lse_merge.merge_partials(jnp.asarray(o), jnp.asarray(lse), axis=1)
    want_o, want_lse = _np_merge(np.moveaxis(o, 1, 0), lse.T)
    np.testing.assert_allclose(np.asarray(mo), want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ml), want_lse, rtol=1e-5, atol=1e-6)
