"""Sparse MLA in one launch (`merge="kernel"`: split-K whose last program per (row, head block) merges the partials,
kernels/sparse_mla/triton.py) against a float64 numpy oracle that decodes the cache bytes itself; its lowering (one
Triton launch; a CTA barrier, then an acq_rel gpu-scope atomic); its config rules. Interpreted on the CPU (small
caches), native on the GPU (GLM-5 shapes, repeat calls bit for bit)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels import fp8_formats, sparse_mla
from kernels.sparse_mla import triton as sparse_mla_triton
from kernels.common.triton_common import lower_for_gpu, triton_calls

SCALE = 0.0625


def np_rows(cache, r, dr):
    """Cache rows `cache` [N, bytes or R + Dr] as float64 [N, R + Dr]: bf16 as stored; fp8_ds_mla decoded from
    its bytes here (e4m3 latent x the tile's float32 scale, bf16 k_pe), not by kernels.common.fp8_formats."""
    c = np.asarray(cache)
    if c.dtype != np.uint8:
        return np.asarray(c, np.float64)
    tile = r if r % 128 else 128
    nt = r // tile
    kv = c[:, :r].copy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scales = c[:, r:r + 4 * nt].copy().view("<f4").astype(np.float64)
    pe = c[:, r + 4 * nt:r + 4 * nt + 2 * dr].copy().view(ml_dtypes.bfloat16).astype(np.float64)
    kv = (kv.reshape(len(c), nt, tile) * scales[:, :, None]).reshape(len(c), r)
    return np.concatenate([kv, pe], axis=1)


def np_attention(q, cache, idx, r, dr):
    """float64 softmax attention of each query row over its listed cache rows (-1 skipped, duplicates counted)."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    t, h, _ = q.shape
    o, lse = np.zeros((t, h, r)), np.full((t, h), -np.inf)
    for i in range(t):
        sel = np.asarray(idx[i])
        sel = sel[sel >= 0]
        if len(sel):
            rows = np_rows(cache[jnp.asarray(sel)], r, dr)  # only the listed rows leave the device
            s = q[i] @ rows.T * SCALE
            m = s.max(-1, keepdims=True)
            p = np.exp(s - m)
            o[i] = p @ rows[:, :r] / p.sum(-1, keepdims=True)
            lse[i] = m[:, 0] + np.log(p.sum(-1))
    return o, lse


def make_inputs(t, h, k, n, *, r, dr, fp8, seed):
    """Queries, a cache and indices with -1 slots, an all-invalid row 0 (when t > 1: a single row keeps its keys),
    duplicates in row 1 and, in row 2, valid slots only in the first 8 positions (every later split is empty)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(t, h, r + dr)), jnp.bfloat16)
    c = rng.normal(size=(n, r + dr)).astype(np.float32) * rng.uniform(0.5, 2.0, size=(n, 1)).astype(np.float32)
    cache = (fp8_formats.quantize_mla_rows(jnp.asarray(c[:, :r]), jnp.asarray(c[:, r:])) if fp8
             else jnp.asarray(c, jnp.bfloat16))
    idx = rng.integers(0, n, size=(t, k)).astype(np.int32)
    idx[rng.uniform(size=(t, k)) < 0.25] = -1
    if t > 1:
        idx[0] = -1
        idx[1, :6] = idx[1, 6] if idx[1, 6] >= 0 else 3
    if t > 2:
        idx[2, 8:] = -1
    return q, cache, jnp.asarray(idx)


def one_launch(q, cache, idx, *, r, impl, **cfg):
    f = functools.partial(sparse_mla.sparse_mla, scale=SCALE, kv_lora_rank=r, impl=impl, merge="kernel", **cfg)
    return jax.jit(f)(q, cache, idx)


def check_against_numpy(o, lse, q, cache, idx, r, dr, tol=2e-2):
    o, lse = np.asarray(o), np.asarray(lse)
    o_ref, lse_ref = np_attention(q, cache, idx, r, dr)
    assert o.dtype == np.float32 and o.shape == o_ref.shape and lse.shape == lse_ref.shape
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    empty = np.all(np.asarray(idx) < 0, axis=1)
    assert np.all(o[empty] == 0) and np.all(np.isneginf(lse[empty]))  # (0, -inf): the merge identity
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], atol=tol, rtol=tol)
    rel = np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref)
    assert rel < tol, rel


