"""FP8 block-scaled linear layers (kernels/fp8_linear/): both forms, every impl, against a float64 numpy oracle of
the same quantised arithmetic (the e4m3 bytes times their block scales; W8A8 also quantises x per token per
128-column block in numpy float32), ragged 128-blocks, TP shards that start mid-block (static and traced offsets),
the errors, and the Triton lowering at GLM-5.2 shapes."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints.fp8_blocks import quantize_blocks
from kernels import fp8_formats, fp8_linear
from kernels.fp8_linear import triton as fp8_linear_triton
from kernels.common.triton_common import lower_for_gpu, triton_calls

E4M3 = ml_dtypes.float8_e4m3fn


def _oracle(x, w_q, w_scale, form, n_offset=0, k_offset=0):
    """float64 y = x @ W^T with W[n, k] = q[n, k] * s[(n_offset + n) // 128, (k_offset + k) // 128]; W8A8: x
    replaced by e4m3(x / s_a) * s_a, s_a = max(amax / 448, FLT_MIN) per row over each weight K-block (float32)."""
    n, k = w_q.shape
    rb, kb = (n_offset + np.arange(n)) // 128, (k_offset + np.arange(k)) // 128
    s = np.asarray(w_scale, np.float64)
    w = np.asarray(w_q, np.float64) * s[rb][:, kb]
    x32 = np.asarray(jnp.asarray(x, jnp.float32))
    if form == "w8a8":
        amax = np.zeros((x32.shape[0], s.shape[1]), np.float32)
        for g in np.unique(kb):
            amax[:, g] = np.abs(x32[:, kb == g]).max(axis=1)
        s_a = np.maximum(amax / np.float32(448), np.float32(1.1754944e-38)).astype(np.float32)
        a_q = np.clip(x32 / s_a[:, kb], -448, 448).astype(E4M3)
        x64 = a_q.astype(np.float64) * s_a[:, kb]
    else:
        x64 = x32.astype(np.float64)
    return x64 @ w.T


def _shard(n, k, n_offset, k_offset, seed):
    """The local slice [n_offset:, k_offset:] of a block-quantised weight larger than it (rows scaled unevenly so
    the blocks' scales differ), and the sub-grid of scales covering it (the grid starts at block 0, so the
    offsets are the slice's positions inside its first block)."""
    rng = np.random.default_rng(seed)
    big = rng.normal(size=(n_offset + n + 3, k_offset + k + 5)) * rng.uniform(0.05, 4.0, size=(n_offset + n + 3, 1))
    q, s = fp8_formats.quantize_weight_blocks(big)
    nb, kb = fp8_formats.block_count(n, n_offset), fp8_formats.block_count(k, k_offset)
    return q[n_offset:n_offset + n, k_offset:k_offset + k], s[:nb, :kb]


def _rel(a, b):
    return np.linalg.norm(np.asarray(jnp.asarray(a, jnp.float32), np.float64) - b) / np.linalg.norm(b)


CASES = [  # t, n, k, n_offset, k_offset
    (5, 200, 300, 0, 0),       # ragged edge blocks on both axes
    (16, 256, 256, 0, 0),      # whole blocks: the unmasked block loads
    (3, 100, 150, 70, 90),     # a TP shard starting mid-block on both axes
    (200, 256, 1024, 0, 0),    # the decode-step tiles (64 < t <= 256): ragged 128-row blocks, K split 8 ways
]


@pytest.mark.parametrize("form", fp8_linear.FORMS)
@pytest.mark.parametrize("t,n,k,n_off,k_off", CASES)
def test_matches_float64_oracle(impl, form, t, n, k, n_off, k_off):
    """float32 rows: every impl within float32 rounding of the oracle (a wrong block index or scale is O(1))."""
    w_q, w_s = _shard(n, k, n_off, k_off, seed=n + k)
    x = jnp.asarray(np.random.default_rng(t).normal(size=(t, k)), jnp.float32)
    y = fp8_linear.fp8_linear(x, w_q, w_s, form=form, impl=impl, n_offset=n_off, k_offset=k_off)
    assert y.shape == (t, n) and y.dtype == jnp.float32
    assert _rel(y, _oracle(x, w_q, w_s, form, n_off, k_off)) < 2e-6


@pytest.mark.parametrize("form", fp8_linear.FORMS)
@pytest.mark.parametrize("t,n,k,n_off,k_off", CASES)
def test_kn_layout_matches_float64_oracle(impl, form, t, n, k, n_off, k_off):
    """The model's [K, N] layout (w_layout "kn": weight and grid transposed, nothing else): the same oracle."""
    w_q, w_s = _shard(n, k, n_off, k_off, seed=n + k + 1)
    x = jnp.asarray(np.random.default_rng(t + 1).normal(size=(t, k)), jnp.float32)
    y = fp8_linear.fp8_linear(x, jnp.asarray(w_q).T, jnp.asarray(w_s).T, form=form, impl=impl, n_offset=n_off,
                              k_offset=k_off, w_layout="kn")
    assert y.shape == (t, n) and y.dtype == jnp.float32
    assert _rel(y, _oracle(x, w_q, w_s, form, n_off, k_off)) < 2e-6
    if n != k:  # an [N, K] weight given as "kn": named by its layout
        with pytest.raises(ValueError, match=r"\[K, N\]"):
            fp8_linear.fp8_linear(x, jnp.asarray(w_q), jnp.asarray(w_s).T, form=form, impl=impl, w_layout="kn")


@pytest.mark.parametrize("form", fp8_linear.FORMS)
def test_bf16_rows_and_kernel_options(kernel_impl, form):
    """bf16 rows (the model's dtype; output bf16) and a split-K launch with narrow blocks, leading axes kept."""
    w_q, w_s = _shard(192, 512, 0, 0, seed=3)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 10, 512)), jnp.bfloat16)
    want = _oracle(x.reshape(20, 512), w_q, w_s, form).reshape(2, 10, 192)
    for options in ({}, {"k_split": 2, "bm": 16, "bn": 32, "bk": 64}):
        y = fp8_linear.fp8_linear(x, w_q, w_s, form=form, impl=kernel_impl, **options)
        assert y.shape == (2, 10, 192) and y.dtype == jnp.bfloat16
        assert _rel(y, want) < 5e-3  # bf16 output rounding


