"""W8A8 grouped GEMM (kernels/fp8_gemm): the jnp rule and the Mosaic GPU kernel against a float64 numpy oracle.

On CPU the kernel runs under the Pallas Mosaic GPU interpreter at tiny shapes and lowers for CUDA at GLM-5.2
widths; the gpu-marked tests run it on the device at ragged group sizes."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels import fp8_gemm
from kernels.fp8_gemm import Fp8GemmConfig, config as fp8_config, reference

E4M3 = jnp.float8_e4m3fn


def np_quantize_rows(x):
    """The activation rule in numpy float32: s_a = max(amax / 448, 2**-126), a_q = e4m3(x / s_a)."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    xb = x.reshape(m, k // 128, 128)
    s = np.maximum(np.abs(xb).max(-1) / np.float32(448.0), np.float32(1.1754944e-38))  # IEEE float32 division
    q = np.clip(xb / s[..., None], -448, 448)  # IEEE float32 division, then round to nearest even e4m3
    return q.astype(ml_dtypes.float8_e4m3fn).reshape(m, k), s


def random_e4m3(key, shape):
    """e4m3 values drawn over the format's whole range (random bytes with the NaN codes replaced)."""
    b = jax.random.bits(key, shape, jnp.uint8)
    b = jnp.where((b & 0x7F) == 0x7F, b ^ 0x01, b)
    return jax.lax.bitcast_convert_type(b, E4M3)


def make_problem(seed, sizes, n, k, tile_m, *, zero_blocks=False):
    """Rows of len(sizes) groups placed on `tile_m` tiles: (a_q, s_a, w_q, s_w, tile_group, row_group)."""
    g = len(sizes)
    m_tiles = -(-sum(sizes) // tile_m) + g - 1
    starts, tile_group = reference.group_layout(jnp.array(sizes), tile_m, m_tiles)
    rg = np.full(m_tiles * tile_m, -1, np.int32)
    for i, (s0, sz) in enumerate(zip(np.asarray(starts), sizes)):
        rg[s0:s0 + sz] = i
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (m_tiles * tile_m, k), jnp.float32) * jnp.exp(
        jax.random.normal(ks[1], (m_tiles * tile_m, 1)))
    x = jnp.where(jnp.asarray(rg >= 0)[:, None], x, 0.0)  # rows outside every group are zeros
    if zero_blocks:
        x = x.at[::3, :128].set(0.0)  # whole zero activation blocks: s_a at its floor, a_q zeros
    a_q, s_a = reference.quantize_rows(x)
    w_q = random_e4m3(ks[2], (g, n, k))
    if zero_blocks:
        w_q = w_q.at[:, :128, 128:256].set(0)
    s_w = jax.random.uniform(ks[3], (g, n // 128, k // 128), jnp.float32, 2.0 ** -12, 2.0 ** -6)
    return a_q, s_a, w_q, s_w, tile_group, rg


def rel_err(out, ref):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300)


def test_quantize_rows_is_the_rule():
    """Bit for bit the numpy rule, and the repo's own W8A8 quantiser (the Triton kernels' numerics)."""
    from kernels.common import fp8_formats
    x = jax.random.normal(jax.random.key(1), (16, 384), jnp.float32) * 3.0
    x = x.at[2, 128:256].set(0.0).at[5, :3].set(1e4)  # a zero block; a saturating outlier block
    q, s = reference.quantize_rows(x)
    nq, ns = np_quantize_rows(np.asarray(x))
    np.testing.assert_array_equal(np.asarray(s), ns)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), nq.view(np.uint8))
    rq, rs = fp8_formats.quantize_activation_blocks(x)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(rs))
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(rq).view(np.uint8))


