"""Pallas Triton sparse MLA against the xla oracle: interpreted on CPU (small caches), native on the GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import fp8_formats, lse_merge, sparse_mla, sparse_mla_triton

ON_GPU = jax.default_backend() == "gpu"
IMPL = "triton" if ON_GPU else "triton_interpret"
R, DR = 512, 64


def _inputs(t, h, k, n, *, seed, fp8=False, r=R, dr=DR):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(t, h, r + dr)), jnp.bfloat16)
    c = rng.normal(size=(n, r + dr)).astype(np.float32) * rng.uniform(0.5, 2.0, size=(n, 1)).astype(np.float32)
    cache = (fp8_formats.quantize_mla_rows(jnp.asarray(c[:, :r]), jnp.asarray(c[:, r:])) if fp8
             else jnp.asarray(c, jnp.bfloat16))
    idx = rng.integers(0, n, size=(t, k)).astype(np.int32)
    idx[rng.uniform(size=(t, k)) < 0.2] = -1
    idx[0] = -1  # a row with no valid index
    if t > 1:
        idx[1, : min(k, 9)] = idx[1, 0] if idx[1, 0] >= 0 else 3  # duplicates
    if t > 2:
        idx[2, 1:] = -1  # a single valid index
        idx[2, 0] = 5
    return q, cache, jnp.asarray(idx)


def _check(q, cache, idx, *, r=R, tol=2e-2, **kw):
    o, lse = sparse_mla.sparse_mla(q, cache, idx, scale=0.0625, kv_lora_rank=r, impl=IMPL, **kw)
    o_ref, lse_ref = sparse_mla.sparse_mla(q, cache, idx, scale=0.0625, kv_lora_rank=r, impl="xla")
    o, lse, o_ref, lse_ref = map(np.asarray, (o, lse, o_ref, lse_ref))
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape and o.dtype == np.float32
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    empty = np.all(np.asarray(idx) < 0, axis=1)
    assert np.all(o[empty] == 0) and np.all(np.isneginf(lse[empty]))  # (0, -inf): the merge identity
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], atol=tol, rtol=tol)
    rel = np.linalg.norm(o - o_ref) / max(np.linalg.norm(o_ref), 1e-30)
    assert rel < tol, rel


@pytest.mark.parametrize("h", [16, 64, 128])
@pytest.mark.parametrize("k", [64, 2048])
def test_bf16_matches_xla(h, k):
    _check(*_inputs(3, h, k, 300, seed=h + k))


@pytest.mark.parametrize("h,k", [(16, 64), (64, 2048), (128, 64)])
@pytest.mark.parametrize("block_h", [None, 64])  # few rows: one kv part per scale tile; 64 heads: one [bk, R] tile
def test_fp8_ds_mla_matches_xla(h, k, block_h):
    if block_h is not None and h % block_h:
        pytest.skip("block_h must divide H")
    _check(*_inputs(3, h, k, 300, seed=h * k, fp8=True), block_h=block_h)


@pytest.mark.parametrize("k,block_k,n_split", [(70, 32, 1), (70, 16, 3), (100, 32, 2), (5, 16, 1)])
def test_k_not_a_multiple_of_the_block_and_split_counts(k, block_k, n_split):
    _check(*_inputs(4, 16, k, 120, seed=k + n_split), block_k=block_k, n_split=n_split)


def test_small_heads_and_latent_padded():
    # H = 4 < 16 (padded inside), R = 64 (one fp8 tile of 64), Dr = 32
    for fp8 in (False, True):
        _check(*_inputs(3, 4, 40, 50, seed=7, fp8=fp8, r=64, dr=32), r=64)


def test_float32_cache_of_the_tiny_models():
    q, cache, idx = _inputs(3, 4, 24, 50, seed=8, r=32, dr=16)
    _check(q.astype(jnp.float32), cache.astype(jnp.float32), idx, r=32, tol=1e-4)


def test_partials_merge_to_the_whole():
    q, cache, idx = _inputs(3, 16, 96, 200, seed=11)
    o_p, lse_p = sparse_mla_triton.sparse_mla_triton(q, cache, idx, scale=0.0625, kv_lora_rank=R, block_k=16,
                                                     n_split=3, interpret=not ON_GPU, return_partials=True)
    assert o_p.shape == (3, 3, 16, R) and lse_p.shape == (3, 3, 16)
    assert np.all(np.isneginf(np.asarray(lse_p)[:, 0]))  # every split of the empty row is (0, -inf)
    o, lse = lse_merge.merge_partials(o_p, lse_p, axis=0)
    o1, lse1 = sparse_mla.sparse_mla(q, cache, idx, scale=0.0625, kv_lora_rank=R, impl=IMPL, block_k=16, n_split=1)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o1), atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("t", [1, 128])
@pytest.mark.parametrize("fp8", [False, True])
def test_lowers_to_triton_at_glm5_dims(fp8, t):
    """The Pallas -> Triton IR lowering at production shapes (B=1 and 128, H=64, K=2048, >4 GiB cache), CPU-only."""
    s = jax.ShapeDtypeStruct
    cache = s((3 << 20, 656), jnp.uint8) if fp8 else s((4 << 20, 576), jnp.bfloat16)  # fp8: under 2 GiB
    f = functools.partial(sparse_mla_triton.sparse_mla_triton, scale=0.0625, kv_lora_rank=R)
    txt = sparse_mla_triton.lower_for_gpu(f, s((t, 64, 576), jnp.bfloat16), cache, s((t, 2048), jnp.int32))
    assert "triton" in txt


def test_fp8_lowers_with_one_scale_tile():
    """R = 64 (one fp8 tile, the tiny models' geometry): the [bk, 1] scale and [bk, 1, R] reshapes lower too."""
    s = jax.ShapeDtypeStruct
    f = functools.partial(sparse_mla_triton.sparse_mla_triton, scale=0.0625, kv_lora_rank=64)
    cache = s((1000, fp8_formats.mla_row_bytes(64, 32)), jnp.uint8)
    assert "triton" in sparse_mla_triton.lower_for_gpu(f, s((4, 16, 96), jnp.bfloat16), cache, s((4, 64), jnp.int32))


def test_fp8_default_config_fits_shared_memory():
    """fp8_ds_mla steps 32 keys (at 64 the staged bf16 tile asks for 242 KB of the H200's 227 KB); bf16 keeps 64."""
    for t in (1, 8, 32, 128):
        assert sparse_mla_triton.default_config(t, 64, 2048, True)["block_k"] == 32
    assert sparse_mla_triton.default_config(128, 64, 2048, False)["block_k"] == 64


def test_byte_run_reassembly_is_exact():
    """u8_to_f32 / u8_to_bf16 (reshape + 2-way split) give back the little-endian floats bit for bit."""
    rng = np.random.default_rng(5)
    f32 = rng.normal(size=(8, 4)).astype(np.float32) * np.float32(1e-30)
    bf = jnp.asarray(rng.normal(size=(8, 64)), jnp.bfloat16)
    got32 = sparse_mla_triton.u8_to_f32(jnp.asarray(f32.view(np.uint8)))
    gotbf = sparse_mla_triton.u8_to_bf16(jax.lax.bitcast_convert_type(bf, jnp.uint8).reshape(8, 128))
    np.testing.assert_array_equal(np.asarray(got32).view(np.uint32), f32.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(gotbf, jnp.uint16)),
                                  np.asarray(jax.lax.bitcast_convert_type(bf, jnp.uint16)))