def test_traced_offsets_and_shards_reassemble(kernel_impl):
    """Under jit with traced offsets (each shard_map rank's own), a weight cut into shards that start mid-block
    (rows 0:150 | 150:300, then columns 0:90 | 90:260 for the row-parallel form) gives the unsharded product:
    concatenated over N, summed over K. The scale grids passed have the worst case's block count."""
    rng = np.random.default_rng(5)
    full = rng.normal(size=(300, 260)) * rng.uniform(0.1, 3.0, size=(300, 1))
    q, s = fp8_formats.quantize_weight_blocks(full)
    x = jnp.asarray(rng.normal(size=(7, 260)), jnp.float32)
    want = _oracle(x, q, s, "w8a16")
    run = jax.jit(functools.partial(fp8_linear.fp8_linear, form="w8a16", impl=kernel_impl))

    def grid(r0, nr, c0, nc):  # the blocks from the slice's first, padded with the next ones to the worst case
        rows = fp8_formats.block_count(nr, 127) if nr < q.shape[0] else s.shape[0]
        cols = fp8_formats.block_count(nc, 127) if nc < q.shape[1] else s.shape[1]
        padded = jnp.pad(s, ((0, rows), (0, cols)), constant_values=7.0)  # never read
        return padded[r0 // 128:r0 // 128 + rows, c0 // 128:c0 // 128 + cols]

    cols = [run(x, q[r0:r0 + 150], grid(r0, 150, 0, 260), n_offset=jnp.int32(r0 % 128), k_offset=jnp.int32(0))
            for r0 in (0, 150)]
    assert _rel(jnp.concatenate(cols, axis=1), want) < 2e-6
    parts = [run(x[:, c0:c0 + nc], q[:, c0:c0 + nc], grid(0, 300, c0, nc), n_offset=jnp.int32(0),
                 k_offset=jnp.int32(c0 % 128)) for c0, nc in ((0, 90), (90, 170))]
    assert _rel(parts[0] + parts[1], want) < 2e-6


def test_w8a8_agrees_with_w8a16():
    """The two forms differ only by the activations' e4m3 rounding (3 mantissa bits: ~2-4% of y's norm on
    Gaussian rows); a block-misaligned activation grouping would be far off."""
    w_q, w_s = _shard(256, 640, 0, 0, seed=8)
    x = jnp.asarray(np.random.default_rng(9).normal(size=(32, 640)), jnp.bfloat16)
    a = np.asarray(fp8_linear.fp8_linear(x, w_q, w_s, form="w8a16"), np.float64)
    b = np.asarray(fp8_linear.fp8_linear(x, w_q, w_s, form="w8a8"), np.float64)
    assert 5e-3 < np.linalg.norm(a - b) / np.linalg.norm(a) < 5e-2


def test_quantize_weight_blocks_matches_host_form():
    """The jnp quantiser gives the release's bytes and scales (checkpoints.fp8_blocks, numpy), ragged blocks and
    an all-zero block (scale 1.0) included."""
    w = np.random.default_rng(10).normal(size=(200, 300)).astype(np.float32)
    w[128:, :128] = 0.0
    q, s = fp8_formats.quantize_weight_blocks(w)
    q_np, s_np = quantize_blocks(w)
    np.testing.assert_array_equal(np.asarray(s), s_np)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_np.view(np.uint8))


