"""Fused norm + RoPE + cache write (docs/math.md §4): every impl against float64 numpy on hand-checked rows; the Pallas
Triton kernel against the xla oracle.

CPU: the kernel in Pallas interpret mode (impl "triton_interpret"), tiny dims (q_lora 48, R 32, Dr 16, Di 32).
GPU (`gpu` marker, GLM_DSA_TEST_GPU=1): native Triton, GLM-5 dims, up to 65536 tokens.

Comparisons (`assert_matches_oracle`): q and bf16 cache rows within 1e-2; rows the oracle did not write
identical bit for bit; FP8 rows: e4m3 codes within 1 ULP, scales equal to the oracle's (on the GPU a scale
may differ by the rounding of its bf16 amax, <= 2^-7 relative, on a small fraction of tiles), k_pe within
1e-2. `assert_fp8_is_reference_quantiser` checks the kernel's quantiser on its own values exactly: the
kernel's FP8 row equals `fp8_formats.quantize_*` applied to the kernel's own bf16 row (same inputs, bf16
cache), scales bit-exact and codes within 1 ULP.
"""

import functools

import ml_dtypes
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from kernels import fp8_formats as f8
from kernels import fused_norm_rope as fnr
from kernels.fused_norm_rope import triton as fnr_triton
from kernels.common.norms import rms_norm
from kernels.common.triton_common import lower_for_gpu, triton_calls

TINY = dict(Rq=48, R=32, Dr=16, Di=32)
GLM5 = dict(Rq=2048, R=512, Dr=64, Di=128)
THETA = 10000.0


def make_inputs(T, *, Rq, R, Dr, Di, fp8, full=True, slots=None, n_slots=None, seed=0, topk=8, cache_shape=None,
                index_slots=None):
    """Random inputs; caches filled with random bytes/values (never zeros: unwritten rows must stay so)."""
    rng = np.random.default_rng(seed)
    bf = jnp.bfloat16
    n_slots = n_slots or max(2 * T, 64)

    def a(*s, scale=1.0):
        return jnp.asarray(rng.standard_normal(size=s, dtype=np.float32) * np.float32(scale), bf)

    mla_w = f8.mla_row_bytes(R, Dr) if fp8 else R + Dr
    idx_w = f8.index_row_bytes(Di) if fp8 else Di
    shape_m = cache_shape(mla_w) if cache_shape else (n_slots, mla_w)
    shape_i = cache_shape(idx_w) if cache_shape else (n_slots, idx_w)
    if fp8:
        mla = jnp.asarray(rng.integers(0, 256, size=shape_m), jnp.uint8)
        idx = jnp.asarray(rng.integers(0, 256, size=shape_i), jnp.uint8)
    else:
        mla, idx = a(*shape_m), a(*shape_i)
    if slots is None:
        slots = rng.permutation(n_slots)[:T].astype(np.int32)
        slots[rng.random(T) < 0.3] = -1  # mixed: some rows write nothing
    kw = dict(q_c=a(T, Rq, scale=3.0), kv_c=a(T, R + Dr, scale=2.0),
              positions=jnp.asarray(rng.integers(0, 100_000, T), jnp.int32),
              slot_mapping=jnp.asarray(slots, jnp.int32), q_norm_w=a(Rq, scale=0.5) + 1, kv_norm_w=a(R, scale=0.5) + 1,
              mla_cache=mla)
    if full:
        kw.update(index_k=a(T, Di, scale=4.0), index_norm_w=a(Di, scale=0.5) + 1, index_norm_b=a(Di, scale=0.1),
                  index_cache=idx, topk_buf=jnp.asarray(rng.integers(0, 50, size=(T, topk)), jnp.int32))
        if index_slots is not None:
            kw["index_slot_mapping"] = jnp.asarray(index_slots, jnp.int32)
    return kw


# CPU: LLVM at -O0 halves the compile time of these small programs (most of the CPU test time).
_FAST_COMPILE = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None


@functools.partial(jax.jit, static_argnames=("impl", "index_rope_interleave", "block_size", "opts"),
                   compiler_options=_FAST_COMPILE)
def run_op(kw, impl, index_rope_interleave=True, block_size=None, opts=()):
    """opts: Triton launch options as a tuple of (name, value) pairs."""
    return fnr.fused_norm_rope_cache(**kw, rope_theta=THETA, index_rope_interleave=index_rope_interleave,
                                     block_size=block_size, impl=impl, **dict(opts))


# ------------------------------------------------------------------------------ comparisons

def _e4m3_order(b):
    """uint8 e4m3 codes -> integers in value order (adjacent values differ by 1)."""
    b = b.astype(np.int32)
    return np.where(b & 0x80, -(b & 0x7F), b & 0x7F)