@pytest.mark.parametrize("h,block_h", [(16, None), (64, 64)])
def test_fp8_tile_scales_apply_to_their_own_tile(h, block_h):
    """Latent tiles of very different magnitudes (so very different scales), in both fp8 layouts (per-tile
    parts, one [bk, R] tile): a scale applied to the wrong tile would be far outside the tolerance."""
    q, _, idx = _inputs(3, h, 64, 80, seed=21)
    rng = np.random.default_rng(21)
    c = rng.normal(size=(80, R + DR)).astype(np.float32)
    c[:, :R] *= np.repeat(np.float32([1e-3, 30.0, 1.0, 300.0]), R // 4)[None, :]
    cache = fp8_formats.quantize_mla_rows(jnp.asarray(c[:, :R]), jnp.asarray(c[:, R:]))
    _check(q * jnp.bfloat16(0.01), cache, idx, block_h=block_h)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("t,h,k", [(1, 64, 2048), (32, 64, 2048), (128, 64, 2048), (64, 128, 2048), (33, 16, 2000)])
def test_gpu_glm5_shapes(t, h, k, fp8):
    _check(*_inputs(t, h, k, 200_000, seed=t + h, fp8=fp8))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [4, 512])
def test_gpu_float32_cache_glm5_shapes(t):
    """A float32 model (the reference dtype) at GLM-5 heads: its default tiles must fit shared memory, and its
    dots run in IEEE float32 (the oracle too, not the GPU's TF32 default)."""
    q, cache, idx = _inputs(t, 64, 2048, 100_000, seed=t)
    with jax.default_matmul_precision("highest"):
        _check(q.astype(jnp.float32), cache.astype(jnp.float32), idx, tol=1e-4)


