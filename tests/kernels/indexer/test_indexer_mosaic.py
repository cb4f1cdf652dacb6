"""The Mosaic GPU indexer scores kernel (kernels/indexer/mosaic.py) and the indexer op's "mosaic" impl.

On CPU: its launch configs, the shapes it refuses (by name), the split rule, the "auto" rule, that it lowers
(Lane code included) at GLM-5 decode shapes, and the kernel itself under the Pallas GPU interpreter (its repack in
array ops there, `_repack_interpreted`; everything else the same) against the oracle. On the GPU (marker `gpu`):
the native kernel, both producer forms, scores against the float32 xla oracle and the op's top-k against the xla
op's, on random FP8 caches in shuffled pages.
"""

from __future__ import annotations

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import fp8_formats, indexer, registry
from kernels.indexer import mosaic as indexer_mosaic
from kernels.indexer.mosaic import MosaicIndexerConfig

_ON_GPU = registry.on_gpu()
MOSAIC = "mosaic" if _ON_GPU else "mosaic_interpret"


LENS_PATTERN = [0, 1, 63, 64, 65, 200, 511, 512]


def _inputs(lens, *, h=32, page=64, pages=8, seed=0, reqs=None, garbage_tail=False):
    """(q, w, FP8 cache, token_req, kv_lens, block tables): Di = 128, one request a row unless `reqs` (rows may then
    share a request), pages shuffled over the cache. `garbage_tail`: every cache slot past its request's kv_len
    holds 0xFF bytes (NaN e4m3 keys and a NaN scale), which the kernel reads in a row's last tile and must mask."""
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, np.int32)
    t = len(lens)
    reqs = np.arange(t, dtype=np.int32) if reqs is None else np.asarray(reqs, np.int32)
    n_req = int(reqs.max()) + 1
    n_pages = n_req * pages + 2
    keys = rng.normal(size=(n_pages * page, 128)).astype(np.float32) * rng.uniform(0.01, 4.0, size=(n_pages * page, 1))
    cache = np.array(fp8_formats.quantize_index_rows(jnp.asarray(keys)))
    bt = rng.permutation(n_pages)[: n_req * pages].reshape(n_req, pages).astype(np.int32)
    if garbage_tail:
        for r in range(n_req):
            n = int(lens[reqs == r].max()) if np.any(reqs == r) else 0
            for pos in range(n, pages * page):
                cache[bt[r, pos // page] * page + pos % page] = 0xFF
    q = rng.normal(size=(t, h, 128)).astype(np.float32)
    w = rng.normal(size=(t, h)).astype(np.float32)  # signed weights: a key's score may be negative
    return (jnp.asarray(q, jnp.bfloat16), jnp.asarray(w), jnp.asarray(cache), jnp.asarray(reqs), jnp.asarray(lens),
            jnp.asarray(bt), page)


def _oracle_scores(q, w, cache, req, lens, bt, page):
    qp, wp = indexer.prepare_queries(q, w, cache)
    with jax.default_matmul_precision("highest"):
        return np.asarray(jax.jit(functools.partial(indexer.indexer_scores_xla, block_size=page))(
            qp, wp, cache, req, lens, bt))


def _mosaic_scores(q, w, cache, req, lens, bt, page, **options):
    options.setdefault("interpret", not _ON_GPU)
    qp, wp = indexer.prepare_queries(q, w, cache)
    return np.asarray(jax.jit(functools.partial(indexer_mosaic.indexer_scores_mosaic, block_size=page, **options))(
        qp, wp, cache, req, lens, bt))


# Hopper's e4m3 tensor-core dot keeps about 14 bits of its float32 accumulator's mantissa (the DeepSeek-V3 report),
# so the kernel's logits carry an error up to a few 2^-14 of the sum of |products|; the oracle's are float32.
# The check allows 2^-11 of that sum (weighted as the score is): a wrong key, page, scale or mask is off by O(1).
ACCUMULATION = 2.0 ** -11


def _error_bound(q, w, cache, req, lens, bt, page):
    """[T, S]: ACCUMULATION x sum_h |w'_h| sum_d |q'_hd k_sd| x s_k (the oracle's scores over |q'|, |w'| and the
    cache with its e4m3 sign bits cleared)."""
    qp, wp = indexer.prepare_queries(q, w, cache)
    keys = jnp.bitwise_and(cache[:, :128], jnp.uint8(0x7F))
    abs_cache = jnp.concatenate([keys, cache[:, 128:]], axis=1)
    with jax.default_matmul_precision("highest"):
        total = jax.jit(functools.partial(indexer.indexer_scores_xla, block_size=page))(
            jnp.abs(qp.astype(jnp.float32)).astype(qp.dtype), jnp.abs(wp), abs_cache, req, lens, bt)
    return ACCUMULATION * np.where(np.isfinite(total), np.asarray(total), 0.0)


def _check_scores(args, **options):
    """The kernel's scores equal the oracle's within the e4m3 dot's accumulation error (`_error_bound`): the same
    -inf positions (and -inf in the padding past S), no NaN."""
    want = _oracle_scores(*args)
    got = _mosaic_scores(*args, **options)
    assert got.shape[0] == want.shape[0] and got.shape[1] >= want.shape[1]
    assert np.all(got[:, want.shape[1]:] == -np.inf)
    got = got[:, : want.shape[1]]
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), fin)
    assert np.all(got[~fin] == -np.inf) and not np.isnan(got).any()
    bound = _error_bound(*args)
    excess = np.where(fin, np.abs(got - want) - bound, 0.0)
    assert excess.max() <= 1e-6, (excess.max(), np.unravel_index(excess.argmax(), excess.shape))
    # typical errors are far below the worst case (a systematic slip, e.g. a head's weight, would not be)
    assert np.median(np.abs(got - want)[fin] / bound[fin]) <= 0.125
    return got


