"""Fused norm + RoPE + cache write (SPEC §4): the Pallas Triton kernel against the xla oracle.

CPU: the kernel in Pallas interpret mode, tiny dims (q_lora 48, R 32, Dr 16, Di 32). GPU (`gpu` marker,
GLM_DSA_TEST_GPU=1): native Triton, GLM-5 dims, up to 65536 tokens.

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
from kernels import fused_norm_rope_triton as fnr_triton
from kernels.norms import rms_norm

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


def run_triton(kw, index_rope_interleave=True, block_size=None):
    # interpret mode off the GPU (the dispatcher picks it from the backend)
    return run_op(kw, "triton", index_rope_interleave, block_size)


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


EXACT_SCALES = jax.default_backend() == "cpu"  # the GPU oracle's XLA division is not IEEE (see below)


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


def assert_matches_oracle(kw, out, ref, *, R, Dr, Di, exact_scales=EXACT_SCALES):
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


def assert_fp8_is_reference_quantiser(kw, index_rope_interleave, *, R, Dr, Di, run=run_triton):
    """The kernel's FP8 rows = the numpy reference quantiser (IEEE division) on the kernel's own bf16 rows
    (bf16 caches, same inputs): scales bit-exact, codes within 1 ULP."""
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


# ------------------------------------------------------------------------------ CPU (interpret mode)

GRID = ([(t, dt, True, il) for t in (1, 4, 17, 512) for dt in ("bfloat16", "fp8_ds_mla") for il in (True, False)]
        + [(t, dt, False, True) for t in (1, 4, 17, 512) for dt in ("bfloat16", "fp8_ds_mla")])


@pytest.mark.parametrize("T,cache_dtype,full,index_rope_interleave", GRID)
def test_triton_matches_oracle(T, cache_dtype, full, index_rope_interleave):
    kw = make_inputs(T, **TINY, fp8=cache_dtype == "fp8_ds_mla", full=full, seed=T)
    ref = run_op(kw, "xla", index_rope_interleave)
    out = run_triton(kw, index_rope_interleave)
    assert_matches_oracle(kw, out, ref, **{k: TINY[k] for k in ("R", "Dr", "Di")})


@pytest.mark.parametrize("T,fp8,il,opts", [
    (17, True, False, (("mode", "loop"), ("programs_per_sm", 3), ("rows_per_program", 2))),
    (40, False, True, (("mode", "loop"), ("programs_per_sm", 4), ("rows_per_program", 1))),
    (23, True, True, (("mode", "split"), ("q_rows", 4), ("cache_rows", 2))),
])
def test_launch_modes(T, fp8, il, opts):
    """The "loop" mode (programs walking several blocks) and uneven split blocks against the oracle."""
    kw = make_inputs(T, **TINY, fp8=fp8, seed=T + 100)
    assert_matches_oracle(kw, run_op(kw, "triton", il, None, opts), run_op(kw, "xla", il), R=32, Dr=16, Di=32)


def test_fp8_rows_are_the_reference_quantiser():
    kw = make_inputs(17, **TINY, fp8=True, seed=3)
    for il in (True, False):
        assert_fp8_is_reference_quantiser(kw, il, R=32, Dr=16, Di=32)


def test_oracle_fp8_rows_are_the_reference_quantiser():
    """The oracle's uint8 path is the reference quantiser applied to its own bf16 path (exact on CPU)."""
    kw = make_inputs(9, **TINY, fp8=True, seed=4)
    assert_fp8_is_reference_quantiser(kw, True, R=32, Dr=16, Di=32, run=lambda k, il: run_op(k, "xla", il))


def test_mixed_slots_and_separate_index_slots():
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
        ref, out = run_op(kw, "xla"), run_triton(kw)
        assert_matches_oracle(kw, out, ref, R=32, Dr=16, Di=32)
        idx_before = _flat(kw["index_cache"])
        assert np.array_equal(_flat(out[2])[islots[0]], idx_before[islots[0]])  # MLA slot -1: no index write
        assert not np.array_equal(_flat(out[2])[islots[2]], idx_before[islots[2]])