def test_group_layout_places_ragged_groups_on_tiles():
    sizes = [0, 1, 17, 0, 16, 40, 0]
    starts, tg = reference.group_layout(jnp.array(sizes), 16, -(-sum(sizes) // 16) + len(sizes) - 1)
    want_starts, want_tg, pos = [], [], 0
    for i, s in enumerate(sizes):
        want_starts.append(pos)
        want_tg += [i] * (-(-s // 16))
        pos += -(-s // 16) * 16
    want_tg += [-1] * (len(np.asarray(tg)) - len(want_tg))
    assert np.asarray(starts).tolist() == want_starts
    assert np.asarray(tg).tolist() == want_tg


@pytest.mark.parametrize("zero_blocks", [False, True])
def test_xla_rule_matches_oracle(zero_blocks):
    a_q, s_a, w_q, s_w, tg, rg = make_problem(0, [5, 0, 1, 20], 256, 384, 16, zero_blocks=zero_blocks)
    out = fp8_gemm.grouped_matmul(a_q, s_a, w_q, s_w, tg, impl="xla", config=Fp8GemmConfig(
        tile_m=16, tile_n=128, stages=2, swap_ab=True), out_dtype=jnp.float32)
    ref = reference.oracle(a_q, s_a, w_q, s_w, rg)
    assert rel_err(out, ref) < 1e-6
    assert not np.asarray(out)[rg < 0].any()


INTERPRETED = {
    "prefill_128": (Fp8GemmConfig(tile_m=128, tile_n=128, stages=2), [130, 0, 1], 256),
    "prefill_256": (Fp8GemmConfig(tile_m=128, tile_n=256, stages=2), [3, 0, 0, 60], 256),
    "decode_swap": (Fp8GemmConfig(tile_m=16, tile_n=128, stages=2, swap_ab=True), [1, 0, 17, 5, 0], 128),
    "decode_swap8": (Fp8GemmConfig(tile_m=8, tile_n=128, stages=2, swap_ab=True), [1, 0, 9], 128),
    "prefill_m_sub2": (Fp8GemmConfig(tile_m=256, tile_n=128, stages=2, m_sub=2), [0, 257, 1], 128),
    "prefill_swiglu": (Fp8GemmConfig(tile_m=128, tile_n=256, stages=2, swiglu=True), [129, 0, 2], 512),
}


def oracle_out(cfg, a_q, s_a, w_q, s_w, rg):
    ref = reference.oracle(a_q, s_a, w_q, s_w, rg)
    return reference.swiglu_interleaved(ref) if cfg.swiglu else ref


@pytest.mark.parametrize("name", sorted(INTERPRETED))
def test_interpreted_kernel_matches_oracle(name):
    """Ragged groups (empty, 1-row, spanning tiles), zero blocks, unused tiles written as zeros."""
    cfg, sizes, n = INTERPRETED[name]
    a_q, s_a, w_q, s_w, tg, rg = make_problem(3, sizes, n, 384, cfg.tile_m, zero_blocks=True)
    ref = oracle_out(cfg, a_q, s_a, w_q, s_w, rg)
    out = fp8_gemm.grouped_matmul(a_q, s_a, w_q, s_w, tg, impl="mosaic_interpret", config=cfg,
                                  out_dtype=jnp.float32)
    assert rel_err(out, ref) < 1e-6  # float32 sums of exact e4m3 products
    assert out.shape == ref.shape
    assert not np.asarray(out)[rg < 0].any()
    bf = fp8_gemm.grouped_matmul(a_q, s_a, w_q, s_w, tg, impl="mosaic_interpret", config=cfg)
    assert bf.dtype == jnp.bfloat16 and rel_err(bf, ref) < 4e-3


GLM = {  # (rows, N, K, groups, config): GLM-5.2 gate+up / down, prefill at TP = 1 and decode at TP = 8
    "prefill_gate_up": (1024, 4096, 6144, 256, fp8_config.PREFILL),
    "prefill_down": (1024, 6144, 2048, 256, Fp8GemmConfig(tile_n=256, stages=3)),
    "prefill_gate_up_swiglu": (1024, 4096, 6144, 256, Fp8GemmConfig(tile_n=256, stages=3, swiglu=True)),
    "prefill_down_m_sub2": (1024, 6144, 2048, 256, Fp8GemmConfig(tile_m=256, tile_n=128, stages=3, m_sub=2)),
    "decode_gate_up": (256, 512, 6144, 256, fp8_config.DECODE),
    "decode_down": (256, 6144, 256, 256, fp8_config.DECODE),
    "decode_gate_up_tm8": (256, 512, 6144, 256, Fp8GemmConfig(tile_m=8, tile_n=128, stages=8, swap_ab=True)),
}


@pytest.mark.parametrize("name", sorted(GLM))
def test_lowers_for_cuda_at_glm_widths(name):
    from kernels.common.triton_common import lower_for_gpu
    rows, n, k, g, cfg = GLM[name]
    m = (-(-rows // cfg.tile_m) + g - 1) * cfg.tile_m
    S = jax.ShapeDtypeStruct
    text = lower_for_gpu(functools.partial(fp8_gemm.grouped_matmul, impl="mosaic", config=cfg),
                         S((m, k), E4M3), S((m, k // 128), jnp.float32), S((g, n, k), E4M3),
                         S((g, n // 128, k // 128), jnp.float32), S((m // cfg.tile_m,), jnp.int32))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("cfg", [fp8_config.PREFILL, fp8_config.DECODE, Fp8GemmConfig(tile_m=8, swap_ab=True),
                                 Fp8GemmConfig(tile_n=256, stages=3, swiglu=True),
                                 Fp8GemmConfig(tile_m=256, stages=3, m_sub=2)])
def test_scale_blocks_keep_every_stage_on_128_bytes(cfg):
    """Each pipeline stage's scale buffer is a TMA destination: its start (stage x block bytes) must be a multiple
    of 128 bytes, and the activation block must cover the tile's rows."""
    from kernels.fp8_gemm import mosaic
    sa_w, sw_w = mosaic.scale_block_widths(cfg)
    assert (4 * sa_w) % 128 == 0 and (4 * sw_w) % 128 == 0
    assert sa_w >= cfg.tile_m and sw_w == mosaic.SCALE_REPEAT * cfg.n_sub


def test_configs_and_operands_are_checked():
    with pytest.raises(ValueError, match="tile_m must be 64 x m_sub x compute_wgs"):
        Fp8GemmConfig(tile_m=64)
    with pytest.raises(ValueError, match="tile_n must be 128 or 256"):
        Fp8GemmConfig(tile_n=192)
    with pytest.raises(ValueError, match="multiple of 8 up to 256"):
        Fp8GemmConfig(tile_m=12, swap_ab=True)
    with pytest.raises(ValueError, match="shared memory"):
        Fp8GemmConfig(tile_n=256, stages=8)
    with pytest.raises(ValueError, match="at most 2 fit"):
        Fp8GemmConfig(tile_m=256, tile_n=256, m_sub=2, stages=2)
    with pytest.raises(ValueError, match="swiglu needs tile_n 256"):
        Fp8GemmConfig(swiglu=True)
    a_q, s_a, w_q, s_w, tg, _ = make_problem(0, [4], 128, 256, 16)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_gemm.grouped_matmul(a_q.astype(jnp.bfloat16), s_a, w_q, s_w, tg, config=fp8_config.DECODE)
    with pytest.raises(ValueError, match="tile_group"):
        fp8_gemm.grouped_matmul(a_q, s_a, w_q, s_w, tg[:0], config=fp8_config.DECODE)


GPU_CASES = {
    "prefill_128": (fp8_config.PREFILL, [300, 0, 1, 129, 64, 0, 7], 512, 6144),
    "prefill_256": (Fp8GemmConfig(tile_n=256, stages=3), [1, 200, 0, 128, 33], 512, 2048),
    "decode_swap16": (fp8_config.DECODE, [1, 0, 3, 17, 0, 2, 40, 1], 256, 6144),
    "decode_swap8": (Fp8GemmConfig(tile_m=8, tile_n=128, stages=6, swap_ab=True), [1, 0, 2, 9, 1], 512, 2048),
    "prefill_m_sub2": (Fp8GemmConfig(tile_m=256, tile_n=128, stages=3, m_sub=2), [300, 0, 1, 256], 256, 6144),
    "prefill_swiglu": (Fp8GemmConfig(tile_n=256, stages=3, swiglu=True), [200, 0, 1, 128], 512, 6144),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_kernel_matches_oracle(name):
    cfg, sizes, n, k = GPU_CASES[name]
    a_q, s_a, w_q, s_w, tg, rg = make_problem(7, sizes, n, k, cfg.tile_m, zero_blocks=True)
    ref = oracle_out(cfg, a_q, s_a, w_q, s_w, rg)
    out = fp8_gemm.grouped_matmul(a_q, s_a, w_q, s_w, tg, impl="mosaic", config=cfg, out_dtype=jnp.float32)
    assert rel_err(out, ref) < 1e-5
    assert not np.asarray(out)[rg < 0].any()
    out2 = fp8_gemm.grouped_matmul(a_q, s_a, w_q, s_w, tg, impl="mosaic", config=cfg, out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))  # no race: the same bits twice


def np_routed_experts(x, experts, weights, wg, wu, sg, su, wd, sd):
    """float64 numpy: the W8A8 rule through the experts (x and h quantised per row per 128 channels, h from its
    bf16 value), each pair one row."""
    a_q, s_a = np_quantize_rows(x)
    t, k = experts.shape
    out = np.zeros((t, x.shape[1]))
    for ti in range(t):
        for j in range(k):
            e = int(experts[ti, j])
            one = np.zeros(1, np.int32)
            gate = reference.oracle(a_q[ti:ti + 1], s_a[ti:ti + 1], wg[e:e + 1], sg[e:e + 1], one)
            up = reference.oracle(a_q[ti:ti + 1], s_a[ti:ti + 1], wu[e:e + 1], su[e:e + 1], one)
            h = (gate / (1 + np.exp(-gate)) * up).astype(np.float32).astype(ml_dtypes.bfloat16)
            h_q, h_s = np_quantize_rows(h.astype(np.float32))
            out[ti] += weights[ti, j] * reference.oracle(h_q, h_s, wd[e:e + 1], sd[e:e + 1], one)[0]
    return out


@pytest.mark.parametrize("impl", ["xla", "mosaic_interpret"])
def test_routed_experts_match_the_rule(impl):
    """The composed experts (quantise, place, SwiGLU GEMM, quantise h, down GEMM, combine) against numpy."""
    from kernels.fp8_gemm import experts as fp8_experts
    t, k, n_exp, d, i = 6, 2, 4, 256, 128
    ks = jax.random.split(jax.random.key(5), 8)
    x = jax.random.normal(ks[0], (t, d), jnp.float32)
    ex = jnp.array([[0, 2], [2, 3], [0, 3], [2, 0], [3, 2], [2, 0]], jnp.int32)  # expert 1 unused
    w = jax.random.uniform(ks[1], (t, k), jnp.float32)
    wg, wu = random_e4m3(ks[2], (n_exp, i, d)), random_e4m3(ks[3], (n_exp, i, d))
    wd = random_e4m3(ks[4], (n_exp, d, i))
    sg, su = (jax.random.uniform(kk, (n_exp, i // 128, d // 128), jnp.float32, 2.0 ** -12, 2.0 ** -8)
              for kk in ks[5:7])
    sd = jax.random.uniform(ks[7], (n_exp, d // 128, i // 128), jnp.float32, 2.0 ** -12, 2.0 ** -8)
    w_gu, s_gu = fp8_gemm.interleave_gate_up(wg, wu, sg, su)
    up = Fp8GemmConfig(tile_m=128, tile_n=256, stages=2, swiglu=True)
    down = Fp8GemmConfig(tile_m=128, tile_n=128, stages=2)
    out = fp8_experts.routed_experts_w8a8(x, ex, w, w_gu, s_gu, wd, sd, up_config=up, down_config=down, impl=impl)
    ref = np_routed_experts(np.asarray(x), np.asarray(ex), np.asarray(w), wg, wu, sg, su, wd, sd)
    assert rel_err(out, ref) < 1e-3  # h's bf16 rounding may move one of its e4m3 values by a step