def test_bad_inputs_are_named():
    w_q, w_s = _shard(200, 300, 0, 0, seed=0)
    x = jnp.ones((2, 300), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"scale grid \(2, 2\) has 2 column blocks; 300 columns from offset 0 need"):
        fp8_linear.fp8_linear(x, w_q, w_s[:, :2])
    with pytest.raises(ValueError, match=r"has 2 row blocks; 200 rows from offset 70 need .* = 3"):
        fp8_linear.fp8_linear(x, w_q, w_s, n_offset=70)
    with pytest.raises(TypeError, match="scale grid must be float32, got bfloat16"):
        fp8_linear.fp8_linear(x, w_q, w_s.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="w_q must be float8_e4m3fn"):
        fp8_linear.fp8_linear(x, w_q.astype(jnp.bfloat16), w_s)
    with pytest.raises(ValueError, match=r"w_q \(200, 300\) must be \[N, K\]"):
        fp8_linear.fp8_linear(jnp.ones((2, 299), jnp.bfloat16), w_q, w_s)
    with pytest.raises(ValueError, match="k_offset 128 must be in"):
        fp8_linear.fp8_linear(x, w_q, w_s, k_offset=128)
    with pytest.raises(ValueError, match="unknown form 'w4a16'"):
        fp8_linear.fp8_linear(x, w_q, w_s, form="w4a16")
    with pytest.raises(ValueError, match="unknown impl 'cuda'"):
        fp8_linear.fp8_linear(x, w_q, w_s, impl="cuda")
    with pytest.raises(ValueError, match="bk 256 must be 32, 64 or 128"):
        fp8_linear.fp8_linear(x, w_q, w_s, impl="triton_interpret", bk=256)
    with pytest.raises(ValueError, match=r"unknown options \['block_n'\]"):
        fp8_linear.fp8_linear(x, w_q, w_s, impl="triton_interpret", block_n=64)