def _flat(c):
    c = np.asarray(c)
    return c.reshape(-1, c.shape[-1])


def _bf16(x):
    return np.asarray(x).astype(np.float32)


def assert_fp8_rows_close(got, want, n_q, scale_cols, tail, *, exact_scales, label):
    """got/want uint8 [N, bytes]: e4m3 codes in [0, n_q) within 1 ULP, float32 scales at `scale_cols`
    (byte offset, count), then `tail` (k_pe bf16) within 1e-2."""
    assert got.shape == want.shape, (label, got.shape, want.shape)
    if got.shape[0] == 0:  # no row written (every slot -1): nothing to compare
        return
    d = np.abs(_e4m3_order(got[:, :n_q]) - _e4m3_order(want[:, :n_q]))
    assert d.max(initial=0) <= 1, f"{label}: e4m3 codes differ by {d.max()} ULP"
    off, cnt = scale_cols
    sg = np.ascontiguousarray(got[:, off:off + 4 * cnt]).view(np.float32)
    sw = np.ascontiguousarray(want[:, off:off + 4 * cnt]).view(np.float32)
    if exact_scales:
        np.testing.assert_array_equal(sg, sw, err_msg=f"{label}: scales")
    else:
        # GPU oracle: XLA's f32 division is not IEEE there (last-bit differences), and a bf16 amax may round
        # differently (2^-8 relative) on a few tiles.
        np.testing.assert_allclose(sg, sw, rtol=2.0 ** -7, err_msg=f"{label}: scales")
        near = np.abs(sg - sw) <= 2 * np.spacing(np.abs(sw))
        assert np.mean(near) > 0.95, f"{label}: only {np.mean(near):.3f} of the scales within 2 f32 ulp"
    if tail:
        pg = np.ascontiguousarray(got[:, off + 4 * cnt:off + 4 * cnt + tail]).view(ml_dtypes.bfloat16)
        pw = np.ascontiguousarray(want[:, off + 4 * cnt:off + 4 * cnt + tail]).view(ml_dtypes.bfloat16)
        np.testing.assert_allclose(pg.astype(np.float32), pw.astype(np.float32), rtol=1e-2, atol=1e-2,
                                   err_msg=f"{label}: k_pe")


def assert_cache_close(got, want, before, *, R, Dr, Di, kind, exact_scales):
    """Rows the oracle left alone are identical to `before`; written rows match the oracle."""
    got, want, before = _flat(got), _flat(want), _flat(before)
    assert got.shape == want.shape and got.dtype == want.dtype
    untouched = np.all(want == before, axis=-1)
    np.testing.assert_array_equal(got[untouched], before[untouched], err_msg=f"{kind}: an unwritten row changed")
    g, w = got[~untouched], want[~untouched]
    if got.dtype != np.uint8:
        np.testing.assert_allclose(_bf16(g), _bf16(w), rtol=1e-2, atol=1e-2, err_msg=kind)
    elif kind == "mla":
        nt = f8.mla_num_tiles(R)
        assert_fp8_rows_close(g, w, R, (R, nt), 2 * Dr, exact_scales=exact_scales, label="mla")
        pitch_tail = got.shape[-1] - f8.mla_row_bytes(R, Dr)
        if pitch_tail:
            np.testing.assert_array_equal(g[:, -pitch_tail:], w[:, -pitch_tail:])
    else:
        assert_fp8_rows_close(g, w, Di, (Di, 1), 0, exact_scales=exact_scales, label="index")
        pitch_tail = got.shape[-1] - f8.index_row_bytes(Di)
        if pitch_tail:
            np.testing.assert_array_equal(g[:, -pitch_tail:], w[:, -pitch_tail:])


def assert_matches_oracle(kw, out, ref, *, R, Dr, Di, exact_scales):
    """exact_scales: False on the GPU, whose oracle's XLA division is not IEEE (see assert_fp8_rows_close)."""
    q, mla, idx, topk = out
    q_r, mla_r, idx_r, topk_r = ref
    np.testing.assert_allclose(_bf16(q), _bf16(q_r), rtol=1e-2, atol=1e-2, err_msg="q")
    assert_cache_close(mla, mla_r, kw["mla_cache"], R=R, Dr=Dr, Di=Di, kind="mla", exact_scales=exact_scales)
    if kw.get("index_cache") is not None:
        assert_cache_close(idx, idx_r, kw["index_cache"], R=R, Dr=Dr, Di=Di, kind="index",
                           exact_scales=exact_scales)
        np.testing.assert_array_equal(np.asarray(topk), np.asarray(topk_r))
        assert np.all(np.asarray(topk) == -1)
    else:
        assert idx is None and topk is None