# ------------------------------------------------------------------------------ against float64 numpy

@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("h,block_h,n_split,partial_dtype", [(16, 16, 4, "float32"), (64, 32, 8, "float32"),
                                                             (64, 16, 2, "bfloat16")])
def test_one_launch_matches_numpy(kernel_impl, fp8, h, block_h, n_split, partial_dtype):
    """n_split > 1 over K = 100 (padded with -1 to n_split x block_k multiples: whole splits of padding), -1
    slots, an all-invalid row, a row whose later splits are empty; R = 256 (two fp8 scale tiles), Dr = 64."""
    r, dr = 256, 64
    q, cache, idx = make_inputs(3, h, 100, 150, r=r, dr=dr, fp8=fp8, seed=h + n_split + fp8)
    o, lse = one_launch(q, cache, idx, r=r, impl=kernel_impl, block_h=block_h, block_k=16, n_split=n_split,
                        num_warps=4, num_stages=2, partial_dtype=partial_dtype)
    check_against_numpy(o, lse, q, cache, idx, r, dr)


def test_one_launch_equals_the_two_launch_form(kernel_impl):
    """Same kernel body, same splits: the in-kernel merge and `merge_partials` after the kernel agree to float32
    rounding (float32 partials)."""
    q, cache, idx = make_inputs(4, 16, 128, 200, r=128, dr=64, fp8=False, seed=5)
    cfg = dict(block_h=16, block_k=16, n_split=4, num_warps=4, num_stages=2)
    o1, lse1 = one_launch(q, cache, idx, r=128, impl=kernel_impl, **cfg)
    f = functools.partial(sparse_mla.sparse_mla, scale=SCALE, kv_lora_rank=128, impl=kernel_impl, merge="xla", **cfg)
    o2, lse2 = jax.jit(f)(q, cache, idx)
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse1), np.asarray(lse2), rtol=1e-6, atol=1e-6)


def test_small_heads_and_one_fp8_tile(kernel_impl):
    """H = 4 (padded to a 16-head block inside), R = 64 (one fp8 scale tile of 64), Dr = 32."""
    for fp8 in (False, True):
        q, cache, idx = make_inputs(3, 4, 40, 50, r=64, dr=32, fp8=fp8, seed=9)
        o, lse = one_launch(q, cache, idx, r=64, impl=kernel_impl, block_h=16, block_k=16, n_split=2, num_warps=4,
                            num_stages=1)
        check_against_numpy(o, lse, q, cache, idx, 64, 32)


# ------------------------------------------------------------------------------ lowering (CPU, no GPU needed)

