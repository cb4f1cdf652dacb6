"""Pallas Triton indexer scores + top-k against the xla oracle: interpreted on CPU, native on the GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import fp8_formats, indexer, sparse_mla_triton

ON_GPU = jax.default_backend() == "gpu"
IMPL = "triton" if ON_GPU else "triton_interpret"


def _inputs(lens, *, h=16, di=32, page=16, pages=6, fp8=False, seed=0, reqs=None, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, np.int32)
    t = len(lens)
    n_req = t if reqs is None else max(reqs) + 1
    n_pages = n_req * pages + 3
    kc = rng.normal(size=(n_pages * page, di)).astype(np.float32)
    cache = fp8_formats.quantize_index_rows(jnp.asarray(kc)) if fp8 else jnp.asarray(kc, dtype)
    bt = rng.permutation(n_pages)[: n_req * pages].reshape(n_req, pages).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(t, h, di)), dtype)
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=(t, h)), jnp.float32)
    req = np.arange(t, dtype=np.int32) if reqs is None else np.asarray(reqs, np.int32)
    return q, w, cache, jnp.asarray(req), jnp.asarray(lens), jnp.asarray(bt), page


def _check(args, topk, **kw):
    q, w, cache, req, lens, bt, page = args

    def f(**opts):  # jitted: the interpreter runs a kernel op by op otherwise (slow for the row-block form)
        return jax.jit(functools.partial(indexer.indexer_topk, block_size=page, topk=topk, return_scores=True,
                                         **opts))(q, w, cache, req, lens, bt)

    pos, val = map(np.asarray, f(impl=IMPL, **kw))
    with jax.default_matmul_precision("highest"):  # the oracle in float32 (a GPU's default is TF32 or less)
        pos_ref, val_ref = map(np.asarray, f(impl="xla"))
    _compare_topk(pos, val, pos_ref, val_ref, lens, topk)
    return pos, val


def _compare_topk(pos, val, pos_ref, val_ref, lens, topk):
    assert pos.shape == pos_ref.shape and pos.dtype == np.int32
    fin = np.isfinite(val_ref)
    np.testing.assert_array_equal(np.isfinite(val), fin)
    np.testing.assert_array_equal(pos[~fin], -1)
    np.testing.assert_allclose(val[fin], val_ref[fin], rtol=1e-3, atol=1e-3)
    # positions agree except where rounding reorders near-equal scores: compare as sets per score
    same = pos == pos_ref
    if not same.all():
        for i, j in zip(*np.where(~same)):
            assert abs(val_ref[i, j] - val[i, j]) < 1e-3 * max(1.0, abs(val_ref[i, j]))
    lens_np = np.asarray(lens)
    for i in range(len(lens_np)):  # fewer candidates than k: -1 padded
        n = min(topk, lens_np[i])
        assert np.all(pos[i, :n] >= 0) and np.all(pos[i, :n] < lens_np[i]) and np.all(pos[i, n:] == -1)
        assert len(set(pos[i, :n].tolist())) == n


@pytest.mark.parametrize("h", [16, 64, 128])
@pytest.mark.parametrize("fp8", [False, True])
def test_matches_xla(h, fp8):
    _check(_inputs([1, 17, 96, 45, 60], h=h, fp8=fp8, seed=h), topk=24, block_s=32)


@pytest.mark.parametrize("topk", [64, 2048])
def test_topk_sizes_and_short_rows(topk):
    # S = 6 pages * 16 = 96 < 2048: k = min(topk, S); rows with fewer candidates than k pad with -1
    _check(_inputs([3, 96, 50], seed=topk), topk=topk, block_s=64)


def test_prefill_rows_of_one_request_in_chunks():
    lens = np.arange(1, 41, dtype=np.int32) + 30  # causal prefill: 40 rows of one request
    args = _inputs(lens, reqs=[0] * 40, seed=5)
    _check(args, topk=16, block_s=32, row_chunk=7)  # several chunks, the last one ragged


def test_ties_break_by_smaller_position():
    """Exact score ties (zeros from relu and equal keys): higher score first, then smaller position."""
    page, di, h = 8, 16, 16
    k_cache = np.zeros((4 * page, di), np.float32)
    vals = [1.0, 3.0, 3.0, -2.0, 2.0, 3.0, -1.0, 0.0, 2.0, 0.5, -3.0, 3.0]
    for p, v in enumerate(vals):  # positions over pages [2, 1]
        k_cache[[2, 1][p // page] * page + p % page, 0] = v
    q = np.zeros((3, h, di), np.float32)
    q[:, :, 0] = 1.0
    for fp8 in (False, True):
        cache = fp8_formats.quantize_index_rows(jnp.asarray(k_cache)) if fp8 else jnp.asarray(k_cache, jnp.bfloat16)
        out = indexer.indexer_topk(jnp.asarray(q, jnp.bfloat16), jnp.ones((3, h)), cache, jnp.zeros(3, jnp.int32),
                                   jnp.asarray([12, 7, 1]), jnp.asarray([[2, 1]], jnp.int32), block_size=page,
                                   topk=8, impl=IMPL, block_s=16)
        out = np.asarray(out)
        assert out[0].tolist() == [1, 2, 5, 11, 4, 8, 0, 9], fp8
        assert out[1].tolist() == [1, 2, 5, 4, 0, 3, 6, -1], fp8  # relu zeros at 3, 6 tie: by position
        assert out[2].tolist() == [0] + [-1] * 7, fp8


@pytest.mark.parametrize("fp8", [False, True])
def test_lowers_to_triton_at_glm5_dims(fp8):
    s = jax.ShapeDtypeStruct
    cache = s((32 * 32768, 132), jnp.uint8) if fp8 else s((32 * 32768, 128), jnp.bfloat16)
    f = functools.partial(indexer.indexer_topk, block_size=64, topk=2048, impl="triton")
    txt = sparse_mla_triton.lower_for_gpu(f, s((32, 32, 128), jnp.bfloat16), s((32, 32), jnp.float32), cache,
                                          s((32,), jnp.int32), s((32,), jnp.int32), s((32, 512), jnp.int32))
    assert "triton" in txt


def test_fp8_queries_reach_the_kernel_as_bits():
    """No XLA convert e4m3 -> wider float on the way into the FP8 scores kernel: XLA's GPU pipeline folds
    f32 -> e4m3 -> bf16 convert chains into f32 -> bf16 (SimplifyFPConversions), so such a convert would hand
    the kernel unquantised queries (0.6-2.4% off the oracle on the H200). The e4m3 bits go in as uint8."""
    s = jax.ShapeDtypeStruct
    f = functools.partial(indexer.indexer_topk, block_size=64, topk=64, impl="triton")
    txt = sparse_mla_triton.lower_for_gpu(f, s((8, 32, 128), jnp.bfloat16), s((8, 32), jnp.float32),
                                          s((64 * 40, fp8_formats.index_row_bytes(128)), jnp.uint8),
                                          s((8,), jnp.int32), s((8,), jnp.int32), s((8, 4), jnp.int32))
    widen = [ln for ln in txt.splitlines() if "stablehlo.convert" in ln and "xf8E4M3FN>) ->" in ln]
    assert not widen, widen
    assert "xf8E4M3FN>) -> tensor<8x32x128xui8>" in txt  # the bitcast of the quantised queries


# Row-block (prefill) kernel cases: (token_req, kv_lens, pages per request, block_t, heads). Page 16, block_s 32.
_ROW_BLOCK_CASES = {
    # T = 37 (not a multiple of 16): blocks straddle request boundaries at rows 10 and 29; S = 5 pages = 80
    # is not a multiple of block_s; causal lengths end mid-page and mid-block
    "straddle": ([0] * 10 + [1] * 19 + [2] * 8,
                 list(range(41, 51)) + list(range(20, 39)) + list(range(73, 81)), 5, 16, 16),
    # kv_len 0 rows inside a shared block, a whole block of them (reads nothing), and in a straddling block
    "zero_len": ([0] * 16 + [1] * 16 + [2] * 5 + [3] * 3,
                 [0, 0, 0] + list(range(7, 20)) + [0] * 16 + [0, 33, 34, 35, 36] + [0, 90, 96], 6, 8, 32),
    # decode-like: every row its own request, so every block gathers per row
    "decode": (list(range(21)), [5, 0, 96, 17, 64, 1, 33, 80, 0, 47, 95, 16, 15, 32, 31, 2, 60, 61, 88, 9, 70],
               6, 4, 16),
}


@pytest.mark.parametrize("case", sorted(_ROW_BLOCK_CASES))
@pytest.mark.parametrize("fp8", [False, True])
def test_row_block_kernel(case, fp8):
    """The row-block form: the per-row kernel's scores, the xla form's scores and top-k positions."""
    from kernels import indexer_triton

    reqs, lens, pages, block_t, h = _ROW_BLOCK_CASES[case]
    args = _inputs(lens, h=h, pages=pages, fp8=fp8, seed=len(lens), reqs=reqs)
    q, w, cache, req, n, bt, page = args
    qp, wp = indexer.prepare_queries(q, w, cache)
    def f(block_t):
        return np.asarray(jax.jit(functools.partial(indexer_triton.indexer_scores_triton, block_size=page, block_s=32,
                                                    block_t=block_t, interpret=not ON_GPU))(qp, wp, cache, req, n, bt))

    rows, per_row = f(block_t), f(1)
    s = pages * page
    assert rows.shape == (len(lens), 96) and np.all(rows[:, s:] == -np.inf)
    if ON_GPU:
        np.testing.assert_allclose(rows, per_row, rtol=1e-6, atol=0)
    else:  # the same operations per row: bit-identical under the interpreter
        np.testing.assert_array_equal(rows, per_row)
    ref = np.asarray(indexer.indexer_scores_xla(qp, wp, cache, req, n, bt, block_size=page))
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(rows[:, :s]), fin)
    np.testing.assert_allclose(rows[:, :s][fin], ref[fin], rtol=1e-4, atol=1e-4)
    # top-k of these scores (the kernel is compiled once: the interpreter is slow to build it) vs the xla form
    topk = 12
    pos, val = map(np.asarray, indexer.topk_positions(jnp.asarray(rows), n, topk, width=s))
    pos_ref, val_ref = map(np.asarray, indexer.indexer_topk_xla(q, w, cache, req, n, bt, block_size=page, topk=topk,
                                                                return_scores=True))
    _compare_topk(pos, val, pos_ref, val_ref, n, topk)


@pytest.mark.parametrize("t", [63, 64])
def test_row_block_chosen_by_rows(t):
    """block_t=None: the per-row kernel alone for decode-sized T; from ROW_BLOCK_MIN_T rows both kernels, picked
    at run time by a cond on how long the rows' requests run."""
    from kernels import indexer_triton

    assert indexer_triton.ROW_BLOCK_MIN_T == 64
    f = functools.partial(indexer_triton.indexer_scores_triton, block_size=16, interpret=True)
    jaxpr = str(jax.make_jaxpr(f)(jnp.zeros((t, 16, 32), jnp.bfloat16), jnp.ones((t, 16)),
                                  jnp.zeros((96, 32), jnp.bfloat16), jnp.zeros(t, jnp.int32), jnp.ones(t, jnp.int32),
                                  jnp.zeros((1, 6), jnp.int32)))
    assert ("indexer_scores_bf16_rows" in jaxpr) == (t >= 64)
    assert jaxpr.count("name=indexer_scores_bf16") == (2 if t >= 64 else 1)  # with the per-row kernel beside it


