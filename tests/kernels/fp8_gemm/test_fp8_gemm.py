"""W8A8 grouped GEMM (kernels/fp8_gemm): the jnp rule and the Mosaic GPU kernel against a float64 numpy oracle.

On CPU the kernel runs under the Pallas Mosaic GPU interpreter at tiny shapes (one case per layout: prefill row
tiles of 128 and 256 columns, two m sub-tiles, the SwiGLU epilogue, swap-AB decode tiles of 16 and 8 rows, swap-AB
with SwiGLU; ragged groups with empty and 1-row groups, zero blocks, unused tiles) and lowers for CUDA at GLM-5.2
widths; the shared-memory count (`Fp8GemmConfig.smem_bytes`) is checked against Mosaic GPU's own, as recorded on
the H100 and as its lowering computes it on the CPU; the gpu-marked tests run it on the device at ragged group sizes
against a bound derived from the tensor core's accumulation (`accumulation_bound`)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels import fp8_gemm
from kernels.fp8_gemm import Fp8GemmConfig, config as fp8_config, reference

E4M3 = jnp.float8_e4m3fn
K_CPU = 256  # two K blocks: the per-block promotion and the zero blocks, at the interpreter's cost


def np_quantize_rows(x):
    """The activation rule in numpy float32: s_a = max(amax / 448, 2**-126), a_q = e4m3(x / s_a)."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    xb = x.reshape(m, k // 128, 128)
    s = np.maximum(np.abs(xb).max(-1) / np.float32(448.0), np.float32(1.1754944e-38))  # IEEE float32 division
    q = np.clip(xb / s[..., None], -448, 448)  # IEEE float32 division, then round to nearest even e4m3
    return q.astype(ml_dtypes.float8_e4m3fn).reshape(m, k), s


def random_e4m3(rng, shape):
    """e4m3 values drawn over the format's whole range (random bytes with the NaN codes replaced), numpy-made."""
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b = np.where((b & 0x7F) == 0x7F, b ^ 0x01, b)
    return jnp.asarray(b.view(ml_dtypes.float8_e4m3fn))


def make_problem(seed, sizes, n, k, tile_m, *, zero_blocks=False, operands=1):
    """Rows of len(sizes) groups placed on `tile_m` tiles: (a_q, s_a, w_q, s_w, tile_group, row_group), with w_q
    and s_w tuples of `operands` weight stacks [G, N, K] and grids. Drawn in numpy (jax's random ops compile per
    shape: seconds a case)."""
    g = len(sizes)
    m_tiles = -(-sum(sizes) // tile_m) + g - 1
    starts, tile_group = reference.group_layout(jnp.array(sizes), tile_m, m_tiles)
    rg = np.full(m_tiles * tile_m, -1, np.int32)
    for i, (s0, sz) in enumerate(zip(np.asarray(starts), sizes)):
        rg[s0:s0 + sz] = i
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m_tiles * tile_m, k)) * np.exp(rng.standard_normal((m_tiles * tile_m, 1))))
    x = np.where((rg >= 0)[:, None], x, 0.0).astype(np.float32)  # rows outside every group are zeros
    if zero_blocks:
        x[::3, :128] = 0.0  # whole zero activation blocks: s_a at its floor, a_q zeros
    a_q, s_a = np_quantize_rows(x)
    w_q, s_w = [], []
    for _ in range(operands):
        w = random_e4m3(rng, (g, n, k))
        if zero_blocks:
            w = w.at[:, :128, 128:256].set(0)
        w_q.append(w)
        s_w.append(jnp.asarray(rng.uniform(2.0 ** -12, 2.0 ** -6, (g, n // 128, k // 128)), jnp.float32))
    return jnp.asarray(a_q), jnp.asarray(s_a), tuple(w_q), tuple(s_w), tile_group, rg


def weights_of(cfg, w_q, s_w):
    """The operands as `grouped_matmul` takes them for `cfg`: pairs for swiglu, one array otherwise."""
    return (w_q, s_w) if cfg.swiglu else (w_q[0], s_w[0])


def oracle_out(cfg, a_q, s_a, w_q, s_w, rg):
    outs = [reference.oracle(a_q, s_a, w, s, rg) for w, s in zip(w_q, s_w)]
    return reference.silu_mul(*outs) if cfg.swiglu else outs[0]


def rel_err(out, ref):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300)


def _quantize_rows_is_numpys(xd):
    """`reference.quantize_rows(xd)` (jitted), checked bit for bit against the numpy rule; returns (q, s)."""
    nq, ns = np_quantize_rows(np.asarray(xd.astype(jnp.float32)))
    q, s = jax.jit(reference.quantize_rows)(xd)
    np.testing.assert_array_equal(np.asarray(s), ns)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), nq.view(np.uint8))
    return q, s


def test_quantize_rows_is_the_rule():
    """Bit for bit the numpy rule, the barrier formulation it replaces and the repo's own W8A8 quantiser (the
    Triton kernels' numerics), over 10^5 values of a wide dynamic range, a zero block, a saturating outlier, a
    block of 1e-33 (normal floats, tiny scale) and quotients on e4m3 rounding ties (round to even)."""
    from kernels.common import fp8_formats
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((96, 1024)) * np.exp(4 * rng.standard_normal((96, 1)))).astype(np.float32)
    x[2, 128:256] = 0.0  # a zero block
    x[5, :3] = 1e4  # a saturating outlier block
    x[7, 256:384] = rng.choice([-1e-33, 1e-33], 128) * rng.uniform(0.01, 1.0, 128)  # tiny but normal floats
    ties = np.array([1.0625, 1.1875, 2.125, 0.0078125 * 1.5, -3.25 - 0.125, 448.0], np.float32)  # e4m3 midpoints
    x[9, :128] = np.resize(ties, 128)  # amax 448: s_a = 1 and each quotient is the tie itself
    for dtype in (jnp.float32, jnp.bfloat16):
        xd = jnp.asarray(x, dtype)
        q, s = _quantize_rows_is_numpys(xd)
        for other in (reference.quantize_rows_barrier, fp8_formats.quantize_activation_blocks):
            oq, os_ = jax.jit(other)(xd)
            np.testing.assert_array_equal(np.asarray(s), np.asarray(os_))
            np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(oq).view(np.uint8))
    assert not np.asarray(q)[2, 128:256].astype(np.float32).any()