def test_error_bound_tells_a_wrong_key_from_rounding():
    """The tolerance is not vacuous: scoring each row against the keys of other pages (a block-table mistake)
    breaks it at nearly every position; dropping one head's term (which relu leaves at 0 for about half the keys)
    breaks it at a third of them."""
    args = _inputs(LENS_PATTERN, seed=3)
    q, w, cache, req, lens, bt, page = args
    want, bound = _oracle_scores(*args), _error_bound(*args)
    fin = np.isfinite(want)
    wrong = _oracle_scores(q, w, cache, req, lens, jnp.roll(bt, 1, axis=1), page)
    assert np.mean(np.abs(wrong[fin] - want[fin]) > bound[fin]) > 0.9
    one_head_less = _oracle_scores(q, w.at[:, 7].set(0.0), cache, req, lens, bt, page)
    assert np.mean(np.abs(one_head_less[fin] - want[fin]) > bound[fin]) > 0.3


# ------------------------------------------------------------------------------ CPU

def test_config_is_validated():
    for bad in (dict(stages=0), dict(in_flight=0), dict(consumers=3), dict(ctas=0), dict(n_split=0),
                dict(copy="bulk"), dict(stages=1.5)):
        field = next(iter(bad))
        with pytest.raises(ValueError, match=f"MosaicIndexerConfig.{field}"):
            MosaicIndexerConfig(**bad)
    with pytest.raises(ValueError, match="stages 3 must be a multiple of consumers 2"):
        MosaicIndexerConfig(stages=3, consumers=2)
    with pytest.raises(ValueError, match="in_flight 5 must be <= stages 4"):  # cp.async copies hold a key buffer
        MosaicIndexerConfig(copy="rows", stages=4, in_flight=5)
    assert MosaicIndexerConfig(copy="tma", stages=2, in_flight=6).in_flight == 6  # staging buffers are their own


def test_splits_are_even_where_a_divisor_is_near():
    """ceil(ctas / T) CTAs a row, lowered to a divisor of the row's tiles within a factor 2 (the scores are then
    exactly S wide); n_split is taken as given; never more CTAs than tiles."""
    cfg = MosaicIndexerConfig(ctas=264)
    assert cfg.splits(32, 512) == 8  # ceil(264 / 32) = 9 -> 8
    assert cfg.splits(128, 512) == 2  # 3 -> 2
    assert cfg.splits(1, 512) == 256  # 264 -> 256
    assert cfg.splits(1, 100) == 100  # never more than the tiles
    assert cfg.splits(32, 509) == 9  # 509 is prime: no divisor near 9, so 9 uneven splits
    assert MosaicIndexerConfig(n_split=9).splits(32, 512) == 9
    assert MosaicIndexerConfig(n_split=9).splits(32, 4) == 4