def test_float32_cache_takes_small_per_row_tiles():
    """A float32 cache (the reference model) scores in the per-row kernel over FLOAT32_BLOCK_S keys even at
    prefill sizes: IEEE float32 dots are unrolled FMAs, and the bf16 tiles took minutes to compile on the H200."""
    from kernels import indexer_triton

    t = 256
    f = functools.partial(indexer_triton.indexer_scores_triton, block_size=16, interpret=True)
    args = (jnp.zeros((t, 16, 32), jnp.float32), jnp.ones((t, 16)), jnp.zeros((16 * 64, 32), jnp.float32),
            jnp.zeros(t, jnp.int32), jnp.ones(t, jnp.int32), jnp.zeros((1, 64), jnp.int32))
    jaxpr = str(jax.make_jaxpr(f)(*args))
    assert "_rows" not in jaxpr and jaxpr.count("name=indexer_scores_bf16") == 1
    assert jax.eval_shape(f, *args).shape == (t, 1024)
    assert f"grid=({t}, {1024 // indexer_triton.FLOAT32_BLOCK_S})" in jaxpr  # one program per row and key tile


@pytest.mark.parametrize("fp8", [False, True])
def test_row_block_lowers_to_triton_at_prefill_dims(fp8):
    """The row-block kernel (16 rows x 128 keys, both branches unrolled) lowers at a 8K-row chunk of a 32K
    context: H=32, Di=128, page 64, FP8 rows of 132 bytes."""
    from kernels import indexer_triton

    s = jax.ShapeDtypeStruct
    cache = s((8 * 32768, 132), jnp.uint8) if fp8 else s((8 * 32768, 128), jnp.bfloat16)
    f = functools.partial(indexer_triton.indexer_scores_triton, block_size=64)
    txt = sparse_mla_triton.lower_for_gpu(f, s((8192, 32, 128), jnp.bfloat16), s((8192, 32), jnp.float32), cache,
                                          s((8192,), jnp.int32), s((8192,), jnp.int32), s((8, 512), jnp.int32))
    assert "triton" in txt and "_rows" in txt


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_glm5_shapes(fp8):
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 8192, size=8).astype(np.int32)
    lens[0] = 8192
    lens[1] = 1000  # fewer candidates than k
    _check(_inputs(lens, h=32, di=128, page=64, pages=128, fp8=fp8, seed=1), topk=2048)