def test_quantize_rows_is_one_elementwise_pass():
    """No array of x's size but the input and the e4m3 output: the divisor is not materialised (the barrier
    formulation's float32 [M, K] copy is what made it about 3x its byte floor on the H100)."""
    x = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)
    hlo = jax.jit(reference.quantize_rows).lower(x).as_text()
    assert "optimization_barrier" not in hlo
    barrier = jax.jit(reference.quantize_rows_barrier).lower(x).as_text()
    assert "optimization_barrier" in barrier


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


@pytest.mark.parametrize("cfg", [Fp8GemmConfig(tile_m=16, tile_n=128, stages=2, swap_ab=True),
                                 Fp8GemmConfig(tile_m=16, tile_n=256, stages=2, swap_ab=True, swiglu=True)])
def test_xla_rule_matches_oracle(cfg):
    a_q, s_a, w_q, s_w, tg, rg = make_problem(0, [5, 0, 1, 20], 256, 384, 16, zero_blocks=True,
                                              operands=cfg.n_operands)
    run = jax.jit(functools.partial(fp8_gemm.grouped_matmul, impl="xla", config=cfg, out_dtype=jnp.float32))
    out = run(a_q, s_a, *weights_of(cfg, w_q, s_w), tg)
    assert rel_err(out, oracle_out(cfg, a_q, s_a, w_q, s_w, rg)) < 1e-6
    assert not np.asarray(out)[rg < 0].any()


# name: (config, group sizes, N, output dtype). Each layout once; float32 outputs are checked to float32 rounding
# of exact e4m3 products, bf16 ones (the SwiGLU epilogues, which write h in bf16, and the 16-byte store rows of an
# 8-row swap-AB tile, which take no swizzle) to bf16 rounding.
INTERPRETED = {
    "prefill_128": (Fp8GemmConfig(tile_m=128, tile_n=128, stages=2), [130, 0, 1], 128, jnp.float32),
    "prefill_256": (Fp8GemmConfig(tile_m=128, tile_n=256, stages=2), [3, 60], 256, jnp.float32),
    "prefill_m_sub2": (Fp8GemmConfig(tile_m=256, tile_n=128, stages=2, m_sub=2), [257, 1], 128, jnp.float32),
    "prefill_swiglu": (Fp8GemmConfig(tile_m=128, tile_n=256, stages=2, swiglu=True), [129, 0, 2], 128,
                       jnp.bfloat16),
    # 64 gate + 64 up columns a tile: N = 128 is two column tiles of one scale block
    "prefill_swiglu_narrow": (Fp8GemmConfig(tile_m=128, tile_n=128, stages=2, swiglu=True), [129, 0, 2], 128,
                              jnp.bfloat16),
    "decode_swap16": (Fp8GemmConfig(tile_m=16, tile_n=128, stages=2, swap_ab=True), [1, 0, 17, 5, 0], 128,
                      jnp.float32),
    "decode_swap8": (Fp8GemmConfig(tile_m=8, tile_n=128, stages=2, swap_ab=True), [1, 0, 9], 128, jnp.bfloat16),
    "decode_swap_swiglu": (Fp8GemmConfig(tile_m=16, tile_n=256, stages=2, swap_ab=True, swiglu=True),
                           [1, 0, 17, 5], 128, jnp.bfloat16),
}


@pytest.mark.parametrize("name", sorted(INTERPRETED))
def test_interpreted_kernel_matches_oracle(name):
    """Ragged groups (empty, 1-row, spanning tiles), zero blocks, unused tiles written as zeros."""
    cfg, sizes, n, dtype = INTERPRETED[name]
    a_q, s_a, w_q, s_w, tg, rg = make_problem(3, sizes, n, K_CPU, cfg.tile_m, zero_blocks=True,
                                              operands=cfg.n_operands)
    ref = oracle_out(cfg, a_q, s_a, w_q, s_w, rg)
    out = fp8_gemm.grouped_matmul(a_q, s_a, *weights_of(cfg, w_q, s_w), tg, impl="mosaic_interpret", config=cfg,
                                  out_dtype=dtype)
    assert out.shape == ref.shape and out.dtype == dtype
    # float32: sums of exact e4m3 products in float32; bf16: one rounding of 8 bits
    assert rel_err(out, ref) < (1e-6 if dtype == jnp.float32 else 4e-3)
    assert not np.asarray(out.astype(jnp.float32))[rg < 0].any()


