"""The indexer's top-k as an op ("topk": `kernels.indexer.select_topk`): the select kernel (kernels/topk_triton.py)
returns exactly `lax.top_k`'s positions and scores (`topk_positions`, the xla impl) — ties by smaller position,
-0.0 as +0.0, -1 / -inf past kv_lens, rows shorter than k, k = 2048 of 32K, every output order — interpreted on CPU,
native on the GPU; the triton indexer's per-shape choice of top-k; both kernels' lowering at GLM-5 dims."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import fp8_formats, indexer, indexer_triton, registry, topk_triton
from kernels.triton_common import lower_for_gpu, triton_calls


def _select(impl, scores, lens, k, width=None, **opts):
    f = jax.jit(functools.partial(indexer.select_topk, topk=k, width=width, impl=impl, **opts))
    return tuple(map(np.asarray, f(jnp.asarray(scores, jnp.float32), jnp.asarray(lens, jnp.int32))))


def _assert_same(got, want):
    """Positions equal, scores equal bit for bit (so +0.0 is not -0.0)."""
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1].view(np.int32), want[1].view(np.int32))


def test_hand_built_ties_every_impl(impl):
    """Higher score first, then smaller position; relu's zeros (and a -0.0) tie with 0.0; -1 / -inf past kv_lens."""
    s = np.array([[1.0, 3.0, 3.0, 0.0, 2.0, 3.0, -0.0, 0.0],
                  [1.0, 3.0, 3.0, 0.0, 2.0, 3.0, -0.0, 0.0],
                  [5.0, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf]], np.float32)
    pos, val = _select(impl, s, [8, 3, 1], 5)
    assert pos.tolist() == [[1, 2, 5, 4, 0], [1, 2, 5, -1, -1], [0, -1, -1, -1, -1]]
    assert val[0].tolist() == [3.0, 3.0, 3.0, 2.0, 1.0] and val[2, 1:].tolist() == [-np.inf] * 4
    pos, val = _select(impl, s[:1], [8], 8)
    assert pos[0].tolist() == [1, 2, 5, 4, 0, 3, 6, 7]  # the three zeros by position
    assert not np.signbit(val[0, 6])  # -0.0 comes back as +0.0