@pytest.mark.gpu
def test_gpu_float32_cache_prefill_rows():
    """A float32 cache at GLM-5 dims over a prefill-sized batch (two requests of 96 rows): it compiles (its own
    small tiles) and its IEEE float32 scores pick the oracle's top-k."""
    lens = np.concatenate([np.arange(1, 97), 4000 + np.arange(96)]).astype(np.int32)
    reqs = [0] * 96 + [1] * 96
    _check(_inputs(lens, h=32, di=128, page=64, pages=64, seed=2, reqs=reqs, dtype=jnp.float32), topk=2048)


@pytest.mark.parametrize("radix_bits", [4, 8])
def test_topk_select_kernel_ties_signs_and_lengths(radix_bits):
    """The radix-select top-k against lax.top_k on scores full of exact ties, negatives and signed zeros."""
    from kernels import indexer_triton

    rng = np.random.default_rng(radix_bits)
    t, s, k = 7, 300, 40
    sc = rng.integers(-3, 4, size=(t, s)).astype(np.float32) * 0.5  # many exact ties
    sc[1] = -0.0
    sc[2, ::3] = 0.0
    sc[3] = rng.normal(size=s).astype(np.float32)
    lens = np.array([s, 17, 250, 0, 1, 40, 123], np.int32)
    sc = np.where(np.arange(s)[None, :] < lens[:, None], sc, -np.inf).astype(np.float32)
    pos, val = indexer_triton.topk_triton(jnp.asarray(sc), jnp.asarray(lens), k, s, chunk=64, radix_bits=radix_bits,
                                          num_warps=4, interpret=not ON_GPU)
    pos_ref, val_ref = indexer.topk_positions(jnp.asarray(sc), jnp.asarray(lens), k)
    np.testing.assert_array_equal(np.asarray(pos), np.asarray(pos_ref))
    np.testing.assert_array_equal(np.asarray(val), np.asarray(val_ref))


