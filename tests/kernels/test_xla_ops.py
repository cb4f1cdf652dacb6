"""The xla (oracle) forms of the ops against hand-computed numpy references."""

import numpy as np
import jax.numpy as jnp
import pytest

from kernels import chunking, fused_norm_rope, indexer, lse_merge, rope, sparse_mla


def np_attention(q, cache, idx, scale, r):
    """Plain numpy: softmax over the listed rows (duplicates counted twice), values = the kv part."""
    t, h, _ = q.shape
    o = np.zeros((t, h, r), np.float64)
    lse = np.full((t, h), -np.inf)
    for i in range(t):
        sel = [j for j in idx[i] if j >= 0]
        if not sel:
            continue
        rows = cache[sel].astype(np.float64)
        s = q[i].astype(np.float64) @ rows.T * scale
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        o[i] = p @ rows[:, :r] / p.sum(-1, keepdims=True)
        lse[i] = (m + np.log(p.sum(-1, keepdims=True)))[:, 0]
    return o, lse


@pytest.mark.parametrize("t,h,k", [(1, 4, 8), (5, 16, 12), (70, 2, 5)])
def test_sparse_mla_matches_numpy(t, h, k):
    rng = np.random.default_rng(t)
    r, dr, n = 32, 16, 50
    q = rng.normal(size=(t, h, r + dr)).astype(np.float32)
    cache = rng.normal(size=(n, r + dr)).astype(np.float32)
    idx = rng.integers(-1, n, size=(t, k)).astype(np.int32)
    idx[-1, :3] = 7  # duplicates
    idx[0] = -1  # a row with no valid index
    o, lse = sparse_mla.sparse_mla(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(idx), scale=0.125,
                                   kv_lora_rank=r)
    o_ref, lse_ref = np_attention(q, cache, idx, 0.125, r)
    np.testing.assert_allclose(np.asarray(o), o_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), lse_ref, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(o)[0] == 0) and np.all(np.isneginf(np.asarray(lse)[0]))