_CASES = {
    # name: (scores [T, S] builder, kv_lens, k, options)
    "ints_many_ties": (lambda r: r.integers(-3, 4, size=(5, 96)).astype(np.float32), [96, 50, 3, 0, 96], 24, {}),
    "zeros_at_the_kth": (lambda r: np.maximum(r.normal(size=(3, 1000)) - 1.5, 0).astype(np.float32),
                         [1000, 999, 700], 300, {}),
    "normal": (lambda r: r.normal(size=(4, 1000)).astype(np.float32), [1000, 999, 400, 700], 64, {}),
    "quarter_steps": (lambda r: (np.round(r.normal(size=(3, 1000)) * 4) / 4).astype(np.float32), [1000, 17, 300],
                      300, {"num_warps": 4}),
    "sorted_in_kernel": (lambda r: r.integers(0, 9, size=(3, 200)).astype(np.float32), [200, 5, 150], 40,
                         {"sort": "kernel"}),
    "negative_and_inf": (lambda r: np.where(r.uniform(size=(2, 128)) < 0.3, -np.inf, -np.abs(r.normal(size=(2, 128))))
                         .astype(np.float32), [128, 64], 100, {}),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_select_equals_lax_top_k(kernel_impl, case):
    build, lens, k, opts = _CASES[case]
    scores = build(np.random.default_rng(len(case)))
    _assert_same(_select(kernel_impl, scores, lens, k, chunks=1, **opts), _select("xla", scores, lens, k))


def test_position_order_is_the_same_selection(kernel_impl):
    """sort="none": the same (position, score) entries, in position order; -1 / -inf after them."""
    r = np.random.default_rng(5)
    scores = r.integers(0, 6, size=(3, 300)).astype(np.float32)
    lens = [300, 40, 2]
    pos, val = _select(kernel_impl, scores, lens, 64, sort="none")
    ref_pos, ref_val = _select("xla", scores, lens, 64)
    for i in range(3):
        keep = ref_pos[i] >= 0
        order = np.argsort(ref_pos[i][keep])
        np.testing.assert_array_equal(pos[i][: keep.sum()], ref_pos[i][keep][order])
        np.testing.assert_array_equal(val[i][: keep.sum()], ref_val[i][keep][order])
        assert np.all(pos[i][keep.sum():] == -1) and np.all(val[i][keep.sum():] == -np.inf)


def test_width_narrower_than_the_score_columns(kernel_impl):
    """Scores padded on the right with -inf (the scores kernel's tiles, `topk_positions`' contract): k is
    min(topk, width); a width that is not a power of two takes the masked row load."""
    r = np.random.default_rng(3)
    for width in (100, 128):
        scores = np.where(np.arange(128) < width, r.normal(size=(3, 128)), -np.inf).astype(np.float32)
        _assert_same(_select(kernel_impl, scores, [100, 7, 60], 200, width=width),
                     _select("xla", scores, [100, 7, 60], 200, width=width))


def test_k_2048_of_32k(kernel_impl):
    """GLM-5 sizes: 32K scores a row, k = 2048; continuous scores, a row that is half relu zeros (the zeros never
    reach the top), one whose k-th score is a zero shared by thousands, a row of integer scores, short rows."""
    r = np.random.default_rng(7)
    s = r.normal(size=(4, 32768)).astype(np.float32)
    s[1] = np.maximum(s[1], 0)
    s[2] = np.maximum(s[2] - 2.0, 0)  # ~2.3% positive: tau = 0 with ~32K tied zeros
    s[3] = r.integers(0, 50, size=32768)
    for lens in ([32768, 30000, 32768, 32768], [2047, 2048, 2049, 1]):
        _assert_same(_select(kernel_impl, s, lens, 2048), _select("xla", s, lens, 2048))


@pytest.mark.parametrize("chunks", [2, 3, 4])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_chunked_select_equals_lax_top_k(kernel_impl, case, chunks):
    """TopkConfig(chunks=C): each chunk's top k, then the top k of the C * k candidates, is exactly the one-pass
    top-k (ties by smaller position across chunks too; a width that does not split evenly pads the last chunk;
    rows whose chunks would hold fewer than k scores take one pass)."""
    build, lens, k, opts = _CASES[case]
    scores = build(np.random.default_rng(len(case)))
    _assert_same(_select(kernel_impl, scores, lens, k, chunks=chunks, **opts), _select("xla", scores, lens, k))


def test_chunked_select_k_2048_of_32k(kernel_impl):
    """GLM-5 sizes through the two passes: the row that ties thousands of zeros at the k-th score (the tie cut
    spans chunks), integer scores, short rows, and the position order of sort="none"."""
    r = np.random.default_rng(11)
    s = r.normal(size=(3, 32768)).astype(np.float32)
    s[1] = np.maximum(s[1] - 2.0, 0)
    s[2] = r.integers(0, 50, size=32768)
    for lens in ([32768, 32768, 30000], [2047, 2049, 1]):
        want = _select("xla", s, lens, 2048)
        _assert_same(_select(kernel_impl, s, lens, 2048, chunks=4), want)
        pos, val = _select(kernel_impl, s, lens, 2048, chunks=4, sort="none")
        for i in range(3):
            keep = want[0][i] >= 0
            order = np.argsort(want[0][i][keep])
            np.testing.assert_array_equal(pos[i][: keep.sum()], want[0][i][keep][order])
            np.testing.assert_array_equal(val[i][: keep.sum()], want[1][i][keep][order])


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_rank_order_equals_lax_top_k(kernel_impl, case, chunks):
    """sort="rank": the selection put in (score desc, position asc) order by each entry's count of entries ahead
    of it (the rank kernel), exactly `lax.top_k`'s order, ties and -1 padding included."""
    build, lens, k, opts = _CASES[case]
    scores = build(np.random.default_rng(len(case)))
    opts = dict(opts, sort="rank")
    _assert_same(_select(kernel_impl, scores, lens, k, chunks=chunks, **opts), _select("xla", scores, lens, k))


def test_rank_order_k_2048_of_32k(kernel_impl):
    """The rank kernel at GLM-5 sizes (4 programs a row of 2048), after both passes: thousands of tied zeros,
    integer scores, rows shorter than k."""
    r = np.random.default_rng(13)
    s = r.normal(size=(3, 32768)).astype(np.float32)
    s[1] = np.maximum(s[1] - 2.0, 0)
    s[2] = r.integers(0, 50, size=32768)
    for lens in ([32768, 32768, 30000], [2047, 2049, 1]):
        _assert_same(_select(kernel_impl, s, lens, 2048, sort="rank"), _select("xla", s, lens, 2048))


def test_dispatch_takes_the_kernel_where_it_fits():
    """The triton indexer's top-k: by default the select kernel on a GPU where it takes the row (faster than
    `lax.top_k` on the H200), `lax.top_k` for wider rows, for fewer than SELECT_MIN_ROWS rows, under the
    interpreter and for "lax"; the select kernel when asked for "select"; on a row too wide that is the registry's
    error naming the limit."""
    wide = indexer.SELECT_MAX_S * 2
    assert indexer_triton.topk_select_impl(32768, 2048, None, False) == "triton"
    few = indexer_triton.SELECT_MIN_ROWS
    assert indexer_triton.topk_select_impl(32768, 2048, None, False, rows=few) == "triton"
    assert indexer_triton.topk_select_impl(32768, 2048, None, False, rows=few - 1) == "xla"
    assert indexer_triton.topk_select_impl(32768, 2048, "select", False, rows=1) == "triton"
    assert indexer_triton.topk_select_impl(wide, 2048, None, False) == "xla"
    assert indexer_triton.topk_select_impl(32768, 2048, None, True) == "xla"
    assert indexer_triton.topk_select_impl(32768, 2048, "select", False) == "triton"
    assert indexer_triton.topk_select_impl(32768, 2048, "select", True) == "triton_interpret"
    assert indexer_triton.topk_select_impl(32768, 2048, "lax", False) == "xla"
    assert indexer_triton.topk_select_impl(wide, 2048, "select", True) == "triton_interpret"
    with pytest.raises(ValueError, match="topk: impl 'triton_interpret' does not support.*SELECT_MAX_S"):
        indexer.select_topk(jnp.zeros((1, wide)), jnp.ones((1,), jnp.int32), 16, impl="triton_interpret")
    with pytest.raises(ValueError, match="topk_impl 'fast'"):
        indexer_triton.topk_select_impl(32768, 2048, "fast", False)
    assert {"xla", "triton", "triton_interpret", "auto"} <= set(registry.impls("topk"))
    z = jnp.zeros((2, 64))
    assert registry.resolve("topk", "auto", z, jnp.ones((2,), jnp.int32), 8) == ("triton" if registry.on_gpu()
                                                                                else "xla")
    assert registry.resolve("topk", "auto", jnp.zeros((1, wide)), jnp.ones((1,), jnp.int32), 8) == "xla"


def test_topk_config_is_validated():
    for bad, what in ((dict(num_warps=3), "num_warps 3"), (dict(num_warps=64), "num_warps 64"),
                      (dict(sort="gpu"), "sort 'gpu'"), (dict(chunks=0), "chunks 0"), (dict(chunks=True), "chunks True"),
                      (dict(chunks=2.0), "chunks 2.0")):
        with pytest.raises(ValueError, match=what):
            topk_triton.TopkConfig(**bad)
    with pytest.raises(ValueError, match=r"unknown options \['warps'\]"):
        indexer.select_topk(jnp.zeros((1, 32)), jnp.ones((1,), jnp.int32), 4, impl="triton_interpret", warps=4)


def test_indexer_end_to_end_top_k_choice_gives_the_same_positions(kernel_impl):
    """The whole triton indexer with the select kernel and with `lax.top_k` over the same kernel scores."""
    r = np.random.default_rng(11)
    page, pages, lens = 16, 6, [1, 17, 96, 45, 60]
    cache = fp8_formats.quantize_index_rows(jnp.asarray(r.normal(size=(len(lens) * pages * page, 32)), jnp.float32))
    bt = jnp.asarray(r.permutation(len(lens) * pages).reshape(len(lens), pages), jnp.int32)
    q = jnp.asarray(r.normal(size=(len(lens), 16, 32)), jnp.bfloat16)
    w = jnp.asarray(r.uniform(0.1, 1.0, size=(len(lens), 16)), jnp.float32)
    f = functools.partial(indexer.indexer_topk, q, w, cache, jnp.arange(len(lens), dtype=jnp.int32),
                          jnp.asarray(lens, jnp.int32), bt, block_size=page, topk=24, impl=kernel_impl,
                          return_scores=True)
    _assert_same(tuple(map(np.asarray, jax.jit(lambda: f(topk_impl="select"))())),
                 tuple(map(np.asarray, jax.jit(lambda: f(topk_impl="lax"))())))


# ------------------------------------------------------------------------------ lowering (CPU, no GPU needed)

@pytest.mark.parametrize("b, grid_n", [(1, 256), (32, 32), (128, 8)])
def test_decode_lowers_to_three_kernels_at_glm5_dims(b, grid_n):
    """Decode over 32K keys (FP8 cache, page 64) with topk_impl="select": the looped scores kernel (1024 keys a
    program at B = 32, one tile at B = 1) then the chunked select: four programs a row over 8K-score chunks, then
    one a row over the 8K candidates (32 warps: 8 scores a thread)."""
    s = jax.ShapeDtypeStruct
    f = functools.partial(indexer.indexer_topk, block_size=64, topk=2048, impl="triton", topk_impl="select")
    calls = triton_calls(lower_for_gpu(f, s((b, 32, 128), jnp.bfloat16), s((b, 32), jnp.float32),
                                       s((32 * 32768, 132), jnp.uint8), s((b,), jnp.int32), s((b,), jnp.int32),
                                       s((32, 512), jnp.int32)))
    assert [(c.name, c.grid, c.num_warps) for c in calls] == [
        ("indexer_scores_fp8_loop", (b, grid_n, 1), 4), ("indexer_topk_select", (4 * b, 1, 1), 32),
        ("indexer_topk_select", (b, 1, 1), 32)]


@pytest.mark.parametrize("sort", ["kernel", "xla", "none"])
def test_select_lowers_with_each_order(sort):
    """Rows of SELECT_MAX_S keys (64 a thread) lower in one pass for every output order."""
    s = jax.ShapeDtypeStruct
    f = functools.partial(topk_triton.topk_select, topk=2048, config=topk_triton.TopkConfig(sort=sort, chunks=1))
    calls = triton_calls(lower_for_gpu(f, s((8, 65536), jnp.float32), s((8,), jnp.int32)))
    assert [(c.name, c.grid, c.num_warps) for c in calls] == [("indexer_topk_select", (8, 1, 1), 32)]


@pytest.mark.parametrize("chunks, first", [(2, (64, 32)), (4, (128, 32))])
def test_chunked_select_lowers_to_two_launches(chunks, first):
    """chunks=C at B = 32 x 32K: C * 32 chunk programs of 8 scores a thread, then one program per row over the
    C * 2048 candidates."""
    s = jax.ShapeDtypeStruct
    f = functools.partial(topk_triton.topk_select, topk=2048, config=topk_triton.TopkConfig(chunks=chunks))
    calls = triton_calls(lower_for_gpu(f, s((32, 32768), jnp.float32), s((32,), jnp.int32)))
    assert [(c.name, c.grid[0], c.num_warps) for c in calls] == [
        ("indexer_topk_select", first[0], first[1]), ("indexer_topk_select", 32, chunks * 2048 // 256)]


def test_loop_block_n_keeps_the_sms_busy():
    """Keys per program: the most (power-of-two tiles) that still leave LOOP_PROGRAMS programs."""
    assert indexer_triton.loop_block_n(1, 32768, 128) == 128
    assert indexer_triton.loop_block_n(32, 32768, 128) == 1024
    assert indexer_triton.loop_block_n(128, 32768, 128) == 4096
    assert indexer_triton.loop_block_n(4096, 32768, 128) == 32768
    assert indexer_triton.loop_block_n(32, 96, 32) == 32
