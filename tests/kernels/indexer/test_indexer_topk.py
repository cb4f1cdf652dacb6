"""The indexer's top-k as an op ("topk": `kernels.indexer.select_topk`): the select kernel
(kernels/indexer/topk_triton.py) returns exactly `lax.top_k`'s positions and scores (`topk_positions`, the xla impl) — ties by smaller position,
-0.0 as +0.0, -1 / -inf past kv_lens, rows shorter than k, k = 2048 of 32K, every output order — interpreted on CPU,
native on the GPU; the triton indexer's per-shape choice of top-k; both kernels' lowering at GLM-5 dims."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import fp8_formats, indexer, registry
from kernels.indexer import triton as indexer_triton
from kernels.indexer import topk_triton
from kernels.common.triton_common import lower_for_gpu, triton_calls


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
    # rows that keep nothing (kv_lens 0) of -inf or of tied zeros, wider than k_pad, between rows that keep some: an
    # empty row's selection once overflowed its output slots into the next row's on the H200 (one pass and chunked)
    "empty_rows_of_ties": (lambda r: np.stack([np.full(200, -np.inf), r.normal(size=200), np.zeros(200),
                                               r.integers(0, 3, size=200), np.full(200, -np.inf)]).astype(np.float32),
                           [0, 200, 0, 150, 0], 16, {}),
    "negative_and_inf": (lambda r: np.where(r.uniform(size=(2, 128)) < 0.3, -np.inf, -np.abs(r.normal(size=(2, 128))))
                         .astype(np.float32), [128, 64], 100, {}),
}


def test_selection_takes_exactly_the_reference_keys():
    """The kernel's threshold and selection mask (`_threshold`, `_selected`, plain jnp) on one row: exactly
    min(k, kv_len) keys, the set `lax.top_k` keeps; none for kv_len 0, even where the row is all ties (without
    the kv_len 0 guard the mask took every tie of the greatest key and the kernel wrote past the row's slots)."""
    r = np.random.default_rng(2)
    rows = {"all_inf": np.full(96, -np.inf), "zeros": np.zeros(96), "ints": r.integers(0, 4, size=96),
            "normal": r.normal(size=96)}
    s_pad = 128

    @jax.jit
    def mask(x, ke):
        p = jax.lax.iota(jnp.int32, s_pad)
        key = jnp.where(p < 96, topk_triton._order_key(jnp.pad(x, (0, s_pad - 96))), topk_triton.KEY_MIN)
        lo, hi = topk_triton._bounds(key)
        tau, cut_at, _ = topk_triton._threshold(key, p, ke, lo, hi, 96, s_pad)
        return topk_triton._selected(key, p, tau, cut_at, ke)

    for name, x in rows.items():
        x = jnp.asarray(x, jnp.float32)
        for ke in (0, 1, 5, 40, 96):
            sel = np.asarray(mask(x, jnp.int32(ke)))
            want = np.asarray(indexer.topk_positions(x[None], jnp.asarray([ke]), ke)[0][0]) if ke else []
            assert sorted(np.flatnonzero(sel).tolist()) == sorted(want), (name, ke)


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


def test_dispatch_takes_the_kernel_where_it_fits():
    """The triton indexer's top-k: by default the select kernel on a GPU where it takes the row (faster than
    `lax.top_k` on the H200), `lax.top_k` for wider rows, for fewer than SELECT_MIN_ROWS rows unless they split
    into the two-pass select's chunks, under the
    interpreter and for "lax"; the select kernel when asked for "select"; on a row too wide that is the registry's
    error naming the limit."""
    wide = indexer.SELECT_MAX_S * 2
    assert indexer_triton.topk_select_impl(32768, 2048, None, False) == "triton"
    few = indexer_triton.SELECT_MIN_ROWS
    assert indexer_triton.topk_select_impl(32768, 2048, None, False, rows=few) == "triton"
    assert indexer_triton.topk_select_impl(32768, 2048, None, False, rows=few - 1) == "xla"
    # rows that split into chunks of at least k scores take the two-pass select from one row
    cfg = topk_triton.TopkConfig()
    assert indexer_triton.topk_select_impl(32768, 2048, None, False, rows=1, config=cfg) == "triton"
    assert indexer_triton.topk_select_impl(8192, 2048, None, False, rows=1, config=cfg) == "triton"
    assert indexer_triton.topk_select_impl(8188, 2048, None, False, rows=1, config=cfg) == "xla"  # chunks of 2047
    assert indexer_triton.topk_select_impl(8188, 2048, None, False, rows=few, config=cfg) == "triton"
    assert indexer_triton.topk_select_impl(32768, 2048, None, True, rows=1, config=cfg) == "xla"
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


@pytest.mark.parametrize("rows", [1, 3, 4, 16])
@pytest.mark.parametrize("s,chunks", [(32768, 1), (32768, 4), (4096, 4), (wide := 65536 * 2, 4)])
def test_topk_auto_is_the_indexers_choice(rows, s, chunks):
    """The op's "auto" and the indexer's top-k (`topk_select_impl`) are one rule: on a GPU the select kernel from
    SELECT_MIN_ROWS rows of one pass, or from one row where the rows split into the two-pass select's chunks;
    lax.top_k for fewer rows and for rows over SELECT_MAX_S."""
    from kernels.indexer.config import SELECT_MIN_ROWS, TopkConfig
    config = TopkConfig(chunks=chunks)
    with registry.deciding_for("gpu"):
        op = registry.resolve("topk", "auto", jax.ShapeDtypeStruct((rows, s), jnp.float32), None, 2048, s,
                              config=config)
        in_indexer = indexer_triton.topk_select_impl(s, 2048, None, False, rows=rows, config=config)
    want = "xla" if s > indexer.SELECT_MAX_S or (rows < SELECT_MIN_ROWS and not config.two_pass(s, 2048)) else "triton"
    assert op == in_indexer == want


def test_topk_config_is_validated():
    for bad, what in ((dict(num_warps=3), "num_warps 3"), (dict(num_warps=64), "num_warps 64"),
                      (dict(sort="gpu"), "sort 'gpu'"), (dict(sort="rank"), "sort 'rank'"), (dict(chunks=0), "chunks 0"),
                      (dict(chunks=True), "chunks True"), (dict(chunks=2.0), "chunks 2.0")):
        with pytest.raises(ValueError, match=what):
            topk_triton.TopkConfig(**bad)
    with pytest.raises(ValueError, match=r"unknown options \['warps'\]"):
        indexer.select_topk(jnp.zeros((1, 32)), jnp.ones((1,), jnp.int32), 4, impl="triton_interpret", warps=4)


def _whole_op(lens, seed, page=16, pages=6):
    """The indexer op over random FP8 keys (Di 32, 16 heads, a request a row, top 24): f(impl, **options) ->
    (positions, scores) as numpy."""
    r = np.random.default_rng(seed)
    cache = fp8_formats.quantize_index_rows(jnp.asarray(r.normal(size=(len(lens) * pages * page, 32)), jnp.float32))
    bt = jnp.asarray(r.permutation(len(lens) * pages).reshape(len(lens), pages), jnp.int32)
    q = jnp.asarray(r.normal(size=(len(lens), 16, 32)), jnp.bfloat16)
    w = jnp.asarray(r.uniform(0.1, 1.0, size=(len(lens), 16)), jnp.float32)

    def f(impl, **opts):
        g = functools.partial(indexer.indexer_topk, block_size=page, topk=24, impl=impl, return_scores=True, **opts)
        return tuple(map(np.asarray, jax.jit(g)(q, w, cache, jnp.arange(len(lens), dtype=jnp.int32),
                                                jnp.asarray(lens, jnp.int32), bt)))
    return f


def test_indexer_end_to_end_top_k_choice_gives_the_same_positions(kernel_impl):
    """The whole triton indexer with the select kernel and with `lax.top_k` over the same kernel scores."""
    f = _whole_op([1, 17, 96, 45, 60], seed=11)
    _assert_same(f(kernel_impl, topk_impl="select"), f(kernel_impl, topk_impl="lax"))


def test_unordered_indexer_gives_the_same_entries_in_position_order(kernel_impl):
    """`indexer_topk(ordered=False)` (the model's call): the ordered op's entries, each row's in position order on
    the select kernel (the sort it skips), -1 / -inf after them; a zero-length row stays all -1; the xla impl
    ignores the permission and returns the ordered result."""
    lens = [0, 17, 96, 5, 60]
    f = _whole_op(lens, seed=12)
    want = f(kernel_impl, topk_impl="select")
    pos, val = f(kernel_impl, topk_impl="select", ordered=False)
    for i, n in enumerate(lens):
        n = min(n, 24)
        order = np.argsort(want[0][i, :n])
        np.testing.assert_array_equal(pos[i, :n], want[0][i, :n][order])
        np.testing.assert_array_equal(val[i, :n], want[1][i, :n][order])
        assert np.all(pos[i, n:] == -1) and np.all(val[i, n:] == -np.inf), i
    _assert_same(f("xla", ordered=False), f("xla"))


# ------------------------------------------------------------------------------ lowering (CPU, no GPU needed)

@pytest.mark.parametrize("b, grid_n", [(1, 256), (32, 32), (128, 8)])
def test_decode_lowers_to_three_kernels_at_glm5_dims(b, grid_n):
    """Decode over 32K keys (FP8 cache, page 64) with topk_impl="select": the looped scores kernel (1024 keys a
    program at B = 32, one tile at B = 1) then the chunked select: four programs a row over 8K-score chunks, then
    one a row over the 8K candidates (8 warps each: 32 scores a thread)."""
    s = jax.ShapeDtypeStruct
    f = functools.partial(indexer.indexer_topk, block_size=64, topk=2048, impl="triton", topk_impl="select")
    calls = triton_calls(lower_for_gpu(f, s((b, 32, 128), jnp.bfloat16), s((b, 32), jnp.float32),
                                       s((32 * 32768, 132), jnp.uint8), s((b,), jnp.int32), s((b,), jnp.int32),
                                       s((32, 512), jnp.int32)))
    assert [(c.name, c.grid, c.num_warps) for c in calls] == [
        ("indexer_scores_fp8_loop", (b, grid_n, 1), 4), ("indexer_topk_select", (4 * b, 1, 1), 8),
        ("indexer_topk_select", (b, 1, 1), 8)]


@pytest.mark.parametrize("sort", ["kernel", "xla", "none"])
def test_select_lowers_with_each_order(sort):
    """Rows of SELECT_MAX_S keys (64 a thread) lower in one pass for every output order."""
    s = jax.ShapeDtypeStruct
    f = functools.partial(topk_triton.topk_select, topk=2048, config=topk_triton.TopkConfig(sort=sort, chunks=1))
    calls = triton_calls(lower_for_gpu(f, s((8, 65536), jnp.float32), s((8,), jnp.int32)))
    assert [(c.name, c.grid, c.num_warps) for c in calls] == [("indexer_topk_select", (8, 1, 1), 32)]


@pytest.mark.parametrize("chunks, first", [(2, (64, 16)), (4, (128, 8))])
def test_chunked_select_lowers_to_two_launches(chunks, first):
    """chunks=C at B = 32 x 32K: C * 32 chunk programs, then one program per row over the C * 2048 candidates,
    each pass 32 scores a thread."""
    s = jax.ShapeDtypeStruct
    f = functools.partial(topk_triton.topk_select, topk=2048, config=topk_triton.TopkConfig(chunks=chunks))
    calls = triton_calls(lower_for_gpu(f, s((32, 32768), jnp.float32), s((32,), jnp.int32)))
    assert [(c.name, c.grid[0], c.num_warps) for c in calls] == [
        ("indexer_topk_select", first[0], first[1]), ("indexer_topk_select", 32, chunks * 2048 // 1024)]


def test_loop_block_n_keeps_the_sms_busy():
    """Keys per program: the most (power-of-two tiles) that still leave LOOP_PROGRAMS programs."""
    assert indexer_triton.loop_block_n(1, 32768, 128) == 128
    assert indexer_triton.loop_block_n(32, 32768, 128) == 1024
    assert indexer_triton.loop_block_n(128, 32768, 128) == 4096
    assert indexer_triton.loop_block_n(4096, 32768, 128) == 32768
    assert indexer_triton.loop_block_n(32, 96, 32) == 32