def test_the_narrow_swiglu_tile_gives_the_wide_ones_bits():
    """64 + 64 weight rows a tile (two 64 x 64 wgmmas) and 128 + 128 (two 64 x 128) compute each output element
    from the same K blocks in the same order: the same float32 bits (so the same bf16 ones), so the experts may
    take either without changing a result (batch-invariant runs included)."""
    narrow = Fp8GemmConfig(tile_m=128, tile_n=128, stages=2, swiglu=True)
    wide = Fp8GemmConfig(tile_m=128, tile_n=256, stages=2, swiglu=True)
    a_q, s_a, w_q, s_w, tg, _ = make_problem(11, [129, 0, 2, 70], 256, 2 * 128, 128, zero_blocks=True, operands=2)
    a, b = (np.asarray(fp8_gemm.grouped_matmul(a_q, s_a, *weights_of(c, w_q, s_w), tg, impl="mosaic_interpret",
                                               config=c, out_dtype=jnp.float32)) for c in (narrow, wide))
    np.testing.assert_array_equal(a, b)
    assert np.abs(a).max() > 0


def test_small_partials_are_issued_together():
    """A K block's wgmmas are issued back to back and waited for once where their partials together take at most
    one 64 x 128 float32 partial's registers (the interpreted cases above run both paths), else one at a time."""
    C = Fp8GemmConfig
    together = [fp8_config.PREFILL, fp8_config.PREFILL_SWIGLU_NARROW, fp8_config.DECODE_SWIGLU, fp8_config.DECODE,
                C(tile_m=64, tile_n=256, stages=2, swap_ab=True, swiglu=True)]  # 2 x 64 x 64
    apart = [fp8_config.PREFILL_SWIGLU, C(tile_n=256, stages=2),  # 2 x 64 x 128
             C(tile_m=128, tile_n=256, stages=2, swap_ab=True, swiglu=True)]  # 2 x 64 x 128
    assert [c.issue_together for c in together] == [True] * len(together)
    assert [c.issue_together for c in apart] == [False] * len(apart)


@pytest.mark.parametrize("name", sorted(INTERPRETED))
def test_interpreted_kernel_has_no_race_when_the_ring_wraps(name, mosaic_races):
    """Three K blocks through a ring of two stages, so that the producer's TMA refills slots the compute warpgroups
    have released, under the interpreter's race detector (`mosaic_races`). The scales are read by plain loads
    (the generic proxy) and overwritten by TMA (the async proxy): ordered only through the proxy fence
    (`commit_smem`) each compute warpgroup issues before it releases the stage; without it the detector reports
    a race on the scale buffers in every layout."""
    cfg, sizes, n, dtype = INTERPRETED[name]
    a_q, s_a, w_q, s_w, tg, rg = make_problem(5, sizes, n, (cfg.stages + 1) * 128, cfg.tile_m,
                                              operands=cfg.n_operands)
    out, races = mosaic_races(lambda: fp8_gemm.grouped_matmul(a_q, s_a, *weights_of(cfg, w_q, s_w), tg,
                                                              impl="mosaic_interpret", config=cfg, out_dtype=dtype))
    assert not races
    assert rel_err(out, oracle_out(cfg, a_q, s_a, w_q, s_w, rg)) < (1e-6 if dtype == jnp.float32 else 4e-3)


CHAINED = ("prefill_128", "prefill_swiglu_narrow", "decode_swap_swiglu")


@pytest.mark.parametrize("name", CHAINED)
def test_chained_tiles_give_the_lone_tiles_bits(name, mosaic_races):
    """`Fp8GemmConfig.chain`: with 2 CTAs each walks several tiles, its pipelines chained (the producer loads the
    next tile's K blocks while the last tile finishes), beside a CTA whose one busy tile stands alone (3 CTAs) and
    unused tiles: the oracle's result, the unchained kernel's float32 bits, and no race under the interpreter's
    detector as the ring's slots pass from one tile to the next (4 K blocks through 2 stages)."""
    from kernels.fp8_gemm import mosaic
    cfg, sizes, n, _ = INTERPRETED[name]
    a_q, s_a, w_q, s_w, tg, rg = make_problem(7, sizes, n, 4 * 128, cfg.tile_m, operands=cfg.n_operands)
    w, ws = weights_of(cfg, w_q, s_w)
    ref = oracle_out(cfg, a_q, s_a, w_q, s_w, rg)
    for ctas in (2, 3):
        run = lambda c: mosaic.grouped_matmul_mosaic(a_q, s_a, w, ws, tg, config=c, out_dtype=jnp.float32,  # noqa
                                                     interpret=True, max_ctas=ctas)
        chained = dataclasses.replace(cfg, chain=True)
        assert chained.chains(4)
        out, races = mosaic_races(lambda: run(chained))
        assert not races
        assert rel_err(out, ref) < 1e-6
        np.testing.assert_array_equal(np.asarray(out), np.asarray(run(cfg)))
        assert not np.asarray(out)[rg < 0].any()