def test_shapes_it_does_not_take_are_refused_by_name():
    q, w, cache, req, lens, bt, page = _inputs([64, 100], pages=2)
    assert indexer_mosaic.supports(q, w, cache, req, lens, bt, block_size=page) is None
    cases = [
        (dict(k_cache=jnp.zeros((256, 128), jnp.bfloat16)), "FP8 indexer cache uint8 \\[slots, 132\\]"),
        (dict(q=jnp.zeros((2, 32, 64), jnp.bfloat16), k_cache=jnp.zeros((256, 68), jnp.uint8)), "FP8 indexer cache"),
        (dict(q=jnp.zeros((2, 32, 64), jnp.bfloat16)), "keys of 128 values"),
        (dict(q=jnp.zeros((2, 264, 128), jnp.bfloat16)), "at most 256 heads"),
        (dict(block_size=32), "pages of a multiple of 64 keys, got block_size 32"),
        (dict(k_cache=jnp.zeros((200, 132), jnp.uint8)), "whole 64-slot tiles, got 200 slots"),
        (dict(interpret=True, config=MosaicIndexerConfig(copy="rows", stages=4, in_flight=3)), "Lane code"),
        (dict(config=MosaicIndexerConfig(stages=8, in_flight=24)), "bytes of shared memory"),
    ]
    base = dict(q=q, weights=w, k_cache=cache, token_req=req, kv_lens=lens, block_tables=bt, block_size=page)
    for change, why in cases:
        kw = dict(base, **change)
        args = [kw.pop(k) for k in ("q", "weights", "k_cache", "token_req", "kv_lens", "block_tables")]
        got = indexer_mosaic.supports(*args, **kw)
        assert got is not None and __import__("re").search(why, got), (change, got)
    with pytest.raises(ValueError, match="indexer_scores_mosaic: .*block_size 32"):
        indexer_mosaic.indexer_scores_mosaic(q, w, cache, req, lens, bt, block_size=32)
    with pytest.raises(ValueError, match="indexer_scores_mosaic: copy 'rows' is Lane code"):
        indexer.indexer_topk(q, w, cache, req, lens, bt, block_size=page, topk=8, impl="mosaic_interpret",
                             copy="rows", stages=4, in_flight=3)


@pytest.mark.parametrize("h,kw", [(32, {}), (64, dict(stages=8, in_flight=16)), (20, dict(stages=4, consumers=2)),
                                  (64, dict(copy="rows", stages=4, in_flight=2))])
def test_shared_memory_bytes_is_what_mosaic_lowering_counts(h, kw):
    """`shared_memory_bytes` (what `supports` holds against the limit) against the count Mosaic GPU's own lowering
    computes for the kernel (lowered for CUDA on the CPU): equal, for both copy forms, padded heads and two
    consumers."""
    cfg = MosaicIndexerConfig(**kw)
    assert indexer_mosaic.shared_memory_bytes(h, cfg) == indexer_mosaic.lowered_smem_bytes(h, cfg)


def test_auto_rule():
    """Off the GPU "xla"; on one, "mosaic" for decode rows of an FP8 cache it takes, "triton" for prefill rows
    (the row-block kernel reads a key tile once for 16 rows), a bf16 cache, pages of 16, or Triton launch options."""
    dec = _inputs([64] * 4, pages=2)
    q, w, cache, req, lens, bt, page = dec

    def pick(*args, **kw):
        return registry.resolve("indexer", "auto", *args, block_size=kw.pop("block_size", page), topk=8, **kw)
    assert pick(q, w, cache, req, lens, bt) == "xla"
    with mock.patch.object(registry, "on_gpu", lambda: True):
        assert pick(q, w, cache, req, lens, bt) == "mosaic"
        assert pick(q, w, cache, req, lens, bt, ordered=False, return_scores=True) == "mosaic"
        assert pick(q, w, cache, req, lens, bt, num_warps=8) == "triton"
        assert pick(q, w, jnp.zeros((cache.shape[0], 128), jnp.bfloat16), req, lens, bt) == "triton"
        assert pick(q, w, cache, req, lens, bt, block_size=16) == "triton"
        t = 64  # a prefill chunk: 64 rows of one request
        pre = (jnp.zeros((t, 32, 128), jnp.bfloat16), jnp.zeros((t, 32)), cache, jnp.zeros((t,), jnp.int32),
               jnp.arange(1, t + 1, dtype=jnp.int32), bt[:1])
        assert pick(*pre) == "triton"