@pytest.mark.parametrize("fp8", [False, True])
def test_padded_page_stride(fp8):
    """Caches [pages, page_rows, pitch] with page_rows > block_size and pitch > row width: slot =
    page * block_size + offset; padding rows and columns untouched."""
    bs, pages, T = 4, 10, 19
    rng = np.random.default_rng(11)
    slots = rng.permutation(pages * bs)[:T].astype(np.int32)
    slots[3] = -1
    kw = make_inputs(T, **TINY, fp8=fp8, slots=slots, seed=12, cache_shape=lambda w: (pages, bs + 3, w + 24))
    ref = run_op(kw, "xla", True, bs)
    out = run_triton(kw, True, bs)
    assert out[1].shape == kw["mla_cache"].shape and out[2].shape == kw["index_cache"].shape
    assert_matches_oracle(kw, out, ref, R=32, Dr=16, Di=32)
    for got, before in ((out[1], kw["mla_cache"]), (out[2], kw["index_cache"])):
        got, before = np.asarray(got), np.asarray(before)
        np.testing.assert_array_equal(got[:, bs:], before[:, bs:])  # padded page rows
    # written rows land at page * (bs + 3) + offset
    s = slots[0]
    assert not np.array_equal(np.asarray(out[1])[s // bs, s % bs], np.asarray(kw["mla_cache"])[s // bs, s % bs])


def check_all_negative_slots(op, *, fp8, full=True, T=6):
    """SPEC §4 with every slot -1: q = rms_norm(q_c); both caches unchanged bit for bit; top-k all -1."""
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
def test_all_negative_slots(fp8, full):
    check_all_negative_slots(lambda kw: run_op(kw, "xla"), fp8=fp8, full=full)
    check_all_negative_slots(run_triton, fp8=fp8, full=full)


def test_negative_slot_check_catches_skipped_q_norm(monkeypatch):
    """The DCP bug (q norm skipped where slot < 0), patched into the kernel, fails the check above."""
    monkeypatch.setattr(fnr_triton, "_q_rows_to_write", lambda in_range, slot_ok_fn: in_range & slot_ok_fn())
    jax.clear_caches()
    try:
        with pytest.raises(AssertionError, match="normalised whatever the slot"):
            check_all_negative_slots(lambda kw: fnr.fused_norm_rope_cache(
                **kw, rope_theta=THETA, impl="triton", q_rows=2), fp8=False)
    finally:
        jax.clear_caches()


def test_shared_layer_leaves_topk_and_index_alone():
    kw = make_inputs(5, **TINY, fp8=False, full=True, seed=30)
    topk = kw["topk_buf"]
    kw_shared = dict(kw, index_k=None, index_cache=None)
    out = fnr.fused_norm_rope_cache(**kw_shared, rope_theta=THETA, impl="triton")
    assert out[2] is None and np.array_equal(np.asarray(out[3]), np.asarray(topk))


def test_donated_caches_update_in_place():
    """Under jit with donated caches the kernel writes into the caller's buffers (no cache copy)."""
    kw = make_inputs(8, **TINY, fp8=True, seed=31)

    @functools.partial(jax.jit, donate_argnums=(1, 2), compiler_options=_FAST_COMPILE)
    def step(kw, mla, idx):
        return fnr.fused_norm_rope_cache(**dict(kw, mla_cache=mla, index_cache=idx), rope_theta=THETA,
                                         impl="triton")

    rest = {k: v for k, v in kw.items() if k not in ("mla_cache", "index_cache")}
    hlo = step.lower(rest, kw["mla_cache"], kw["index_cache"]).compile().as_text()
    assert "input_output_alias" in hlo
    ref = run_op(kw, "xla")
    out = step(rest, jnp.array(kw["mla_cache"]), jnp.array(kw["index_cache"]))
    assert_matches_oracle(kw, out, ref, R=32, Dr=16, Di=32)


# ------------------------------------------------------------------------------ GPU (native Triton)

@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 17, 512, 4096, 65536])
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "fp8_ds_mla"])
def test_gpu_triton_matches_oracle(T, cache_dtype):
    fp8 = cache_dtype == "fp8_ds_mla"
    variants = ((True, True), (True, False), (False, True)) if T <= 4096 else ((True, not fp8),)
    for full, il in variants:
        kw = make_inputs(T, **GLM5, fp8=fp8, full=full, seed=T + full + 2 * il, topk=64)
        ref = run_op(kw, "xla", il)
        out = run_op(kw, "triton", il)
        assert_matches_oracle(kw, out, ref, R=512, Dr=64, Di=128)
        if fp8 and full and T <= 4096:
            assert_fp8_is_reference_quantiser(kw, il, R=512, Dr=64, Di=128,
                                              run=lambda k, i: run_op(k, "triton", i))


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [
    (("mode", "split"), ("q_rows", 1), ("cache_rows", 1), ("num_warps", 2)),
    (("mode", "split"), ("q_rows", 2), ("cache_rows", 2), ("num_warps", 4)),
    (("mode", "loop"), ("rows_per_program", 1), ("programs_per_sm", 16), ("num_warps", 2)),
    (("mode", "loop"), ("rows_per_program", 2), ("programs_per_sm", 8), ("num_warps", 4)),
    (("mode", "loop"), ("rows_per_program", 4), ("programs_per_sm", 4), ("num_warps", 4)),
])
def test_gpu_launch_variants(opts):
    for fp8 in (False, True):
        kw = make_inputs(4097, **GLM5, fp8=fp8, seed=77, topk=64)
        assert_matches_oracle(kw, run_op(kw, "triton", fp8, None, opts), run_op(kw, "xla", fp8),
                              R=512, Dr=64, Di=128)


@pytest.mark.gpu
def test_gpu_all_negative_and_padded():
    for fp8 in (False, True):
        check_all_negative_slots(lambda kw: run_op(kw, "triton"), fp8=fp8, T=300)
        kw = make_inputs(100, **GLM5, fp8=fp8, seed=5, slots=np.arange(100, dtype=np.int32) * 3 - 7,
                         cache_shape=lambda w: (50, 16 + 4, w + 64))
        assert_matches_oracle(kw, run_op(kw, "triton", True, 16), run_op(kw, "xla", True, 16),
                              R=512, Dr=64, Di=128)