@pytest.mark.parametrize("topk_impl", ["xla", "triton"])
def test_zero_length_rows_and_both_topk_stages(topk_impl):
    args = _inputs([0, 5, 96, 33], seed=9)
    pos, _ = _check(args, topk=8, block_s=32, topk_impl=topk_impl)
    assert np.all(pos[0] == -1)


def test_fp8_oracle_by_hand():
    """xla form over the FP8 cache = sum_h w[t,h] s_q[t,h] relu(q8 . k8) s_k, with q quantised per (t, h)."""
    q, w, cache, req, lens, bt, page = _inputs([40, 96], fp8=True, seed=4)
    pos, val = indexer.indexer_topk(q, w, cache, req, lens, bt, block_size=page, topk=10, return_scores=True)
    q8, s_q = fp8_formats.quantize_index_queries(q)
    k8, s_k = fp8_formats.split_index_rows(cache, q.shape[-1])
    slots = np.asarray(indexer.request_slots(bt, page))
    q8, s_q, k8, s_k = (np.asarray(x, np.float64) for x in (q8.astype(jnp.float32), s_q, k8.astype(jnp.float32), s_k))
    for t in range(2):
        sl = slots[int(req[t]), : int(lens[t])]
        w_t = np.asarray(w, np.float64)[t, :, None] * s_q[t, :, None]
        sc = (w_t * np.maximum(q8[t] @ k8[sl].T, 0)).sum(0) * s_k[sl]
        np.testing.assert_allclose(np.asarray(val)[t], np.sort(sc)[::-1][:10], rtol=1e-5)
        np.testing.assert_allclose(sc[np.asarray(pos)[t]], np.sort(sc)[::-1][:10], rtol=1e-5)