def test_chain_ends_are_each_ctas_first_and_last_busy_tile():
    """Hand-worked: 4 row tiles (the third unused), 3 column tiles, so lin 0-5 and 9-11 are busy; CTA c of 4 takes
    lin c, c + 4, c + 8. A CTA with no busy tile gets -1 twice."""
    from kernels.fp8_gemm import mosaic
    ends = np.asarray(mosaic._chain_ends(jnp.array([3, 0, -1, 1], jnp.int32), 3, 4))
    np.testing.assert_array_equal(ends, [[0, 1, 2, 3], [4, 9, 10, 11]])
    ends = np.asarray(mosaic._chain_ends(jnp.array([0, -1, -1], jnp.int32), 1, 2))
    np.testing.assert_array_equal(ends, [[0, -1], [0, -1]])


def test_chains_only_where_every_tile_starts_on_slot_0():
    C = Fp8GemmConfig
    assert C(stages=4, chain=True).chains(16) and C(stages=4, chain=True).chains(48)
    assert C(tile_m=16, stages=6, swap_ab=True, chain=True).chains(2)  # the ring shrinks to the 2 K blocks
    assert not C(stages=5, chain=True).chains(16) and not C(stages=4, chain=True).chains(6)
    assert not C(stages=4).chains(16)
    with pytest.raises(ValueError, match="chain must be a bool"):
        C(chain=1)


GLM = {  # (rows, N, K, groups, config): GLM-5.2 gate+up / down, prefill at TP = 1 and decode at TP = 8
    "prefill_gate": (1024, 2048, 6144, 256, fp8_config.PREFILL),
    "prefill_down": (1024, 6144, 2048, 256, Fp8GemmConfig(tile_n=256, stages=3)),
    "prefill_gate_up_swiglu": (1024, 2048, 6144, 256, fp8_config.PREFILL_SWIGLU),
    "prefill_gate_up_swiglu_narrow": (1024, 2048, 6144, 256, fp8_config.PREFILL_SWIGLU_NARROW),
    "prefill_gate_up_swiglu_narrow_m_sub2": (1024, 2048, 6144, 256,
                                             Fp8GemmConfig(tile_m=256, tile_n=128, stages=3, m_sub=2, swiglu=True)),
    "prefill_down_m_sub2": (1024, 6144, 2048, 256, Fp8GemmConfig(tile_m=256, tile_n=128, stages=3, m_sub=2)),
    "decode_gate_up_swiglu": (256, 256, 6144, 256, fp8_config.DECODE_SWIGLU),
    "decode_down": (256, 6144, 256, 256, fp8_config.DECODE),
    "decode_gate_tm8": (256, 512, 6144, 256, Fp8GemmConfig(tile_m=8, tile_n=128, stages=8, swap_ab=True)),
    "prefill_down_chained": (1024, 6144, 2048, 256, Fp8GemmConfig(chain=True)),
    "prefill_gate_up_swiglu_narrow_chained": (1024, 2048, 6144, 256,
                                              Fp8GemmConfig(tile_n=128, stages=4, swiglu=True, chain=True)),
}