def np_quantize_mla_rows(kv, k_pe):
    """numpy (IEEE float32, ml_dtypes RNE) fp8_ds_mla rows; kv [N, R], k_pe [N, Dr] float32."""
    n, r = kv.shape
    tile = f8.mla_tile(r)
    x = kv.astype(np.float32).reshape(n, r // tile, tile)
    scale = np.maximum(np.abs(x).max(-1) / np.float32(448), np.float32(1.1754944e-38)).astype(np.float32)
    q = np.clip(x / scale[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn).reshape(n, r)
    return np.concatenate([q.view(np.uint8), scale.view(np.uint8).reshape(n, -1),
                           k_pe.astype(ml_dtypes.bfloat16).view(np.uint8).reshape(n, -1)], axis=1)


def np_quantize_index_rows(k):
    x = k.astype(np.float32)
    q = np.maximum(np.abs(x).max(-1), np.float32(1e-4)) / np.float32(448)
    s = np.exp2(np.ceil(np.log2(q.astype(np.float64)))).astype(np.float32)
    e = np.clip(x / s[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return np.concatenate([e.view(np.uint8), s.view(np.uint8).reshape(-1, 4)], axis=1)


def assert_fp8_is_reference_quantiser(kw, index_rope_interleave, *, R, Dr, Di, run):
    """The FP8 rows of `run(kw, index_rope_interleave)` = the numpy reference quantiser (IEEE division) on the
    same op's own bf16 rows (bf16 caches, same inputs): scales bit-exact, codes within 1 ULP."""
    kw_bf = dict(kw, mla_cache=jnp.zeros((kw["mla_cache"].shape[0], R + Dr), jnp.bfloat16))
    if kw.get("index_cache") is not None:
        kw_bf["index_cache"] = jnp.zeros((kw["index_cache"].shape[0], Di), jnp.bfloat16)
    _, mla8, idx8, _ = run(kw, index_rope_interleave)
    _, mla16, idx16, _ = run(kw_bf, index_rope_interleave)
    slots = np.asarray(kw["slot_mapping"])
    ok = slots[slots >= 0]
    m16 = _bf16(np.asarray(mla16)[ok])
    want = np_quantize_mla_rows(m16[:, :R], m16[:, R:])
    assert_fp8_rows_close(np.asarray(mla8)[ok], want, R, (R, f8.mla_num_tiles(R)), 2 * Dr, exact_scales=True,
                          label="mla vs quantiser")
    if kw.get("index_cache") is not None:
        islots = np.asarray(kw.get("index_slot_mapping", kw["slot_mapping"]))
        iok = islots[(slots >= 0) & (islots >= 0)]
        want = np_quantize_index_rows(_bf16(np.asarray(idx16)[iok]))
        assert_fp8_rows_close(np.asarray(idx8)[iok], want, Di, (Di, 1), 0, exact_scales=True,
                              label="index vs quantiser")


# ------------------------------------------------------------------------------ every impl, numpy by hand

def _fused_inputs(t, full=True, seed=0):
    rng = np.random.default_rng(seed)
    r, dr, rq, di, n = 32, 16, 24, 32, 64
    f = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32))  # noqa: E731
    args = dict(q_c=f(t, rq), kv_c=f(t, r + dr), positions=jnp.arange(t, dtype=jnp.int32) + 5,
                q_norm_w=f(rq), kv_norm_w=f(r), mla_cache=f(n, r + dr))
    kw = dict(index_k=f(t, di), index_norm_w=f(di), index_norm_b=f(di), index_cache=f(n, di),
              topk_buf=jnp.zeros((t, 8), jnp.int32)) if full else {}
    return args, kw


def _fused(impl, **kw):
    return run_op(kw, impl)


def test_negative_slots_write_nothing_but_q_is_normalised(impl):
    args, kw = _fused_inputs(6)
    slots = jnp.asarray([3, -1, 10, -1, -5, 60], jnp.int32)
    q_n, mla, idx, topk = _fused(impl, **args, slot_mapping=slots, **kw)
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


def test_all_negative_slots_leave_caches_bitwise(impl):
    args, kw = _fused_inputs(4)
    q_n, mla, idx, _ = _fused(impl, **args, slot_mapping=jnp.full((4,), -1, jnp.int32), **kw)
    assert np.array_equal(np.asarray(mla), np.asarray(args["mla_cache"]))
    assert np.array_equal(np.asarray(idx), np.asarray(kw["index_cache"]))
    assert not np.allclose(np.asarray(q_n), np.asarray(args["q_c"]))


def test_separate_indexer_slots_and_shared_layer(impl):
    args, kw = _fused_inputs(3)
    slots = jnp.asarray([1, 2, -1], jnp.int32)
    islots = jnp.asarray([40, 41, 42], jnp.int32)
    _, _, idx, _ = _fused(impl, **args, slot_mapping=slots, index_slot_mapping=islots, **kw)
    changed = np.where(np.any(np.asarray(idx) != np.asarray(kw["index_cache"]), axis=1))[0]
    assert changed.tolist() == [40, 41]  # the MLA slot's -1 still suppresses the indexer write
    args, _ = _fused_inputs(3, full=False)
    q_n, mla, idx, topk = _fused(impl, **args, slot_mapping=slots)
    assert idx is None and topk is None


# ------------------------------------------------------------------------------ the kernel against the xla oracle

GRID = ([(t, dt, True, il) for t in (1, 4, 17, 512) for dt in ("bfloat16", "fp8_ds_mla") for il in (True, False)]
        + [(t, dt, False, True) for t in (1, 4, 17, 512) for dt in ("bfloat16", "fp8_ds_mla")])


@pytest.mark.parametrize("T,cache_dtype,full,index_rope_interleave", GRID)
def test_triton_matches_oracle(kernel_impl, on_gpu, T, cache_dtype, full, index_rope_interleave):
    kw = make_inputs(T, **TINY, fp8=cache_dtype == "fp8_ds_mla", full=full, seed=T)
    ref = run_op(kw, "xla", index_rope_interleave)
    out = run_op(kw, kernel_impl, index_rope_interleave)
    assert_matches_oracle(kw, out, ref, **{k: TINY[k] for k in ("R", "Dr", "Di")}, exact_scales=not on_gpu)


def test_yarn_frequencies_reach_the_kernel(kernel_impl, on_gpu):
    """A YaRN rope (DeepSeek-V3.2) through `rope_theta`: the kernel rotates by the blended frequencies as the
    oracle does, and by different angles than the plain base would (so the blend is not dropped on the way)."""
    from kernels.common.rope import YarnRope
    yarn = YarnRope(theta=THETA, factor=40.0, original_max_position_embeddings=64)
    kw = make_inputs(17, **TINY, fp8=False, seed=5)
    kw["positions"] = kw["positions"] * 97  # long positions: the interpolated frequencies matter there
    run = jax.jit(lambda kw, impl, theta: fnr.fused_norm_rope_cache(**kw, rope_theta=theta, impl=impl),
                  static_argnames=("impl", "theta"))
    ref = run(kw, "xla", yarn)
    assert_matches_oracle(kw, run(kw, kernel_impl, yarn), ref, R=32, Dr=16, Di=32, exact_scales=not on_gpu)
    plain = run(kw, "xla", THETA)
    assert not np.allclose(np.asarray(plain[1]), np.asarray(ref[1]), atol=1e-3)


@pytest.mark.parametrize("T,fp8,il,opts", [
    (23, True, True, (("q_rows", 4), ("cache_rows", 2))),
    (40, False, True, (("q_rows", 1), ("cache_rows", 8), ("num_warps", 2))),
    (23, True, False, (("q_rows", 2), ("cache_rows", 4), ("layout", "interleave"))),
    (21, False, True, (("q_rows", 1), ("cache_rows", 2), ("layout", "interleave"))),
    (19, False, True, (("q_rows", 4), ("cache_rows", 1), ("layout", "fused"))),
    (19, True, True, (("q_rows", 4), ("cache_rows", 2), ("layout", "fused"))),
    (22, False, False, (("q_rows", 2), ("cache_rows", 8), ("layout", "fused"))),
    (23, False, True, (("q_rows", 2), ("cache_rows", 1), ("layout", "two_launch"), ("q_warps", 8))),
    (23, True, True, (("q_rows", 2), ("cache_rows", 2), ("layout", "two_launch"), ("q_warps", 8))),
    # persistent programs: 3 q programs over 12 blocks, 5 cache programs over 6 blocks (one loops past the end)
    (23, True, True, (("q_rows", 2), ("cache_rows", 4), ("q_programs", 3), ("cache_programs", 5),
                      ("num_stages", 2))),
    (32, False, True, (("q_rows", 4), ("cache_rows", 2), ("q_programs", 4), ("cache_programs", 16),
                       ("layout", "interleave"))),
    (17, True, True, (("q_rows", 1), ("cache_rows", 2), ("q_programs", 4), ("cache_programs", 3),
                      ("layout", "fused"))),
    (24, False, True, (("q_rows", 2), ("cache_rows", 2), ("q_programs", 4), ("layout", "two_launch"))),
    # fused with both parts on every program: all loads of a step first (one step, then a loop of 5 steps)
    (20, True, False, (("q_rows", 2), ("cache_rows", 2), ("layout", "fused"))),
    (17, False, True, (("q_rows", 1), ("cache_rows", 1), ("q_programs", 4), ("cache_programs", 4),
                       ("layout", "fused"), ("num_stages", 2))),
])
def test_uneven_row_blocks(kernel_impl, on_gpu, T, fp8, il, opts):
    """Every layout (split, interleave, fused, two_launch), q and cache blocks of different row counts not
    dividing T, and persistent programs (some looping over blocks past T), against the oracle."""
    kw = make_inputs(T, **TINY, fp8=fp8, seed=T + 100)
    assert_matches_oracle(kw, run_op(kw, kernel_impl, il, None, opts), run_op(kw, "xla", il), R=32, Dr=16, Di=32,
                          exact_scales=not on_gpu)


@pytest.mark.parametrize("layout", ["split", "fused", "two_launch"])
def test_fp8_caches_refuse_one_row_cache_blocks(kernel_impl, layout):
    """1-row cache blocks with FP8 caches crashed Triton's compiler on the H200 (a segfault that kills the process):
    the kernel refuses them by name, and the default config at every T gives FP8 caches 2-row cache blocks."""
    kw = make_inputs(5, **TINY, fp8=True, seed=9)
    with pytest.raises(ValueError, match="cache_rows 1 with an FP8 cache.*cache_rows >= 2"):
        run_op(kw, kernel_impl, True, None, (("q_rows", 1), ("cache_rows", 1), ("layout", layout)))
    for T in (1, 64, 255, 256, 4096, 16384, 65536):
        assert fnr_triton.default_config(T, fp8=True).cache_rows >= fnr_triton.FP8_MIN_CACHE_ROWS, T


def test_fp8_rows_are_the_reference_quantiser(kernel_impl):
    kw = make_inputs(17, **TINY, fp8=True, seed=3)
    for il in (True, False):
        assert_fp8_is_reference_quantiser(kw, il, R=32, Dr=16, Di=32, run=lambda k, i: run_op(k, kernel_impl, i))


def test_oracle_fp8_rows_are_the_reference_quantiser(on_gpu):
    """The oracle's uint8 path is the reference quantiser applied to its own bf16 path (exact on CPU)."""
    if on_gpu:
        pytest.skip("the GPU oracle's XLA division is not IEEE: exact on CPU only")
    kw = make_inputs(9, **TINY, fp8=True, seed=4)
    assert_fp8_is_reference_quantiser(kw, True, R=32, Dr=16, Di=32, run=lambda k, il: run_op(k, "xla", il))


def test_mixed_slots_and_separate_index_slots(kernel_impl, on_gpu):
    """Index slots of their own (defaulting to the MLA slots), -1 in either, slots past the cache dropped,
    and a row whose MLA slot is -1 writes no index row even when its index slot is valid."""
    T, n = 24, 40
    rng = np.random.default_rng(7)
    slots = rng.permutation(n)[:T].astype(np.int32)
    islots = rng.permutation(n)[:T].astype(np.int32)
    slots[[0, 5, 9]] = -1
    islots[[1, 5, 11]] = -1
    slots[13] = n + 3  # past the end of the cache: dropped
    for fp8 in (False, True):
        kw = make_inputs(T, **TINY, fp8=fp8, slots=slots, index_slots=islots, n_slots=n, seed=8)
        ref, out = run_op(kw, "xla"), run_op(kw, kernel_impl)
        assert_matches_oracle(kw, out, ref, R=32, Dr=16, Di=32, exact_scales=not on_gpu)
        idx_before = _flat(kw["index_cache"])
        assert np.array_equal(_flat(out[2])[islots[0]], idx_before[islots[0]])  # MLA slot -1: no index write
        assert not np.array_equal(_flat(out[2])[islots[2]], idx_before[islots[2]])


@pytest.mark.parametrize("fp8", [False, True])
def test_padded_page_stride(kernel_impl, on_gpu, fp8):
    """Caches [pages, page_rows, pitch] with page_rows > block_size and pitch > row width: slot =
    page * block_size + offset; padding rows and columns untouched."""
    bs, pages, T = 4, 10, 19
    rng = np.random.default_rng(11)
    slots = rng.permutation(pages * bs)[:T].astype(np.int32)
    slots[3] = -1
    kw = make_inputs(T, **TINY, fp8=fp8, slots=slots, seed=12, cache_shape=lambda w: (pages, bs + 3, w + 24))
    ref = run_op(kw, "xla", True, bs)
    out = run_op(kw, kernel_impl, True, bs)
    assert out[1].shape == kw["mla_cache"].shape and out[2].shape == kw["index_cache"].shape
    assert_matches_oracle(kw, out, ref, R=32, Dr=16, Di=32, exact_scales=not on_gpu)
    for got, before in ((out[1], kw["mla_cache"]), (out[2], kw["index_cache"])):
        got, before = np.asarray(got), np.asarray(before)
        np.testing.assert_array_equal(got[:, bs:], before[:, bs:])  # padded page rows
    # written rows land at page * (bs + 3) + offset
    s = slots[0]
    assert not np.array_equal(np.asarray(out[1])[s // bs, s % bs], np.asarray(kw["mla_cache"])[s // bs, s % bs])


def check_all_negative_slots(op, *, fp8, full=True, T=6):
    """docs/math.md §4 with every slot -1: q = rms_norm(q_c); both caches unchanged bit for bit; top-k all -1."""
    kw = make_inputs(T, **TINY, fp8=fp8, full=full, slots=np.full(T, -1, np.int32), seed=21)
    q, mla, idx, topk = op(kw)
    want = rms_norm(kw["q_c"], kw["q_norm_w"], fnr.QKV_NORM_EPS)
    np.testing.assert_allclose(_bf16(q), _bf16(want), rtol=1e-2, atol=1e-2,
                               err_msg="q must be normalised whatever the slot")
    np.testing.assert_array_equal(np.asarray(mla), np.asarray(kw["mla_cache"]))
    if full:
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(kw["index_cache"]))
        assert np.all(np.asarray(topk) == -1)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("full", [True, False])
def test_all_negative_slots(impl, fp8, full):
    check_all_negative_slots(lambda kw: run_op(kw, impl), fp8=fp8, full=full)


def test_negative_slot_check_catches_skipped_q_norm(kernel_impl, monkeypatch):
    """The DCP bug (q norm skipped where slot < 0), patched into the kernel, fails the check above."""
    monkeypatch.setattr(fnr_triton, "_q_rows_to_write", lambda in_range, slot_ok_fn: in_range & slot_ok_fn())
    jax.clear_caches()
    try:
        with pytest.raises(AssertionError, match="normalised whatever the slot"):
            check_all_negative_slots(lambda kw: fnr.fused_norm_rope_cache(
                **kw, rope_theta=THETA, impl=kernel_impl, q_rows=2), fp8=False)
    finally:
        jax.clear_caches()


def test_shared_layer_leaves_topk_and_index_alone(kernel_impl):
    kw = make_inputs(5, **TINY, fp8=False, full=True, seed=30)
    topk = kw["topk_buf"]
    kw_shared = dict(kw, index_k=None, index_cache=None)
    out = fnr.fused_norm_rope_cache(**kw_shared, rope_theta=THETA, impl=kernel_impl)
    assert out[2] is None and np.array_equal(np.asarray(out[3]), np.asarray(topk))


def test_donated_caches_update_in_place(kernel_impl, on_gpu):
    """Under jit with donated caches the kernel writes into the caller's buffers (no cache copy)."""
    kw = make_inputs(8, **TINY, fp8=True, seed=31)

    @functools.partial(jax.jit, donate_argnums=(1, 2), compiler_options=_FAST_COMPILE)
    def step(kw, mla, idx):
        return fnr.fused_norm_rope_cache(**dict(kw, mla_cache=mla, index_cache=idx), rope_theta=THETA,
                                         impl=kernel_impl)

    rest = {k: v for k, v in kw.items() if k not in ("mla_cache", "index_cache")}
    hlo = step.lower(rest, kw["mla_cache"], kw["index_cache"]).compile().as_text()
    assert "input_output_alias" in hlo
    ref = run_op(kw, "xla")
    out = step(rest, jnp.array(kw["mla_cache"]), jnp.array(kw["index_cache"]))
    assert_matches_oracle(kw, out, ref, R=32, Dr=16, Di=32, exact_scales=not on_gpu)


def test_config_and_shapes_are_validated(kernel_impl):
    C = fnr_triton.FusedNormRopeConfig
    for bad in (0, 3):  # rows per program are tile rows: powers of two (Triton rejects a [3] tile natively)
        with pytest.raises(ValueError, match=f"q_rows {bad} must be a power of two"):
            C(q_rows=bad, cache_rows=1, num_warps=4)
    with pytest.raises(ValueError, match="layout 'loop' must be one of"):
        C(1, 1, 4, layout="loop")
    with pytest.raises(ValueError, match="q_programs -1 must be an int >= 0"):
        C(1, 1, 4, q_programs=-1)
    with pytest.raises(ValueError, match="q_warps is the q launch's warps of layout 'two_launch'"):
        C(1, 1, 4, q_warps=8)
    with pytest.raises(ValueError, match="q_warps 3 must be 0 or a power of two"):
        C(1, 1, 4, layout="two_launch", q_warps=3)
    kw = make_inputs(4, **TINY, fp8=False, seed=2)
    with pytest.raises(ValueError, match=r"unknown options \['mode'\]"):
        fnr.fused_norm_rope_cache(**kw, rope_theta=THETA, impl=kernel_impl, mode="loop")
    bad = dict(kw, kv_c=kw["kv_c"][:, :-4])  # rope dim 12: not 2 x a power of two
    with pytest.raises(ValueError, match="fused_norm_rope: impl .* does not support.*rope dim 12"):
        fnr.fused_norm_rope_cache(**bad, rope_theta=THETA, impl=kernel_impl)
    with pytest.raises(ValueError, match="MLA cache pitch 40 < its row width 48"):
        fnr.fused_norm_rope_cache(**dict(kw, mla_cache=kw["mla_cache"][:, :40]), rope_theta=THETA, impl=kernel_impl)
    paged = dict(kw, mla_cache=kw["mla_cache"].reshape(8, 8, -1), index_cache=kw["index_cache"].reshape(8, 8, -1))
    with pytest.raises(ValueError, match="block_size 9 must be in \\[1, page_rows = 8\\]"):
        fnr.fused_norm_rope_cache(**paged, rope_theta=THETA, impl=kernel_impl, block_size=9)


def test_lowers_to_triton_at_glm5_dims():
    """One launch at GLM-5 dims (T = 4096, FP8 caches): 2-row q and cache blocks, grid 2048 + 2048."""
    s = jax.ShapeDtypeStruct
    T, R, Dr, Di = 4096, 512, 64, 128

    def f(q_c, kv_c, pos, slots, qw, kvw, mla, ik, iw, ib, icache, topk):
        return fnr_triton.fused_norm_rope_cache_triton(q_c, kv_c, pos, slots, qw, kvw, mla, rope_theta=THETA,
                                                       index_k=ik, index_norm_w=iw, index_norm_b=ib,
                                                       index_cache=icache, topk_buf=topk)

    bf = jnp.bfloat16
    calls = triton_calls(lower_for_gpu(
        f, s((T, 2048), bf), s((T, R + Dr), bf), s((T,), jnp.int32), s((T,), jnp.int32), s((2048,), bf),
        s((R,), bf), s((1 << 16, f8.mla_row_bytes(R, Dr)), jnp.uint8), s((T, Di), bf), s((Di,), bf), s((Di,), bf),
        s((1 << 16, f8.index_row_bytes(Di)), jnp.uint8), s((T, 2048), jnp.int32)))
    cfg = fnr_triton.default_config(T)
    assert (cfg.q_rows, cfg.cache_rows) == (2, 2)
    assert [(c.name, c.grid, c.num_warps) for c in calls] == [("fused_norm_rope_cache", (4096, 1, 1), 4)]


@pytest.mark.parametrize("cfg", [
    fnr_triton.FusedNormRopeConfig(1, 1, 4),
    fnr_triton.FusedNormRopeConfig(4, 1, 8, q_programs=3, num_stages=2),
])
def test_q_norm_alone_is_rms_norm(interpret, on_gpu, cfg):
    """`q_norm_triton` (the q part as its own launch, for benchmarks and layout two_launch) against float64
    numpy RMSNorm rounded to bf16."""
    rng = np.random.default_rng(41)
    T, Rq = 13, 48  # 48: not a power of two (column mask); 13 rows: partial blocks
    x = jnp.asarray(rng.standard_normal((T, Rq), np.float32) * 3, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(Rq, np.float32) * 0.5 + 1, jnp.bfloat16)
    got = fnr_triton.q_norm_triton(x, w, eps=fnr.QKV_NORM_EPS, config=cfg, interpret=interpret)
    xf = np.asarray(x, np.float64)
    want = xf / np.sqrt((xf ** 2).mean(-1, keepdims=True) + fnr.QKV_NORM_EPS) * np.asarray(w, np.float64)
    np.testing.assert_allclose(_bf16(got), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("Di", [16, 40])
def test_index_key_without_or_with_masked_pass_through(kernel_impl, on_gpu, Di):
    """Indexer key widths Di = Dr (no pass-through columns) and Di - Dr = 24 (not a power of two: masked)."""
    dims = dict(TINY, Di=Di)
    for fp8 in (False, True):
        kw = make_inputs(11, **dims, fp8=fp8, seed=Di)
        for il in (True, False):
            assert_matches_oracle(kw, run_op(kw, kernel_impl, il), run_op(kw, "xla", il), R=32, Dr=16, Di=Di,
                                  exact_scales=not on_gpu)


@pytest.mark.parametrize("layout", ["split", "interleave", "fused", "two_launch"])
def test_layouts_lower_to_triton_at_glm5_dims(layout):
    """Each layout lowers to Triton IR at GLM-5 dims (T = 65536, FP8 caches, persistent q programs) with the
    grids its schedule says: split q + cache programs, interleave groups of k q + 1 cache, fused max of both,
    two_launch a q launch then a cache launch."""
    s = jax.ShapeDtypeStruct
    T, R, Dr, Di = 65536, 512, 64, 128
    cfg = fnr_triton.FusedNormRopeConfig(2, 2, 4, num_stages=3, layout=layout, q_programs=1056,
                                         q_warps=8 if layout == "two_launch" else 0)

    def f(q_c, kv_c, pos, slots, qw, kvw, mla, ik, iw, ib, icache):
        return fnr_triton.fused_norm_rope_cache_triton(q_c, kv_c, pos, slots, qw, kvw, mla, rope_theta=THETA,
                                                       index_k=ik, index_norm_w=iw, index_norm_b=ib,
                                                       index_cache=icache, config=cfg)

    bf = jnp.bfloat16
    calls = triton_calls(lower_for_gpu(
        f, s((T, 2048), bf), s((T, R + Dr), bf), s((T,), jnp.int32), s((T,), jnp.int32), s((2048,), bf),
        s((R,), bf), s((1 << 17, f8.mla_row_bytes(R, Dr)), jnp.uint8), s((T, Di), bf), s((Di,), bf), s((Di,), bf),
        s((1 << 17, f8.index_row_bytes(Di)), jnp.uint8)))
    want = {"split": [(1056 + 32768, 4)], "fused": [(32768, 4)],
            "interleave": [((1 + 1) * 32768, 4)],  # k = 1056 // 32768 -> 1: groups of one q and one cache program
            "two_launch": [(1056, 8), (32768, 4)]}[layout]
    assert [(c.grid[0], c.num_warps) for c in calls] == want
    assert all(c.num_stages == 3 for c in calls)


# ------------------------------------------------------------------------------ GPU (native Triton)

@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 17, 512, 4096, 65536])
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "fp8_ds_mla"])
def test_gpu_triton_matches_oracle(kernel_impl, T, cache_dtype):
    fp8 = cache_dtype == "fp8_ds_mla"
    variants = ((True, True), (True, False), (False, True)) if T <= 4096 else ((True, not fp8),)
    for full, il in variants:
        kw = make_inputs(T, **GLM5, fp8=fp8, full=full, seed=T + full + 2 * il, topk=64)
        ref = run_op(kw, "xla", il)
        out = run_op(kw, kernel_impl, il)
        assert_matches_oracle(kw, out, ref, R=512, Dr=64, Di=128, exact_scales=False)
        if fp8 and full and T <= 4096:
            assert_fp8_is_reference_quantiser(kw, il, R=512, Dr=64, Di=128,
                                              run=lambda k, i: run_op(k, kernel_impl, i))


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [
    (("q_rows", 1), ("cache_rows", 1), ("num_warps", 2)),
    (("q_rows", 2), ("cache_rows", 2), ("num_warps", 4)),
    (("q_rows", 4), ("cache_rows", 1), ("num_warps", 4)),
    (("q_rows", 1), ("cache_rows", 2), ("num_warps", 4), ("layout", "interleave")),
    (("q_rows", 2), ("cache_rows", 2), ("num_warps", 4), ("layout", "fused")),
    (("q_rows", 2), ("cache_rows", 1), ("num_warps", 2), ("layout", "two_launch"), ("q_warps", 8),
     ("q_programs", 1056), ("num_stages", 3)),
    (("q_rows", 4), ("cache_rows", 2), ("num_warps", 4), ("layout", "interleave"), ("q_programs", 528),
     ("cache_programs", 528), ("num_stages", 3)),
])
def test_gpu_launch_variants(kernel_impl, opts):
    for fp8 in (False, True):
        kw = make_inputs(4097, **GLM5, fp8=fp8, seed=77, topk=64)
        if fp8 and dict(opts)["cache_rows"] < fnr_triton.FP8_MIN_CACHE_ROWS:  # refused: it segfaulted Triton
            with pytest.raises(ValueError, match="cache_rows 1 with an FP8 cache"):
                run_op(kw, kernel_impl, fp8, None, opts)
            continue
        assert_matches_oracle(kw, run_op(kw, kernel_impl, fp8, None, opts), run_op(kw, "xla", fp8),
                              R=512, Dr=64, Di=128, exact_scales=False)


@pytest.mark.gpu
def test_gpu_all_negative_and_padded(kernel_impl):
    for fp8 in (False, True):
        check_all_negative_slots(lambda kw: run_op(kw, kernel_impl), fp8=fp8, T=300)
        kw = make_inputs(100, **GLM5, fp8=fp8, seed=5, slots=np.arange(100, dtype=np.int32) * 3 - 7,
                         cache_shape=lambda w: (50, 16 + 4, w + 64))
        assert_matches_oracle(kw, run_op(kw, kernel_impl, True, 16), run_op(kw, "xla", True, 16),
                              R=512, Dr=64, Di=128, exact_scales=False)