def test_split_k_merge_equals_whole():
    """Attention over two halves of the indices, merged by LSE, equals attention over all of them."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(6, 4, 48)).astype(np.float32))
    cache = jnp.asarray(rng.normal(size=(40, 48)).astype(np.float32))
    idx = rng.permutation(40)[:24].reshape(1, 24).repeat(6, 0).astype(np.int32)
    idx[2, 12:] = -1  # second half empty for one row: identity of the merge
    idx[3, :] = -1  # all empty
    whole = sparse_mla.sparse_mla(q, cache, jnp.asarray(idx), scale=0.2, kv_lora_rank=32)
    parts = [sparse_mla.sparse_mla(q, cache, jnp.asarray(idx[:, s]), scale=0.2, kv_lora_rank=32)
             for s in (slice(0, 12), slice(12, 24))]
    o, lse = lse_merge.merge_partials(jnp.stack([p[0] for p in parts]), jnp.stack([p[1] for p in parts]), axis=0)
    np.testing.assert_allclose(np.asarray(o), np.asarray(whole[0]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(whole[1]), atol=1e-5)
    assert not np.isnan(np.asarray(o)).any() and np.isneginf(np.asarray(lse)[3]).all()


def test_merge_sanitises_nan_and_inf():
    o = jnp.asarray(np.array([[[1.0, 2.0]], [[np.nan, np.nan]], [[5.0, 6.0]]], np.float32))
    lse = jnp.asarray(np.array([[0.0], [np.nan], [np.inf]], np.float32))
    mo, ml = lse_merge.merge_partials(o, lse, axis=0)
    np.testing.assert_allclose(np.asarray(mo), [[1.0, 2.0]])
    np.testing.assert_allclose(np.asarray(ml), [0.0])


def test_rope_interleaved_and_neox_by_hand():
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    cos, sin = rope.rope_cos_sin(jnp.asarray([3]), 8, 10000.0)
    ang = 3 * 10000.0 ** (-np.arange(0, 8, 2) / 8)
    a, b = x[0, 0::2], x[0, 1::2]
    want = np.empty(8)
    want[0::2], want[1::2] = a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)
    np.testing.assert_allclose(np.asarray(rope.apply_rope(jnp.asarray(x), cos, sin))[0], want, rtol=1e-5, atol=1e-5)
    a, b = x[0, :4], x[0, 4:]
    want = np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)])
    got = rope.apply_rope(jnp.asarray(x), cos, sin, interleave=False)
    np.testing.assert_allclose(np.asarray(got)[0], want, rtol=1e-5, atol=1e-5)


def _fused_inputs(t, full=True, seed=0):
    rng = np.random.default_rng(seed)
    r, dr, rq, di, n = 32, 16, 24, 32, 64
    f = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32))  # noqa: E731
    args = dict(q_c=f(t, rq), kv_c=f(t, r + dr), positions=jnp.arange(t, dtype=jnp.int32) + 5,
                q_norm_w=f(rq), kv_norm_w=f(r), mla_cache=f(n, r + dr))
    kw = dict(index_k=f(t, di), index_norm_w=f(di), index_norm_b=f(di), index_cache=f(n, di),
              topk_buf=jnp.zeros((t, 8), jnp.int32)) if full else {}
    return args, kw


def test_fused_negative_slots_write_nothing_but_q_is_normalised():
    args, kw = _fused_inputs(6)
    slots = jnp.asarray([3, -1, 10, -1, -5, 60], jnp.int32)
    q_n, mla, idx, topk = fused_norm_rope.fused_norm_rope_cache(**args, slot_mapping=slots, rope_theta=1e4, **kw)
    qc = np.asarray(args["q_c"], np.float64)
    want_q = qc / np.sqrt((qc ** 2).mean(-1, keepdims=True) + 1e-6) * np.asarray(args["q_norm_w"])
    np.testing.assert_allclose(np.asarray(q_n), want_q, rtol=1e-5, atol=1e-5)  # every row, owned or not
    written = {3: 0, 10: 2, 60: 5}
    old, new = np.asarray(args["mla_cache"]), np.asarray(mla)
    old_i, new_i = np.asarray(kw["index_cache"]), np.asarray(idx)
    for s in range(old.shape[0]):
        if s not in written:
            assert np.array_equal(old[s], new[s]) and np.array_equal(old_i[s], new_i[s]), s
    kv = np.asarray(args["kv_c"])[2, :32].astype(np.float64)
    want_kv = kv / np.sqrt((kv ** 2).mean() + 1e-6) * np.asarray(args["kv_norm_w"])
    np.testing.assert_allclose(new[10, :32], want_kv, rtol=1e-5, atol=1e-5)
    ik = np.asarray(kw["index_k"])[5].astype(np.float64)
    ln = (ik - ik.mean()) / np.sqrt(ik.var() + 1e-6) * np.asarray(kw["index_norm_w"]) + np.asarray(kw["index_norm_b"])
    np.testing.assert_allclose(new_i[60, 16:], ln[16:], rtol=1e-5, atol=1e-5)  # pass-through dims
    assert np.all(np.asarray(topk) == -1)  # full layer: top-k cleared


def test_fused_all_negative_slots_leave_caches_bitwise():
    args, kw = _fused_inputs(4)
    q_n, mla, idx, _ = fused_norm_rope.fused_norm_rope_cache(**args, slot_mapping=jnp.full((4,), -1, jnp.int32),
                                                              rope_theta=1e4, **kw)
    assert np.array_equal(np.asarray(mla), np.asarray(args["mla_cache"]))
    assert np.array_equal(np.asarray(idx), np.asarray(kw["index_cache"]))
    assert not np.allclose(np.asarray(q_n), np.asarray(args["q_c"]))


def test_fused_separate_indexer_slots_and_shared_layer():
    args, kw = _fused_inputs(3)
    slots = jnp.asarray([1, 2, -1], jnp.int32)
    islots = jnp.asarray([40, 41, 42], jnp.int32)
    _, _, idx, _ = fused_norm_rope.fused_norm_rope_cache(**args, slot_mapping=slots, rope_theta=1e4,
                                                         index_slot_mapping=islots, **kw)
    changed = np.where(np.any(np.asarray(idx) != np.asarray(kw["index_cache"]), axis=1))[0]
    assert changed.tolist() == [40, 41]  # the MLA slot's -1 still suppresses the indexer write
    args, _ = _fused_inputs(3, full=False)
    q_n, mla, idx, topk = fused_norm_rope.fused_norm_rope_cache(**args, slot_mapping=slots, rope_theta=1e4)
    assert idx is None and topk is None


def test_indexer_topk_tie_rule_and_padding():
    """Scores built by hand with exact ties: higher score first, then smaller position; -1 past pos+1."""
    bs, di = 4, 8
    # one request, 8 positions over pages [1, 2]; keys chosen so q.k is a chosen score per position
    k_cache = np.zeros((3 * bs, di), np.float32)
    scores = np.array([1.0, 3.0, 3.0, 0.0, 2.0, 3.0, -1.0, 0.0], np.float32)
    for p, s in enumerate(scores):
        k_cache[(1 + p // bs) * bs + p % bs, 0] = s
    q = np.zeros((3, 1, di), np.float32)
    q[:, 0, 0] = 1.0
    w = np.ones((3, 1), np.float32)
    positions = np.array([7, 2, 0], np.int32)
    out = indexer.indexer_topk(jnp.asarray(q), jnp.asarray(w), jnp.asarray(k_cache), jnp.zeros(3, jnp.int32),
                               jnp.asarray(positions + 1), jnp.asarray([[1, 2]], jnp.int32), block_size=bs, topk=5)
    out = np.asarray(out)
    # relu: -1 -> 0 ties with the exact zeros at 3 and 7; order 1,2,5 (3.0), 4 (2.0), 0 (1.0)
    assert out[0].tolist() == [1, 2, 5, 4, 0]
    assert out[1].tolist() == [1, 2, 0, -1, -1]
    assert out[2].tolist() == [0, -1, -1, -1, -1]


def test_indexer_zero_ties_break_by_position():
    bs, di = 8, 4
    k_cache = np.zeros((2 * bs, di), np.float32)
    k_cache[bs + np.arange(8), 0] = [-1, 0, -2, 0.5, -3, 0, 0, -4]  # relu -> [0, 0, 0, .5, 0, 0, 0, 0]
    q = np.zeros((1, 1, di), np.float32)
    q[0, 0, 0] = 1.0
    out = indexer.indexer_topk(jnp.asarray(q), jnp.ones((1, 1)), jnp.asarray(k_cache), jnp.zeros(1, jnp.int32),
                               jnp.asarray([8]), jnp.asarray([[1]], jnp.int32), block_size=bs, topk=4)
    assert np.asarray(out)[0].tolist() == [3, 0, 1, 2]


def test_row_chunking_equals_one_call():
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.normal(size=(37, 5)).astype(np.float32))
    b = jnp.asarray(rng.normal(size=(37,)).astype(np.float32))
    fn = lambda x, y: (x * y[:, None]).sum(-1)  # noqa: E731
    np.testing.assert_allclose(np.asarray(chunking.map_row_chunks(fn, (a, b), 8)), np.asarray(fn(a, b)), rtol=1e-5, atol=1e-6)