@pytest.mark.parametrize("name", sorted(GLM))
def test_lowers_for_cuda_at_glm_widths(name):
    from kernels.common.triton_common import lower_for_gpu
    rows, n, k, g, cfg = GLM[name]
    m = (-(-rows // cfg.tile_m) + g - 1) * cfg.tile_m
    S = jax.ShapeDtypeStruct
    w, s = S((g, n, k), E4M3), S((g, n // 128, k // 128), jnp.float32)
    ws = ((w, w), (s, s)) if cfg.swiglu else (w, s)
    text = lower_for_gpu(functools.partial(fp8_gemm.grouped_matmul, impl="mosaic", config=cfg),
                         S((m, k), E4M3), S((m, k // 128), jnp.float32), *ws, S((m // cfg.tile_m,), jnp.int32))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("cfg", [fp8_config.PREFILL, fp8_config.DECODE, Fp8GemmConfig(tile_m=8, swap_ab=True),
                                 fp8_config.PREFILL_SWIGLU, fp8_config.DECODE_SWIGLU,
                                 Fp8GemmConfig(tile_m=256, stages=3, m_sub=2)])
def test_scale_blocks_keep_every_stage_on_128_bytes(cfg):
    """Each pipeline stage's scale buffer is a TMA destination: its start (stage x block bytes) must be a multiple
    of 128 bytes, and the activation block must cover the tile's rows."""
    from kernels.fp8_gemm import mosaic
    sa_w, sw_w = mosaic.scale_block_widths(cfg)
    assert (4 * sa_w) % 128 == 0 and (4 * sw_w) % 128 == 0
    assert sa_w >= cfg.tile_m and sw_w == mosaic.SCALE_REPEAT * cfg.operand_blocks


@pytest.mark.parametrize("layout", ["grouped", "swap_ab"])
def test_expert_configs_fit_float32_outputs(layout):
    """The routed experts' configs (kernels/fp8_gemm/experts.py) at decode and prefill row counts: one tile_m for
    both GEMMs, and shared memory for float32 outputs (h of float32 rows; the down GEMM's y)."""
    from kernels.fp8_gemm import experts
    for t in (1, 32, 128, 512, 8192):
        up, down = experts.expert_configs(layout, t, 8, 256)
        assert up.swiglu and not down.swiglu and up.tile_m == down.tile_m and up.swap_ab == (layout == "swap_ab")
        assert max(up.smem_bytes(4), down.smem_bytes(4)) <= fp8_config.SMEM_LIMIT


def unchecked_config(**kw) -> Fp8GemmConfig:
    """An Fp8GemmConfig without __post_init__'s checks (a config it rejects for shared memory)."""
    c = object.__new__(Fp8GemmConfig)
    for f in dataclasses.fields(Fp8GemmConfig):
        object.__setattr__(c, f.name, kw.get(f.name, f.default))
    return c


# Mosaic GPU's own shared-memory counts on the H100 (jax 0.11.2, bf16 output, K = 1024), hand-copied from the
# "invalid" rows of benchmarks/results/fp8_gemm_configs.json (smem_mosaic; the run's printed errors name them).
H100_MOSAIC_SMEM = [
    (dict(tile_m=128, tile_n=256, stages=4, swiglu=True), 233536),
    (dict(tile_m=128, tile_n=128, stages=6), 233568),
    (dict(tile_m=128, tile_n=256, stages=4), 232512),
    (dict(tile_m=256, tile_n=128, stages=4, m_sub=2), 234560),
]


@pytest.mark.parametrize("kw,mosaic_bytes", H100_MOSAIC_SMEM)
def test_smem_bytes_is_mosaics_count_on_the_h100(kw, mosaic_bytes):
    """smem_bytes gives the byte count Mosaic GPU printed for the configs it refused on the H100, and those configs
    are rejected."""
    assert unchecked_config(**kw).smem_bytes() == mosaic_bytes
    with pytest.raises(ValueError, match=f"{mosaic_bytes} bytes of shared memory, over {fp8_config.SMEM_LIMIT}"):
        Fp8GemmConfig(**kw)


def test_smem_constants_are_mosaics():
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from kernels.common import mosaic_common
    assert mosaic_common.SMEM_ALIGNMENT == gpu_core.SMEM_ALIGNMENT
    assert mosaic_common.MBARRIER_BYTES == mgpu_utils.MBARRIER_BYTES


LOWERED_SMEM = {  # name: (config kwargs, output dtype, K blocks)
    "prefill": (dict(), jnp.bfloat16, 8),
    "prefill_f32": (dict(), jnp.float32, 8),
    "prefill_swiglu": (dict(tile_n=256, stages=3, swiglu=True), jnp.bfloat16, 8),
    "prefill_swiglu_f32": (dict(tile_n=256, stages=3, swiglu=True), jnp.float32, 8),
    "prefill_swiglu_4_stages": (dict(tile_n=256, stages=4, swiglu=True), jnp.bfloat16, 8),  # rejected
    "prefill_256_6_stages": (dict(tile_n=256, stages=6), jnp.bfloat16, 8),  # rejected
    "prefill_m_sub2": (dict(tile_m=256, stages=3, m_sub=2), jnp.bfloat16, 8),
    "one_wg": (dict(tile_m=64, tile_n=256, stages=5, compute_wgs=1, swiglu=True), jnp.float32, 8),
    "decode": (dict(tile_m=16, stages=6, swap_ab=True), jnp.bfloat16, 8),
    "decode_tm8_f32": (dict(tile_m=8, stages=6, swap_ab=True), jnp.float32, 8),
    "decode_tm64_f32": (dict(tile_m=64, stages=6, swap_ab=True), jnp.float32, 8),
    "decode_swiglu": (dict(tile_m=16, tile_n=256, stages=4, swap_ab=True, swiglu=True), jnp.bfloat16, 8),
    "decode_swiglu_tm128": (dict(tile_m=128, tile_n=256, stages=3, swap_ab=True, swiglu=True), jnp.bfloat16, 8),
    "ring_shrunk_to_k": (dict(tile_n=256, stages=3, swiglu=True), jnp.bfloat16, 2),  # 2 K blocks: 2 stages
    "prefill_swiglu_narrow": (dict(tile_n=128, stages=4, swiglu=True), jnp.bfloat16, 8),  # 64-column store tiles
    "prefill_swiglu_narrow_f32": (dict(tile_n=128, stages=4, swiglu=True), jnp.float32, 8),
    "prefill_chained": (dict(chain=True), jnp.bfloat16, 8),  # the chain adds no shared memory
}


@pytest.mark.parametrize("name", sorted(LOWERED_SMEM))
def test_smem_bytes_is_what_mosaic_lowering_counts(name):
    """smem_bytes against the byte count Mosaic GPU's lowering computes for the kernel (lowered for CUDA on the
    CPU, `mosaic.lowered_smem_bytes`): equal, for bf16 and float32 outputs, and with fewer K blocks than stages."""
    from kernels.fp8_gemm import mosaic
    kw, out_dtype, k_blocks = LOWERED_SMEM[name]
    cfg = unchecked_config(**kw)
    want = mosaic.lowered_smem_bytes(cfg, out_dtype, k_blocks)
    assert cfg.smem_bytes(jnp.dtype(out_dtype).itemsize, k_blocks) == want
    assert cfg.smem_bytes(jnp.dtype(out_dtype).itemsize) >= want  # any K: a bound from above


def test_default_configs_fit():
    """The configs the kernels pick by default (the named ones, the routed experts' and the dense linears' at
    decode and prefill row counts) fit the shared memory with bf16 and with float32 outputs."""
    from kernels.fp8_gemm import experts
    from kernels.fp8_linear import mosaic as linear
    cfgs = [fp8_config.PREFILL, fp8_config.DECODE, fp8_config.PREFILL_SWIGLU, fp8_config.PREFILL_SWIGLU_NARROW,
            fp8_config.DECODE_SWIGLU]
    for t in (1, 8, 32, 128, 512, 8192):
        for layout in ("grouped", "swap_ab"):
            cfgs += [*experts.expert_configs(layout, t, 8, 256), linear.linear_config(layout, t),
                     linear.linear_config(layout, t, swiglu=True)]
    for cfg in cfgs:
        assert max(cfg.smem_bytes(2), cfg.smem_bytes(4)) <= fp8_config.SMEM_LIMIT, cfg


def test_configs_and_operands_are_checked():
    with pytest.raises(ValueError, match="tile_m must be 64 x m_sub x compute_wgs"):
        Fp8GemmConfig(tile_m=64)
    with pytest.raises(ValueError, match="tile_n must be 128 or 256"):
        Fp8GemmConfig(tile_n=192)
    with pytest.raises(ValueError, match="multiple of 8 up to 256"):
        Fp8GemmConfig(tile_m=12, swap_ab=True)
    with pytest.raises(ValueError, match="shared memory"):
        Fp8GemmConfig(tile_n=256, stages=8)
    with pytest.raises(ValueError, match="at most 256"):
        Fp8GemmConfig(tile_m=256, tile_n=256, m_sub=2, stages=2)
    with pytest.raises(ValueError, match="at most 256"):
        Fp8GemmConfig(tile_m=256, tile_n=256, m_sub=2, stages=2, swiglu=True)
    with pytest.raises(ValueError, match="swap_ab needs tile_n = 64 x compute_wgs x weight operands = 256"):
        Fp8GemmConfig(tile_m=16, tile_n=128, swap_ab=True, swiglu=True)
    with pytest.raises(ValueError, match="tile_m up to 128"):
        Fp8GemmConfig(tile_m=256, tile_n=256, stages=2, swap_ab=True, swiglu=True)
    a_q, s_a, w_q, s_w, tg, _ = make_problem(0, [4], 128, 256, 16, operands=2)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_gemm.grouped_matmul(a_q.astype(jnp.bfloat16), s_a, w_q[0], s_w[0], tg, config=fp8_config.DECODE)
    with pytest.raises(ValueError, match="tile_group"):
        fp8_gemm.grouped_matmul(a_q, s_a, w_q[0], s_w[0], tg[:0], config=fp8_config.DECODE)
    with pytest.raises(TypeError, match=r"w_q must be a pair \(gate, up\)"):
        fp8_gemm.grouped_matmul(a_q, s_a, w_q[0], s_w[0], tg, config=fp8_config.DECODE_SWIGLU)
    with pytest.raises(TypeError, match="w_q must be one array"):
        fp8_gemm.grouped_matmul(a_q, s_a, w_q, s_w, tg, config=fp8_config.DECODE)
    with pytest.raises(ValueError, match="gate and up alike"):
        fp8_gemm.grouped_matmul(a_q, s_a, (w_q[0], w_q[1][:, :, :128]), s_w, tg, config=fp8_config.DECODE_SWIGLU)
    from kernels.fp8_gemm import mosaic
    for bad in (0, 2.0):
        with pytest.raises(ValueError, match=f"max_ctas must be an int >= 1, got {bad!r}"):
            mosaic.grouped_matmul_mosaic(a_q, s_a, w_q[0], s_w[0], tg, config=fp8_config.DECODE, interpret=True,
                                         max_ctas=bad)



def test_store_tiles_no_swizzle_takes_are_refused():
    """swap_ab tile_m 24 with bf16 output: 48-byte store-tile rows, on which Mosaic GPU's own lowering fails (a
    16-byte swizzle); the wrapper refuses it first, naming the rows. With float32 output (96-byte rows) Mosaic
    lowers it, and the wrapper takes it."""
    from kernels.fp8_gemm import mosaic
    cfg = Fp8GemmConfig(tile_m=24, tile_n=128, stages=6, swap_ab=True)
    with pytest.raises(ValueError, match="Swizzle 16 is not supported"):
        mosaic.lowered_smem_bytes(cfg, out_dtype=jnp.bfloat16)
    assert mosaic.lowered_smem_bytes(cfg, out_dtype=jnp.float32) == cfg.smem_bytes(4, 8)
    a_q, s_a, w_q, s_w, tg, _ = make_problem(0, [5, 30], 128, 256, 24)
    with pytest.raises(ValueError, match="store-tile rows of 48 bytes"):
        mosaic.grouped_matmul_mosaic(a_q, s_a, w_q[0], s_w[0], tg, config=cfg, out_dtype=jnp.bfloat16, interpret=True)
    jax.eval_shape(functools.partial(mosaic.grouped_matmul_mosaic, config=cfg, out_dtype=jnp.float32, interpret=True),
                   a_q, s_a, w_q[0], s_w[0], tg)

# ------------------------------------------------------------------------------ the GPU's accumulation bound
#
# Hopper's e4m3 wgmma does not add its products into a float32 accumulator: it keeps a short running sum (the
# DeepSeek-V3 report: about 14 bits; SageAttention2: 13 fraction bits) that it truncates as it goes. A truncating
# sum of 13 fraction bits renormalised every 16 products reproduces the one figure measured on the device, 2.4e-4
# relative (norm) at decode_swap16 on the H100 (`emulate_tensor_core` on that case's inputs gave 2.35e-4; 14 bits
# every 8 products gave 2.14e-4). Each truncation then loses less than 2^-13 of the running sum, which is at most
# the block's sum of |products| S_kb, so one 128-K partial is off by less than (128 / 16) x 2^-13 = 2^-10 of S_kb
# (8 truncations) before the kernel promotes it to float32, scales it by s_a s_w and adds it (KB float32 adds:
# KB x 2^-24 of the total). Per output element:
#     |out - oracle| <= (2^-10 + KB 2^-24) x sum_kb s_a s_w S_kb = that factor x oracle(|a_q|, |w_q|),
# the float64 oracle over the operands with their sign bits cleared. A wrong group, scale, block or row is off by
# O(|out|) at most elements (`test_bound_tells_a_wrong_operand_from_rounding`); the emulated errors stay under an
# eighth of it (`test_bound_holds_for_an_emulated_tensor_core`): the 2^-10 is the worst case of the model, not a
# tolerance fitted to the measurement.
ACCUMULATION = 2.0 ** -10
EPILOGUE = 2.0 ** -18  # the float32 SwiGLU epilogue (exp, division, product), relative to |silu(gate) up|


def abs_e4m3(q):
    """|q| for e4m3 (its sign bit cleared)."""
    return jax.lax.bitcast_convert_type(jnp.bitwise_and(jax.lax.bitcast_convert_type(q, jnp.uint8),
                                                        jnp.uint8(0x7F)), E4M3)


def accumulation_bound(cfg, a_q, s_a, w_q, s_w, rg):
    """float64 [M, N]: the error the GPU's accumulation may add per output element (see above), propagated
    through silu(gate) * up for swiglu configs (|d silu / dg| <= 1.1)."""
    kb = a_q.shape[1] // 128
    factor = ACCUMULATION + kb * 2.0 ** -24
    bounds = [factor * reference.oracle(abs_e4m3(a_q), s_a, abs_e4m3(w), s, rg) for w, s in zip(w_q, s_w)]
    if not cfg.swiglu:
        return bounds[0]
    gate, up = (reference.oracle(a_q, s_a, w, s, rg) for w, s in zip(w_q, s_w))
    bg, bu = bounds
    silu = np.abs(reference.silu_mul(gate, np.ones_like(gate)))
    return 1.1 * np.abs(up) * bg + silu * bu + 1.1 * bg * bu + EPILOGUE * silu * np.abs(up)


def check_within_bound(cfg, out, a_q, s_a, w_q, s_w, rg):
    """Every element within `accumulation_bound`; typical errors far below it (a systematic slip, e.g. partials
    rounded to bf16, would sit near it everywhere). Returns the largest error / bound."""
    ref = oracle_out(cfg, a_q, s_a, w_q, s_w, rg)
    bound = accumulation_bound(cfg, a_q, s_a, w_q, s_w, rg)
    err = np.abs(np.asarray(jnp.asarray(out, jnp.float32), np.float64) - ref)
    assert np.isfinite(err).all()
    excess = err - bound
    assert excess.max() <= 1e-30, (excess.max(), np.unravel_index(excess.argmax(), excess.shape))
    live = bound > 0
    assert np.median(err[live] / bound[live]) <= 0.125
    return (err[live] / bound[live]).max()


def emulate_tensor_core(a_q, s_a, w_q, s_w, rg, *, every: int, bits: int):
    """float64 numpy out of a truncating tensor core: per 128-K block, the running sum of `every` products at a
    time truncated (toward zero) to `bits` fraction bits, then promoted and scaled as the kernel does."""
    def trunc(v):
        m, e = np.frexp(v)
        return np.ldexp(np.trunc(m * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1), e)

    a = np.asarray(jnp.asarray(a_q).astype(jnp.float32), np.float64)
    w = np.asarray(jnp.asarray(w_q).astype(jnp.float32), np.float64)
    sa, sw = np.asarray(s_a, np.float64), np.asarray(s_w, np.float64)
    out = np.zeros((a.shape[0], w.shape[1]))
    for gi in np.unique(rg[rg >= 0]):
        rows = np.nonzero(rg == gi)[0]
        for b in range(a.shape[1] // 128):
            acc = np.zeros((len(rows), w.shape[1]))
            for s in range(b * 128, (b + 1) * 128, every):
                acc = trunc(acc + a[rows, s:s + every] @ w[gi, :, s:s + every].T)
            out[rows] += acc * sa[rows, b][:, None] * np.repeat(sw[gi, :, b], 128)[None, :w.shape[1]]
    return out


@pytest.mark.parametrize("every,bits,share", [(16, 13, 0.125), (8, 14, 0.125), (8, 13, 0.25)])
def test_bound_holds_for_an_emulated_tensor_core(every, bits, share):
    """The bound against the truncating accumulators that match the device's figure (16 products at 13 bits, 8 at
    14: 2.4e-4 and 2.2e-4 relative here, as measured) and a coarser one (8 at 13: twice the measured error): the
    largest error is under an eighth of the bound (a quarter for the coarser one), the median about 1/50."""
    cfg = Fp8GemmConfig(tile_m=16, tile_n=128, stages=2, swap_ab=True)
    a_q, s_a, w_q, s_w, tg, rg = make_problem(7, [1, 0, 3, 17, 2], 128, 2048, 16, zero_blocks=True)
    out = emulate_tensor_core(a_q, s_a, w_q[0], s_w[0], rg, every=every, bits=bits)
    assert check_within_bound(cfg, out, a_q, s_a, w_q, s_w, rg) < share


def test_bound_tells_a_wrong_operand_from_rounding():
    """The bound is not vacuous: the oracle with a tile's rows read against the next group's weights, one K block's
    weight scales from the wrong column block, or the last K block left out, breaks it at most elements; partials
    rounded to bf16 before their promotion fail the check."""
    a_q, s_a, w_q, s_w, tg, rg = make_problem(7, [1, 0, 3, 17, 2], 256, 1024, 16)
    (w,), (s,) = w_q, s_w
    want = reference.oracle(a_q, s_a, w, s, rg)
    bound = accumulation_bound(Fp8GemmConfig(tile_m=16, swap_ab=True), a_q, s_a, w_q, s_w, rg)
    live = rg >= 0
    wrong_group = reference.oracle(a_q, s_a, w, s, np.where(live, (rg + 1) % len(w), -1))
    wrong_scale = reference.oracle(a_q, s_a, w, s.at[:, :, 3].set(jnp.roll(s[:, :, 3], 1, axis=1)), rg)
    short = reference.oracle(a_q[:, :-128], s_a[:, :-1], w[:, :, :-128], s[:, :, :-1], rg)
    for bad, share in ((wrong_group, 0.9), (wrong_scale, 0.7), (short, 0.9)):
        assert np.mean(np.abs(bad - want)[live] > bound[live]) > share
    cfg = Fp8GemmConfig(tile_m=16, swap_ab=True)
    bf16_partials = emulate_tensor_core(a_q, s_a, w, s, rg, every=128, bits=7)  # each block's partial in bf16
    with pytest.raises(AssertionError):
        check_within_bound(cfg, bf16_partials, a_q, s_a, w_q, s_w, rg)


# name: (config, group sizes, N, K)
GPU_CASES = {
    "prefill_128": (fp8_config.PREFILL, [300, 0, 1, 129, 64, 0, 7], 512, 6144),
    "prefill_256": (Fp8GemmConfig(tile_n=256, stages=3), [1, 200, 0, 128, 33], 512, 2048),
    "prefill_m_sub2": (Fp8GemmConfig(tile_m=256, tile_n=128, stages=3, m_sub=2), [300, 0, 1, 256], 256, 6144),
    "prefill_swiglu": (fp8_config.PREFILL_SWIGLU, [200, 0, 1, 128], 256, 6144),
    "prefill_swiglu_narrow": (fp8_config.PREFILL_SWIGLU_NARROW, [200, 0, 1, 128], 256, 6144),
    "decode_swap16": (fp8_config.DECODE, [1, 0, 3, 17, 0, 2, 40, 1], 256, 6144),
    "decode_swap8": (Fp8GemmConfig(tile_m=8, tile_n=128, stages=6, swap_ab=True), [1, 0, 2, 9, 1], 512, 2048),
    "decode_swap_swiglu": (fp8_config.DECODE_SWIGLU, [1, 0, 3, 17, 0, 2, 40, 1], 256, 6144),
    "decode_swap_swiglu8": (Fp8GemmConfig(tile_m=8, tile_n=256, stages=6, swap_ab=True, swiglu=True),
                            [1, 0, 2, 9, 1], 256, 2048),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_kernel_matches_oracle(name):
    """The native kernel within the accumulation bound of the float64 oracle (float32 output), zeros in unused
    tiles, the same bits twice (no race); bf16 output within one more bf16 rounding."""
    cfg, sizes, n, k = GPU_CASES[name]
    a_q, s_a, w_q, s_w, tg, rg = make_problem(7, sizes, n, k, cfg.tile_m, zero_blocks=True, operands=cfg.n_operands)
    run = functools.partial(fp8_gemm.grouped_matmul, a_q, s_a, *weights_of(cfg, w_q, s_w), tg, impl="mosaic",
                            config=cfg)
    out = run(out_dtype=jnp.float32)
    worst = check_within_bound(cfg, out, a_q, s_a, w_q, s_w, rg)
    rel = rel_err(out, oracle_out(cfg, a_q, s_a, w_q, s_w, rg))
    print(f"{name}: largest error / bound {worst:.3g}, relative error {rel:.3g}")
    assert not np.asarray(out)[rg < 0].any()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(run(out_dtype=jnp.float32)))
    bf = np.asarray(run(out_dtype=jnp.bfloat16).astype(jnp.float32), np.float64)
    assert np.all(np.abs(bf - np.asarray(out, np.float64)) <= 2.0 ** -8 * np.abs(np.asarray(out, np.float64)))


@pytest.mark.gpu
def test_gpu_quantize_rows_is_the_rule():
    """On the device (XLA's GPU fusions of the float64 reciprocal form) bit for bit the numpy rule."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((4096, 2048)) * np.exp(4 * rng.standard_normal((4096, 1)))).astype(np.float32)
    x[5, :3] = 1e4
    for dtype in (jnp.float32, jnp.bfloat16):
        _quantize_rows_is_numpys(jnp.asarray(x, dtype))
