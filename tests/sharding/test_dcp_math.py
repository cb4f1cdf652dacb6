"""Ownership math, the LSE merge (properties, with hypothesis) and the QREP precedence grid of docs/math.md §7."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.lse_merge import merge_partials
from sharding import DCP, ParallelConfig
from sharding import dcp
from sharding.parallel import QREP_ENV

ns = st.integers(1, 8)
inter = st.sampled_from([1, 2, 3, 16])


@settings(max_examples=60, deadline=None)
@given(n=ns, i=inter, length=st.integers(0, 300))
def test_every_position_has_one_owner_and_lengths_sum(n, i, length):
    p = np.arange(length)
    own = np.asarray(dcp.owner(p, n, i))
    assert ((own >= 0) & (own < n)).all()
    lens = [int(dcp.local_length(length, r, n, i)) for r in range(n)]
    assert sum(lens) == length
    for r in range(n):
        mine = p[own == r]
        assert len(mine) == lens[r]
        lp = np.asarray(dcp.local_position(mine, n, i))
        assert lp.tolist() == list(range(lens[r]))  # dense, ordered local positions
        assert np.asarray(dcp.global_position(lp, r, n, i)).tolist() == mine.tolist()


def test_local_length_matches_spec_formula_by_hand():
    # L=10, N=4, I=2: owners 0 0 1 1 2 2 3 3 0 0 -> rank 0 has 4, the others 2
    assert [int(dcp.local_length(10, r, 4, 2)) for r in range(4)] == [4, 2, 2, 2]
    assert [int(dcp.local_length(3, r, 4, 1)) for r in range(4)] == [1, 1, 1, 0]  # an empty shard


def _ref_merge(o, lse):
    lse = np.where(np.isnan(lse) | (lse == np.inf), -np.inf, lse).astype(np.float64)
    m = lse.max(0)
    if not np.isfinite(m):
        return np.zeros(o.shape[1:]), -np.inf
    w = np.exp(lse - m)
    total = w.sum()
    return np.where(w[:, None] > 0, w[:, None] * np.nan_to_num(o), 0).sum(0) / total, m + np.log(total)


finite = st.floats(-30, 30, allow_nan=False, width=32)


@settings(max_examples=80, deadline=None)
@given(lses=st.lists(st.one_of(finite, st.just(-np.inf), st.just(np.nan)), min_size=1, max_size=6),
       seed=st.integers(0, 2**16), perm_seed=st.integers(0, 2**16))
def test_merge_properties(lses, seed, perm_seed):
    lse = np.asarray(lses, np.float32)
    o = np.random.default_rng(seed).normal(size=(len(lses), 4)).astype(np.float32)
    o[np.isnan(lse)] = np.nan  # a garbage partial must not leak
    mo, ml = merge_partials(jnp.asarray(o), jnp.asarray(lse), axis=0)
    ro, rl = _ref_merge(o, lse)
    assert not np.isnan(np.asarray(mo)).any()
    np.testing.assert_allclose(np.asarray(mo), ro, rtol=1e-5, atol=1e-5)
    if np.isfinite(rl):
        np.testing.assert_allclose(float(ml), rl, rtol=1e-5, atol=1e-5)
    else:
        assert float(ml) == -np.inf and np.all(np.asarray(mo) == 0)  # all empty: (0, -inf)
    perm = np.random.default_rng(perm_seed).permutation(len(lses))  # permutation invariance
    po, pl = merge_partials(jnp.asarray(o[perm]), jnp.asarray(lse[perm]), axis=0)
    np.testing.assert_allclose(np.asarray(po), np.asarray(mo), rtol=1e-5, atol=1e-6)
    # an empty shard is the identity
    eo, el = merge_partials(jnp.asarray(np.concatenate([o, np.full((1, 4), 7.0, np.float32)])),
                            jnp.asarray(np.concatenate([lse, [-np.inf]]).astype(np.float32)), axis=0)
    np.testing.assert_allclose(np.asarray(eo), np.asarray(mo), rtol=1e-6, atol=1e-7)


# (env, configured, dcp) -> enabled, docs/math.md §7
GRID = [("", True, 2, True), ("", False, 2, False), ("1", False, 2, True), ("0", True, 2, False),
        ("1", True, 1, False), ("", None, 2, True), ("", None, 1, False)]


@pytest.mark.parametrize("env,configured,n,enabled", GRID)
def test_qrep_precedence_grid(env, configured, n, enabled):
    from glm_dsa import configs
    par = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=n, dcp_q_replicate=configured)
    resolved = par.resolve(configs.glm52.parallel_defaults, env={QREP_ENV: env} if env else {})
    assert resolved.q_replicate is enabled
    assert resolved.dcp_comm_backend == "a2a"  # model default fills the unset backend


def test_qrep_env_read_from_os_environ(monkeypatch):
    monkeypatch.setenv(QREP_ENV, "0")
    assert not ParallelConfig(2, 2, True).resolve({"dcp_q_replicate": True}).q_replicate
    monkeypatch.setenv(QREP_ENV, "maybe")
    with pytest.raises(ValueError, match=QREP_ENV):
        ParallelConfig(2, 2).resolve({})


def test_parallel_config_validation_names_numbers():
    with pytest.raises(ValueError,
                       match=r"tensor_parallel_size \(6\) must be a multiple of decode_context_parallel_size \(4\)"):
        ParallelConfig(6, 4)
    with pytest.raises(ValueError, match="dcp_comm_backend"):
        ParallelConfig(2, 2, dcp_comm_backend="nccl")
    from glm_dsa import configs
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(8\)"):
        ParallelConfig(8, 2).check_model(configs.tiny)
    from sharding import make_mesh
    with pytest.raises(ValueError, match=r"tensor_parallel_size=16 needs 16 devices; only 8"):
        make_mesh(ParallelConfig(16, 2))


def test_global_topk_is_exact_under_shard_map():
    """Per-rank local top-k then the group merge equals one top-k over all positions, ties included."""
    n, i, k, length = 4, 2, 6, 29
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, length).astype(np.float32)  # many exact ties
    want = [int(p) for p in sorted(range(length), key=lambda p: (-scores[p], p))[:k]]
    mesh = jax.make_mesh((n,), (DCP,), axis_types=(jax.sharding.AxisType.Auto,))

    def per_rank(_):
        r = jax.lax.axis_index(DCP)
        lp = jnp.arange(int(dcp.local_length(length, 0, n, i)))
        valid = lp < dcp.local_length(length, r, n, i)
        gp = dcp.global_position(lp, r, n, i)
        s = jnp.where(valid, jnp.asarray(scores)[jnp.minimum(gp, length - 1)], -jnp.inf)
        val, idx = jax.lax.top_k(s, k)
        idx = jnp.where(jnp.isfinite(val), idx, -1)
        sel = dcp.global_topk(val[None], idx[None], r, n=n, interleave=i, topk=k)[0]
        return jnp.where(sel >= 0, dcp.global_position(sel, r, n, i), -1)[None]

    out = jax.shard_map(per_rank, mesh=mesh, in_specs=jax.sharding.PartitionSpec(DCP),
                        out_specs=jax.sharding.PartitionSpec(DCP), check_vma=False)(jnp.zeros(n))
    out = np.asarray(out)
    merged = [max(out[:, j]) for j in range(k)]  # exactly one rank owns each selected entry
    assert ((out >= 0).sum(0) == 1).all()
    assert merged == want