def _lowered(t, h, s, **options):
    from kernels.common.triton_common import lower_for_gpu
    sd = jax.ShapeDtypeStruct
    slots = max(t, 16) * s
    args = (sd((t, h, 128), jnp.float32), sd((t, h), jnp.float32), sd((slots, 132), jnp.uint8),
            sd((t,), jnp.int32), sd((t,), jnp.int32), sd((max(t, 16), s // 64), jnp.int32))
    return lower_for_gpu(functools.partial(indexer.indexer_topk, block_size=64, topk=2048, ordered=False,
                                           impl="mosaic", **options), *args)


@pytest.mark.parametrize("t,options", [(32, {}), (1, {}), (128, {}), (33, {"config": MosaicIndexerConfig(
    copy="rows", stages=4, in_flight=3)}), (32, {"consumers": 2, "stages": 4})])
def test_lowers_at_glm5_decode_shapes(t, options):
    """The kernel, its Lane code included, lowers for CUDA on a machine with no GPU at 32 heads and 32K keys; the
    scores reach the top-k as one [T, 32768] array (no XLA slice of a wider one)."""
    text = _lowered(t, 32, 32768, **options)
    assert "mosaic_gpu" in text
    assert f"tensor<{t}x32768xf32>" in text


# ------------------------------------------------------------------------------ the kernel, interpreted on CPU

@pytest.mark.parametrize("h,options", [(32, {}), (4, {"stages": 4, "in_flight": 3}), (20, {"n_split": 3}),
                                       (8, {"consumers": 2, "stages": 2, "in_flight": 2})])
def test_interpreted_scores_match_the_oracle(h, options):
    """Rows of 0 .. 512 visible keys (tile edges), 4 / 8 / 20 / 32 heads (padded to a multiple of 8 with zero
    weights), signed weights, uneven splits, two consumers, one or three tiles copied ahead."""
    _check_scores(_inputs(LENS_PATTERN, h=h, seed=h), interpret=True, **options)


def test_interpreted_ring_wrap_has_no_race(mosaic_races):
    """Five tiles through two staging buffers and two key buffers, two consumers, under the interpreter's race
    detector (`mosaic_races`). The producer reads each landed tile out of its staging buffer by plain loads (the
    generic proxy) before a TMA (the async proxy) refills it: its `commit_smem` orders the two (without it the
    detector reports the refill). The consumers' loads of a key buffer's scales and the producer's stores that
    refill it are of one proxy, ordered through `k_free`."""
    args = _inputs([300], h=8, seed=1)
    _, races = mosaic_races(lambda: _check_scores(args, interpret=True, n_split=1, consumers=2, stages=2,
                                                  in_flight=2))
    assert not races


@pytest.mark.parametrize("page", [128, 256])
def test_interpreted_pages_larger_than_a_tile(page):
    """A tile starts inside a page: its first slot is the page's plus the tile's offset in it."""
    lens = [1, 130, 257, 700, 1023, 1024]
    _check_scores(_inputs(lens, page=page, pages=1024 // page, seed=page, reqs=[0, 0, 1, 1, 2, 2]),
                  interpret=True)


def test_interpreted_rows_past_kv_len_are_masked_whatever_they_hold():
    lens = [1, 63, 65, 300]
    clean = _check_scores(_inputs(lens, seed=5), interpret=True)
    dirty = _check_scores(_inputs(lens, seed=5, garbage_tail=True), interpret=True)
    np.testing.assert_array_equal(clean, dirty)


def test_interpreted_whole_op_matches_the_xla_op():
    """impl "mosaic_interpret" through `indexer_topk`: the top-k's positions are the xla op's (as a set) and their
    scores the oracle's at those positions (the interpreter's dots are float32: no e4m3 accumulation loss)."""
    lens = [0, 5, 64, 300, 512, 511]
    args = _inputs(lens, seed=11)
    q, w, cache, req, kv, bt, page = args
    f = functools.partial(indexer.indexer_topk, block_size=page, topk=100, return_scores=True, ordered=False)
    pos, val = map(np.asarray, jax.jit(functools.partial(f, impl="mosaic_interpret"))(q, w, cache, req, kv, bt))
    ref_pos, ref_val = map(np.asarray, jax.jit(functools.partial(f, impl="xla"))(q, w, cache, req, kv, bt))
    scores, bound = _oracle_scores(*args), _error_bound(*args)
    for i, n in enumerate(lens):
        k = min(100, n)
        assert np.all(pos[i, k:] == -1) and sorted(pos[i, :k].tolist()) == sorted(ref_pos[i, :k].tolist()), i
        assert np.all(np.abs(val[i, :k] - scores[i, pos[i, :k]]) <= bound[i, pos[i, :k]] + 1e-6), i


# ------------------------------------------------------------------------------ GPU (native Mosaic GPU)

@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"copy": "rows", "stages": 4, "in_flight": 3}, {"consumers": 2},
                                     {"n_split": 3}, {"stages": 2, "in_flight": 2}])
@pytest.mark.parametrize("h", [32, 4, 20])
def test_gpu_scores_match_the_oracle(h, options):
    """Rows of 0 .. 512 visible keys (tile edges), 4 and 20 heads (padded to 8 and 24 with zero weights), signed
    weights; each launch form (splits of uneven tiles, two consumers, cp.async copies) against the xla scores."""
    _check_scores(_inputs(LENS_PATTERN * 2, h=h, seed=h), **options)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [64, 128, 256])