def test_lowers_at_glm52_shapes():
    """Pallas -> Triton lowering at GLM-5.2 TP = 8 shapes: q_b 2048 -> 16384 / 8, o_proj 16384 / 8 -> 6144, decode
    (split-K, 64-column blocks) and prefill (128 x 128 tiles), both forms."""
    s = jax.ShapeDtypeStruct
    for n, k in ((2048, 2048), (6144, 2048)):
        for t in (32, 8192):
            for form in fp8_linear.FORMS:
                args = (s((t, k), jnp.bfloat16), s((n, k), jnp.float8_e4m3fn), s((n // 128, k // 128), jnp.float32))
                cfg = fp8_linear_triton.default_config(t, n, k, form)
                calls = triton_calls(lower_for_gpu(functools.partial(fp8_linear_triton.fp8_matmul, form=form), *args))
                name = f"fp8_linear_{form}" + ("_split_k" if cfg.k_split > 1 else "")
                assert [(c.name, c.grid) for c in calls] == [(name, (-(-t // cfg.bm), n // cfg.bn, cfg.k_split))]


def _l2_reads(calls, t: int, k: int, n: int, itemsize: int = 2) -> float:
    """Bytes the launch's programs read (weight tiles and x tiles, from L2 or HBM) over the weight's K x N bytes,
    counted from its grid (row blocks, column blocks, K splits) alone: each row block reads the whole weight, each
    column block all T rows of x."""
    [(name, (row_blocks, col_blocks, _))] = [(c.name, c.grid) for c in calls]
    return (row_blocks * k * n + col_blocks * t * k * itemsize) / (k * n)


@pytest.mark.parametrize("n,k", [(2048, 6144), (576, 6144), (16384, 2048), (6144, 16384)])  # q_a, kv_a, q_b, o_proj
def test_invariant_decode_steps_launch_one_config_at_every_bucket(n, k):
    """Batch-invariant decode steps are padded to row buckets (8 to `registry.INVARIANT_STEP_ROWS`): the FP8 linear
    launches one config at every bucket, the decode-sized one of `registry.INVARIANT_CONFIG_ROWS` rows (its tiles and
    split-K set the MMA instruction and the order a row's K partials are summed in, so they must not follow the
    bucket); at small buckets its grid is the default mode's at those rows but for the row tile (64 rows), so the
    tiles read the weight once; a 256-row bucket (over 128 requests) reads it 4 times."""
    from kernels import registry
    s = jax.ShapeDtypeStruct
    configs = set()
    for t in registry.decode_buckets():
        args = (s((t, k), jnp.bfloat16), s((k, n), jnp.float8_e4m3fn), s((k // 128, -(-n // 128)), jnp.float32))
        with registry.deciding_for("gpu"), registry.batch_invariant(rows=t), registry.record_launches() as log:
            calls = triton_calls(lower_for_gpu(functools.partial(fp8_linear_triton.fp8_matmul, w_layout="kn"), *args))
        configs.update(cfg for _, cfg in log)
        row_blocks, col_blocks, splits = calls[0].grid
        assert row_blocks == -(-t // 64)
        assert _l2_reads(calls, t, k, n) <= (3.0 if t <= 64 else 12.0) * (-(-n // 64) * 64 / n) + 1e-9
    assert configs == {fp8_linear_triton.default_config(registry.INVARIANT_CONFIG_ROWS, n, k)}


# ------------------------------------------------------------------------------ GPU (native Triton)

def _random_fp8(key, shape):
    """Random finite e4m3 bytes (no NaN codes) and scales around 1e-3: a weight without a quantisation pass."""
    kq, kb, ks = jax.random.split(key, 3)
    bits = jax.random.randint(kq, shape, 0, 0x7F, jnp.uint8) | (jax.random.randint(kb, shape, 0, 2, jnp.uint8) << 7)
    grid = tuple(-(-d // 128) for d in shape)
    return (jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn),
            jax.random.uniform(ks, grid, jnp.float32, 0.5e-3, 2e-3))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2048, 2048), (6144, 2048)])  # q_b and o_proj at TP = 8
@pytest.mark.parametrize("t", [1, 32, 256, 8192])  # 256: a batch-invariant decode step's rows
@pytest.mark.parametrize("form", fp8_linear.FORMS)
@pytest.mark.parametrize("w_layout", ["nk", "kn"])
def test_gpu_glm52_shapes(kernel_impl, form, t, n, k, w_layout):
    w_q, w_s = _random_fp8(jax.random.key(t + n), (n, k))
    x = jax.random.normal(jax.random.key(1), (t, k), jnp.bfloat16)
    run = jax.jit(functools.partial(fp8_linear.fp8_linear, form=form, impl=kernel_impl, w_layout=w_layout))
    y = run(x, w_q.T, w_s.T) if w_layout == "kn" else run(x, w_q, w_s)
    rows = slice(0, min(t, 256))  # the float64 oracle on at most 256 rows
    assert _rel(y[rows], _oracle(x[rows], w_q, w_s, form)) < 5e-3