def _triton_ir(fn, *args):
    """The Triton IR text of the (single) kernel inside `fn(*args)`, from the Pallas lowering (no GPU)."""
    from jax._src.pallas.triton import lowering

    texts, lower = [], lowering.lower_jaxpr_to_triton_module

    def keep(*a, **k):
        res = lower(*a, **k)
        texts.append(res.module.operation.get_asm())
        return res

    lowering.lower_jaxpr_to_triton_module = keep
    try:
        calls = triton_calls(lower_for_gpu(fn, *args))
    finally:
        lowering.lower_jaxpr_to_triton_module = lower
    return calls, texts


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("h", [16, 64])
def test_one_launch_at_glm5_dims(fp8, h):
    """B = 1, K = 2048: one Triton launch on (rows, head blocks, splits); its IR stores the partials, then a CTA
    barrier, then the arrival count as an acq_rel gpu-scope atomic add, then (in the merging branch) a barrier
    before the partials are read back. The ordering on the device itself is checked only by the GPU tests."""
    s = jax.ShapeDtypeStruct
    cache = s((3 << 20, 656), jnp.uint8) if fp8 else s((4 << 20, 576), jnp.bfloat16)
    f = functools.partial(sparse_mla_triton.sparse_mla_triton, scale=SCALE, kv_lora_rank=512, block_h=16,
                          block_k=32, n_split=16, num_warps=4, num_stages=2, merge="kernel")
    calls, texts = _triton_ir(f, s((1, h, 576), jnp.bfloat16), cache, s((1, 2048), jnp.int32))
    name = "sparse_mla_fp8_merged" if fp8 else "sparse_mla_bf16_merged"
    assert [(c.name, c.grid) for c in calls] == [(name, (1, h // 16, 16))]
    [ir] = texts
    atomic = [i for i, line in enumerate(ir.splitlines()) if "tt.atomic_rmw" in line]
    assert len(atomic) == 1 and "add, acq_rel, gpu" in ir.splitlines()[atomic[0]]
    lines = ir.splitlines()
    before, after = lines[:atomic[0]], lines[atomic[0]:]
    last_store = max(i for i, line in enumerate(before) if "tt.store" in line)
    assert any("gpu.barrier" in line for line in before[last_store:])  # release: every thread's stores first
    branch = next(i for i, line in enumerate(after) if "scf.if" in line)
    first_load = next(i for i, line in enumerate(after) if "tt.load" in line)
    assert branch < first_load and any("gpu.barrier" in line for line in after[branch:first_load])


# ------------------------------------------------------------------------------ config

def test_merge_config_is_validated():
    cfg = dict(block_h=16, block_k=16, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="n_split 3 must be a power of two"):
        sparse_mla_triton.SparseMLAConfig(n_split=3, merge="kernel", **cfg)
    with pytest.raises(ValueError, match="merge 'atomic'"):
        sparse_mla_triton.SparseMLAConfig(n_split=2, merge="atomic", **cfg)
    with pytest.raises(ValueError, match="partial_dtype 'float16'"):
        sparse_mla_triton.SparseMLAConfig(n_split=2, partial_dtype="float16", **cfg)
    sparse_mla_triton.SparseMLAConfig(n_split=3, merge="xla", **cfg)  # the two-launch form takes any split count


def test_merge_cols_bound_the_merge_tile():
    for ns, bh in [(2, 16), (16, 16), (32, 32), (64, 64)]:
        c = sparse_mla_triton.merge_cols(ns, bh, 512)
        assert 512 % c == 0 and (ns * bh * c <= 16384 or c == 16)
    assert sparse_mla_triton.merge_cols(2, 16, 512) == 512


# ------------------------------------------------------------------------------ GPU (native Triton)

@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("t,h,block_h,n_split,partial_dtype", [
    (1, 64, 16, 16, "float32"), (1, 16, 16, 32, "bfloat16"), (4, 64, 32, 8, "float32"), (16, 64, 64, 4, "float32"),
    (3, 128, 16, 8, "bfloat16")])
def test_gpu_one_launch_glm5_shapes(kernel_impl, t, h, block_h, n_split, partial_dtype, fp8):
    """GLM-5 dims (R 512, Dr 64, K 2048) over a 200K-row cache; the same call twice is bit for bit the same (the
    counters start from zero at every launch; the merge sums the splits in a fixed order)."""
    r, dr = 512, 64
    q, cache, idx = make_inputs(t, h, 2048, 200_000, r=r, dr=dr, fp8=fp8, seed=t + h)
    f = jax.jit(functools.partial(sparse_mla.sparse_mla, scale=SCALE, kv_lora_rank=r, impl=kernel_impl,
                                  merge="kernel", block_h=block_h, block_k=32, n_split=n_split, num_warps=4,
                                  num_stages=2, partial_dtype=partial_dtype))
    o, lse = f(q, cache, idx)
    check_against_numpy(o, lse, q, cache, idx, r, dr)
    for _ in range(3):
        o2, lse2 = f(q, cache, idx)
        np.testing.assert_array_equal(np.asarray(o2), np.asarray(o))
        np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))


def test_one_launch_config_aims_at_128_programs():
    """16-head blocks; splits double until ~128 programs, at most 16 of them and never more than K allows."""
    for t, want in [(1, 16), (2, 16), (4, 8), (8, 4), (16, 2), (32, 1)]:
        c = sparse_mla_triton.one_launch_config(t, 64, 2048, False)
        assert (c.block_h, c.n_split, c.merge) == (16, want, "kernel"), (t, c)
    assert sparse_mla_triton.one_launch_config(1, 16, 2048, True).n_split == 16  # TP = 4: 16 heads
    assert sparse_mla_triton.one_launch_config(1, 64, 64, False).n_split == 2  # K = 64: two 32-key splits