def test_gpu_pages_larger_than_a_tile_and_shared_requests(page):
    """Pages of 2 and 4 tiles (a tile starts inside a page), decode rows of one request at several lengths."""
    lens = [1, 130, 257, 700, 1023, 1024, 0, 64]
    args = _inputs(lens, page=page, pages=1024 // page, seed=page, reqs=[0, 0, 1, 1, 2, 2, 3, 3])
    _check_scores(args)


@pytest.mark.gpu
@pytest.mark.parametrize("copy", ["tma", "rows"])
def test_gpu_rows_past_kv_len_are_masked_whatever_they_hold(copy):
    """The last tile of a row reads the slots past kv_len (NaN keys and scales here): those scores are -inf, never
    NaN, and the visible ones unchanged."""
    lens = [1, 63, 65, 300]
    clean = _check_scores(_inputs(lens, seed=5), copy=copy, stages=4, in_flight=3)
    dirty = _check_scores(_inputs(lens, seed=5, garbage_tail=True), copy=copy, stages=4, in_flight=3)
    np.testing.assert_array_equal(clean, dirty)


@pytest.mark.gpu
@pytest.mark.parametrize("t,ctx", [(1, 32768), (32, 8192), (33, 4096)])
def test_gpu_glm5_shapes_whole_op(t, ctx):
    """The op's "mosaic" impl at 32 heads, top-k 2048, against the xla op: the same valid count per row, and every
    returned position among the oracle's top-k up to rounding, with the oracle's score there (as a set, as the
    model calls it; and in score order)."""
    rng = np.random.default_rng(t)
    lens = rng.integers(1, ctx, size=t).astype(np.int32)
    lens[0] = ctx
    if t > 1:
        lens[1] = 1000  # fewer keys than k
    args = _inputs(lens, pages=ctx // 64, seed=t)
    q, w, cache, req, kv, bt, page = args
    scores, bound = _oracle_scores(*args), _error_bound(*args)
    for ordered in (False, True):
        f = functools.partial(indexer.indexer_topk, block_size=page, topk=2048, return_scores=True, ordered=ordered)
        pos, val = map(np.asarray, jax.jit(functools.partial(f, impl="mosaic"))(q, w, cache, req, kv, bt))
        with jax.default_matmul_precision("highest"):
            _, val_ref = map(np.asarray, jax.jit(functools.partial(f, impl="xla"))(q, w, cache, req, kv, bt))
        for i in range(t):
            n = min(2048, int(lens[i]))
            p = pos[i, :n]
            assert np.all(pos[i, n:] == -1) and np.all(p >= 0) and np.all(p < lens[i]) and len(set(p.tolist())) == n
            assert np.all(np.abs(val[i, :n] - scores[i, p]) <= bound[i, p] + 1e-6), i  # the score at that position
            kth = val_ref[i, n - 1]
            assert np.all(scores[i, p] >= kth - 2 * bound[i].max()), i  # among the oracle's top-k up to rounding
            if ordered:
                assert np.all(np.diff(val[i, :n]) <= 0), i