def test_float32_default_config_fits_shared_memory():
    """q tile + pipelined key tiles of a float32 cache stay under the H200's 227 KB per CTA (the bf16 tiles
    would ask for ~440 KB); hand count: (block_h + stages * block_k) rows of 576 float32."""
    for t in (1, 4, 32, 128, 2048):
        c = sparse_mla_triton.default_config(t, 64, 2048, False, itemsize=4)
        assert (c["block_h"] + c["num_stages"] * c["block_k"]) * 576 * 4 <= 160 * 1024, c


def test_fp8_oracle_equals_attention_over_the_dequantised_cache():
    """The xla form's fp8_ds_mla read path = the bf16/f32 path over `dequantize_mla_rows` of the same bytes."""
    q, cache, idx = _inputs(4, 16, 40, 60, seed=3, fp8=True, r=256, dr=64)
    kv, k_pe = fp8_formats.dequantize_mla_rows(cache, 256, 64)
    dense = jnp.concatenate([kv, k_pe.astype(jnp.float32)], axis=-1)
    o, lse = sparse_mla.sparse_mla(q, cache, idx, scale=0.1, kv_lora_rank=256)
    o2, lse2 = sparse_mla.sparse_mla(q.astype(jnp.float32), dense, idx, scale=0.1, kv_lora_rank=256)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse2), rtol=1e-5, atol=1e-5)


def test_uint8_arrays_of_2_to_4_gib_are_refused():
    """Pallas Triton addresses arrays of <= 4 GiB with 32-bit signed element offsets: a uint8 cache of 2-4 GiB
    would be read before its buffer. The kernels refuse it by name; smaller and larger ones (64-bit) pass."""
    s = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match="sparse_mla cache.*2 GiB"):
        sparse_mla_triton.lower_for_gpu(functools.partial(sparse_mla_triton.sparse_mla_triton, scale=0.1,
                                                          kv_lora_rank=R),
                                        s((128, 64, 576), jnp.bfloat16), s((4_000_000, 656), jnp.uint8),
                                        s((128, 2048), jnp.int32))
    for ok in (s((3_000_000, 656), jnp.uint8), s((7_000_000, 656), jnp.uint8), s((4_000_000, 576), jnp.bfloat16)):
        sparse_mla_triton.check_addressable(ok, "cache")


@pytest.mark.parametrize("r_split,n_split,h", [(2, 1, 16), (4, 2, 64), (2, 3, 16)])
def test_output_split_matches_xla(r_split, n_split, h):
    """r_split programs per row and head block, each owning R / r_split output columns, with split-K beside it."""
    _check(*_inputs(4, h, 70, 150, seed=r_split * 7 + n_split), block_k=16, n_split=n_split, r_split=r_split)


def test_output_split_lowers_and_rejects_bad_values():
    s = jax.ShapeDtypeStruct
    f = functools.partial(sparse_mla_triton.sparse_mla_triton, scale=0.0625, kv_lora_rank=R, r_split=2)
    assert "triton" in sparse_mla_triton.lower_for_gpu(f, s((128, 64, 576), jnp.bfloat16),
                                                       s((1 << 20, 576), jnp.bfloat16), s((128, 2048), jnp.int32))
    q, cache, idx = _inputs(2, 16, 32, 64, seed=3, fp8=True)
    with pytest.raises(ValueError, match="r_split 2"):
        sparse_mla_triton.sparse_mla_triton(q, cache, idx, scale=0.1, kv_lora_rank=R, r_split=2, interpret=True)
    q, cache, idx = _inputs(2, 16, 32, 64, seed=3)
    with pytest.raises(ValueError, match="r_split 3"):
        sparse_mla_triton.sparse_mla_triton(q, cache, idx, scale=0.1, kv_lora_rank=R, r_split=3, interpret=True)
