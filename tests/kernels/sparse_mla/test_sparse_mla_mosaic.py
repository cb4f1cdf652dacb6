"""The Pallas Mosaic GPU sparse MLA kernel (kernels/sparse_mla/mosaic.py) against float64 numpy and the xla oracle.

On CPU the kernel runs in Pallas' GPU interpreter (the TMA producer; the cp.async and fp8 producers are Lane code,
which only the GPU runs) at a small latent (R = 128); on the GPU (marker `gpu`) natively at GLM-5 dims for both
caches and both bf16 producers. Also: the launch config's validation, the shapes the kernel refuses, and the
"auto" rule that picks it."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import fp8_formats, registry, sparse_mla
from kernels.sparse_mla import mosaic as sparse_mla_mosaic
from test_sparse_mla import np_attention

R_SMALL, DR = 128, 64


def _inputs(t, h, k, n, *, seed, r=R_SMALL, fp8=False):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(t, h, r + DR)).astype(np.float32)
    c = rng.normal(size=(n, r + DR)).astype(np.float32) * rng.uniform(0.5, 2.0, size=(n, 1)).astype(np.float32)
    idx = rng.integers(0, n, size=(t, k)).astype(np.int32)
    idx[rng.uniform(size=(t, k)) < 0.2] = -1
    if t > 1:  # (a single row keeps its valid indices: the test would otherwise compare zeros)
        idx[0] = -1  # no valid index: (0, -inf)
    if t > 1:
        idx[1, :9] = idx[1, 0] if idx[1, 0] >= 0 else 3  # duplicates count twice
    if t > 2:
        idx[2, 1:] = -1  # one valid index
        idx[2, 0] = 5
    q = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))  # the values the kernel sees
    if fp8:
        cache = fp8_formats.quantize_mla_rows(jnp.asarray(c[:, :r]), jnp.asarray(c[:, r:]))
    else:
        cache = jnp.asarray(c, jnp.bfloat16)
    return q, cache, idx


def _run(impl, q, cache, idx, *, r, **kw):
    f = functools.partial(sparse_mla.sparse_mla, scale=0.0625, kv_lora_rank=r, impl=impl, **kw)
    o, lse = jax.jit(f)(jnp.asarray(q, jnp.bfloat16), cache, jnp.asarray(idx))
    return np.asarray(o), np.asarray(lse)


def _check_against_numpy(o, lse, q, cache_f32, idx, r, tol=2e-2):
    o_ref, lse_ref = np_attention(q, cache_f32, idx, 0.0625, r)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    assert np.all(o[np.isneginf(lse_ref)] == 0)
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], atol=tol, rtol=tol)
    assert np.linalg.norm(o_ref) > 0, "the case has no valid index at all: nothing to compare"
    rel = np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref)
    assert rel < tol, rel


def _oracle_rows(cache, r):
    """The rows the kernel's tiles hold, in float32 for the numpy oracle: a bf16 cache as it is; an fp8_ds_mla
    cache exactly dequantised, its latent rounded to bf16 as the fp8 producer's tiles are (the rope part is bf16)."""
    if cache.dtype != jnp.uint8:
        return np.asarray(cache.astype(jnp.float32))
    kv, pe = fp8_formats.dequantize_mla_rows(cache, r, DR)
    return np.asarray(jnp.concatenate([kv.astype(jnp.bfloat16), pe], -1).astype(jnp.float32))


SCHEDULES = {"plain": {"share_p": False}, "share_p": {"share_p": True}}


@pytest.mark.parametrize("t,h,k,n_split,schedule", [(3, 4, 64, 1, "plain"), (3, 16, 200, 2, "plain"),
                                                    (4, 64, 128, 2, "plain"), (2, 1, 70, 3, "plain"),
                                                    (3, 8, 128, 1, "share_p"), (3, 16, 200, 2, "share_p")])
def test_interpreted_matches_numpy(t, h, k, n_split, schedule):
    """Heads padded to 64, K padded to whole 64-slot tiles (and to the splits), -1 slots, duplicates, an empty
    row and a row whose only slot falls in one split (the other splits' partials are the merge identity); both
    K buffers in use (`test_interpreted_ring_wrap_has_no_race` refills them; the GPU tests below run 32 tiles
    per CTA)."""
    q, cache, idx = _inputs(t, h, k, 300, seed=t * h + k)
    o, lse = _run("mosaic_interpret", q, cache, idx, r=R_SMALL, n_split=n_split, **SCHEDULES[schedule])
    assert o.shape == (t, h, R_SMALL) and lse.shape == (t, h) and o.dtype == np.float32
    _check_against_numpy(o, lse, q, np.asarray(cache.astype(jnp.float32)), idx, R_SMALL)


def test_interpreted_ring_wrap_has_no_race(mosaic_races):
    """share_p with the slot ids in shared memory: four tiles through the two K buffers and the two slot-id
    buffers, each refilled by the producer's TMA once the consumers free it, under the interpreter's race detector
    (`mosaic_races`). The producer reads a tile's slot ids by plain loads (the generic proxy) and refills their
    buffer by TMA (the async proxy) two tiles later; consumer 0's `commit_smem` (before it hands P over) lies
    between the two through `k_ready` and `k_free` (without it the detector reports the refill). No race reported,
    and the values right."""
    q, cache, idx = _inputs(2, 4, 256, 300, seed=11)
    f = functools.partial(sparse_mla_mosaic.sparse_mla_mosaic, scale=0.0625, kv_lora_rank=R_SMALL, interpret=True,
                          n_split=1, producer="tma", slot_source="smem", share_p=True)
    (o, lse), races = mosaic_races(lambda: f(jnp.asarray(q, jnp.bfloat16), cache, jnp.asarray(idx)))
    assert not races
    _check_against_numpy(np.asarray(o), np.asarray(lse), q, np.asarray(cache.astype(jnp.float32)), idx, R_SMALL)


def test_interpreted_partials_merge_to_the_whole():
    q, cache, idx = _inputs(3, 8, 128, 200, seed=5)
    kw = dict(scale=0.0625, kv_lora_rank=R_SMALL, interpret=True, n_split=2)
    o_s, lse_s = sparse_mla_mosaic.sparse_mla_mosaic(jnp.asarray(q, jnp.bfloat16), cache, jnp.asarray(idx),
                                                     return_partials=True, **kw)
    assert o_s.shape == (2, 3, 8, R_SMALL) and lse_s.shape == (2, 3, 8)
    whole = [_run("xla", q, cache, idx[:, s], r=R_SMALL) for s in (slice(0, 64), slice(64, 128))]
    for i in range(2):  # split i attends exactly its own 64 slots
        np.testing.assert_allclose(np.asarray(lse_s[i]), whole[i][1], atol=2e-2)
        np.testing.assert_allclose(np.asarray(o_s[i]), whole[i][0], atol=3e-2)


def _padded_case(real, pad, h, k, *, seed, fp8=False, r=R_SMALL):
    """`real` query rows (row 0 with slots in its first split only, row 1 in its last split only when k > 64, the
    others random with -1 among them) followed by `pad` padding rows (every slot -1), as a decode step padded to
    its fixed rows sees them."""
    q, cache, idx = _inputs(real + pad, h, k, 300, seed=seed, r=r, fp8=fp8)
    rng = np.random.default_rng(seed + 1)
    idx[:real] = rng.integers(0, 300, size=(real, k))
    idx[:real][rng.uniform(size=(real, k)) < 0.2] = -1
    if k > 64:
        idx[0, 64:] = -1  # a split with no valid slot in a real row (a short context's tail)
        idx[1, :64] = -1
    idx[real:] = -1
    return q, cache, idx


def _mosaic(q, cache, idx, *, skip_empty=True, return_partials=False, **cfg):
    config = sparse_mla_mosaic.MosaicSparseMLAConfig(**cfg)
    o, lse = sparse_mla_mosaic._run(jnp.asarray(q, jnp.bfloat16), cache, jnp.asarray(idx), scale=0.0625,
                                    kv_lora_rank=R_SMALL, config=config, interpret=True,
                                    return_partials=return_partials, hooks=sparse_mla_mosaic.Hooks(),
                                    skip_empty=skip_empty)
    return np.asarray(o), np.asarray(lse)


def _bitwise(a, b):
    np.testing.assert_array_equal(a[0].view(np.uint32), b[0].view(np.uint32))
    np.testing.assert_array_equal(a[1].view(np.uint32), b[1].view(np.uint32))


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("n_split,merge", [(1, "launch"), (2, "launch"), (2, "xla")])
def test_empty_splits_are_skipped_bit_for_bit(schedule, n_split, merge):
    """A (row, split) with no valid slot skips its work and writes lse -inf (and o = 0 where the partials are the
    result): every row bit for bit what the full schedule gives (skip_empty=False: every split run as before), the
    real rows bit for bit the same rows without the padding rows, and all of it against float64 numpy (SPEC §5:
    a row with no valid index is (0, -inf)). The interpreter fills memory a kernel does not write with NaN, so a
    merge that read the o a skipped split leaves unwritten would show it."""
    assert plgpu_interpret_params().uninitialized_memory == "nan"
    real, pad, h, k = 3, 5, 8, 128
    q, cache, idx = _padded_case(real, pad, h, k, seed=21)
    cfg = dict(n_split=n_split, merge=merge, **SCHEDULES[schedule])
    got = _mosaic(q, cache, idx, **cfg)
    _bitwise(got, _mosaic(q, cache, idx, skip_empty=False, **cfg))
    alone = _mosaic(q[:real], cache, idx[:real], **cfg)
    _bitwise((got[0][:real], got[1][:real]), alone)
    o, lse = got
    assert np.all(o[real:] == 0) and not np.signbit(o[real:]).any() and np.all(np.isneginf(lse[real:]))
    _check_against_numpy(o[:, :h], lse[:, :h], q, np.asarray(cache.astype(jnp.float32)), idx, R_SMALL)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_skipped_splits_partials_are_the_merge_identity(schedule):
    """Asked for the partials, a skipped split writes exactly (+0, -inf) in both consumers' halves of o (nothing left
    unwritten, which the interpreter would show as NaN), bit for bit the full schedule's partials."""
    real, pad, h, k = 2, 2, 4, 128
    q, cache, idx = _padded_case(real, pad, h, k, seed=8)
    cfg = dict(n_split=2, **SCHEDULES[schedule])
    o, lse = _mosaic(q, cache, idx, return_partials=True, **cfg)
    _bitwise((o, lse), _mosaic(q, cache, idx, return_partials=True, skip_empty=False, **cfg))
    empty = ~(np.asarray(idx).reshape(real + pad, 2, 64) >= 0).any(-1).T  # [split, row]
    assert empty[1, 0] and empty[0, 1] and empty[:, real:].all() and not empty[0, 0]
    assert np.all(o[empty] == 0) and not np.signbit(o[empty]).any() and np.all(np.isneginf(lse[empty]))
    assert np.isfinite(lse[~empty][:, :h]).all()


def plgpu_interpret_params():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.InterpretGPUParams()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("share_p", [False, True])
def test_skip_lowers_for_the_device(fp8, share_p):
    """The skip (a scalar read of the CTA's flag in each warpgroup, the work under one branch, the empty split's
    stores) lowers for CUDA on CPU for both caches and schedules at GLM-5 dims, with the merge and the partials."""
    from kernels.common.triton_common import lower_for_gpu
    sd = jax.ShapeDtypeStruct
    cache = sd((4096, 656), jnp.uint8) if fp8 else sd((4096, 576), jnp.bfloat16)
    for partials in (False, True):
        text = lower_for_gpu(functools.partial(sparse_mla_mosaic.sparse_mla_mosaic, scale=0.0625, kv_lora_rank=512,
                                               share_p=share_p, n_split=2, return_partials=partials),
                             sd((8, 64, 576), jnp.bfloat16), cache, sd((8, 2048), jnp.int32))
        assert "mosaic_gpu" in text


def test_config_is_validated():
    with pytest.raises(ValueError, match="n_split must be >= 1"):
        sparse_mla_mosaic.MosaicSparseMLAConfig(n_split=0)
    with pytest.raises(ValueError, match="must be <= 504"):
        sparse_mla_mosaic.MosaicSparseMLAConfig(consumer_registers=240, producer_registers=40)
    with pytest.raises(ValueError, match="producer must be 'cp_async' or 'tma'"):
        sparse_mla_mosaic.MosaicSparseMLAConfig(producer="ldg")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="l2_prefetch must be an int >= 0"):
            sparse_mla_mosaic.MosaicSparseMLAConfig(l2_prefetch=bad)
    # registers: setmaxnreg's multiples of 8 in [24, 256]; the follower's own count under share_p only; the sum
    for name, bad in (("producer_registers", 20), ("consumer_registers", 212), ("follower_registers", 264)):
        with pytest.raises(ValueError, match=f"{name} must be a multiple of 8 in \\[24, 256\\], got {bad}"):
            sparse_mla_mosaic.MosaicSparseMLAConfig(**{name: bad})
    # setmaxnreg only raises a consumer's count from the launch's 168 and only lowers the producer's (a follower
    # at 160 was an illegal instruction on the H200)
    assert sparse_mla_mosaic.LAUNCH_REGISTERS == 168
    with pytest.raises(ValueError, match="follower_registers must be >= 168 .* got 160"):
        sparse_mla_mosaic.MosaicSparseMLAConfig(follower_registers=160, producer_registers=128)
    with pytest.raises(ValueError, match="producer_registers must be <= 168 .* got 176"):
        sparse_mla_mosaic.MosaicSparseMLAConfig(consumer_registers=168, producer_registers=176)
    with pytest.raises(ValueError, match="follower_registers needs share_p"):
        sparse_mla_mosaic.MosaicSparseMLAConfig(follower_registers=168, share_p=False)
    with pytest.raises(ValueError, match="216 \\+ 184 \\+ 112 = 512"):
        sparse_mla_mosaic.MosaicSparseMLAConfig(consumer_registers=216, follower_registers=184,
                                                producer_registers=112)
    split = sparse_mla_mosaic.MosaicSparseMLAConfig(consumer_registers=216, follower_registers=168,
                                                    producer_registers=120)
    assert split.second_consumer_registers == 168
    assert sparse_mla_mosaic.MosaicSparseMLAConfig().second_consumer_registers == 232
    assert sparse_mla_mosaic.default_config(1, 2048).n_split == 32  # B = 1: the row's 32 tiles over 32 CTAs
    assert sparse_mla_mosaic.default_config(128, 2048).n_split == 1
    # the L2 prefetch where it was measured faster: a bf16 cache at one CTA a row
    assert sparse_mla_mosaic.default_config(128, 2048).l2_prefetch == 1
    assert sparse_mla_mosaic.default_config(32, 2048).l2_prefetch == 0
    assert sparse_mla_mosaic.default_config(128, 2048, fp8=True).l2_prefetch == 0
    # fp8_ds_mla: registers moved to the producer's loads and conversions
    fp8_cfg = sparse_mla_mosaic.default_config(32, 2048, fp8=True)
    assert (fp8_cfg.consumer_registers, fp8_cfg.second_consumer_registers, fp8_cfg.producer_registers) == (208, 168,
                                                                                                            128)
    # the fp8 producer's slot ids come a tile ahead through shared memory, in both schedules
    assert fp8_cfg.slot_source == "smem"
    assert sparse_mla_mosaic.default_config(128, 2048, fp8=True, share_p=False).slot_source == "smem"
    assert sparse_mla_mosaic.default_config(128, 2048).slot_source == "gmem"
    # the product config has no timing-only forms (they are benchmarks/diagnostics' hooks)
    assert "diagnostic" not in {f.name for f in dataclasses.fields(sparse_mla_mosaic.MosaicSparseMLAConfig)}


def test_plain_schedule_on_an_fp8_cache_takes_its_own_default():
    """share_p=False on the default config of an fp8_ds_mla cache is the plain schedule's default (both consumers
    at 184, the producer at 128), not the share_p split with its follower (which the plain schedule refuses): it
    builds and lowers for CUDA on CPU (a default that gave it the follower raised "follower_registers needs
    share_p")."""
    plain = sparse_mla_mosaic.default_config(32, 2048, fp8=True, share_p=False)
    assert (plain.share_p, plain.consumer_registers, plain.second_consumer_registers, plain.producer_registers) == (
        False, 184, 184, 128)
    assert not sparse_mla_mosaic.default_config(32, 2048, share_p=False).share_p
    from kernels.common.triton_common import lower_for_gpu
    sd = jax.ShapeDtypeStruct
    text = lower_for_gpu(functools.partial(sparse_mla.sparse_mla, scale=0.0625, kv_lora_rank=512, impl="mosaic",
                                           share_p=False),
                         sd((32, 64, 576), jnp.bfloat16), sd((4096, 656), jnp.uint8), sd((32, 2048), jnp.int32))
    assert "mosaic_gpu" in text


def test_fp8_slot_ids_from_shared_memory_lower():
    """Both fp8 schedules lower for CUDA on CPU with the slot ids read from gmem and from shared memory, and the
    default (smem) layout fits the H200's shared memory with share_p: 231496 of 232448 bytes."""
    from kernels.common.triton_common import lower_for_gpu
    sd = jax.ShapeDtypeStruct
    for share_p in (True, False):
        for source in ("gmem", "smem"):
            text = lower_for_gpu(functools.partial(sparse_mla_mosaic.sparse_mla_mosaic, scale=0.0625,
                                                   kv_lora_rank=512, share_p=share_p, slot_source=source),
                                 sd((4, 64, 576), jnp.bfloat16), sd((4096, 656), jnp.uint8), sd((4, 256), jnp.int32))
            assert "cvt.rn.f16x2.e4m3x2" in text
    cfg = sparse_mla_mosaic.default_config(128, 2048, fp8=True)
    assert sparse_mla_mosaic.shared_memory_bytes(576, cfg) == 231496 <= sparse_mla_mosaic.SMEM_LIMIT


def test_shapes_the_kernel_does_not_take_are_refused():
    z = jnp.zeros
    q = z((2, 4, 192), jnp.bfloat16)
    with pytest.raises(ValueError, match="impl 'mosaic' does not support these inputs: query heads must be <= 64"):
        sparse_mla.sparse_mla(z((2, 65, 192), jnp.bfloat16), z((8, 192), jnp.bfloat16), z((2, 4), jnp.int32),
                              scale=0.1, kv_lora_rank=128, impl="mosaic")
    with pytest.raises(ValueError, match="kv_lora_rank 96 must be a multiple of 128"):
        sparse_mla.sparse_mla(z((2, 4, 160), jnp.bfloat16), z((8, 160), jnp.bfloat16), z((2, 4), jnp.int32),
                              scale=0.1, kv_lora_rank=96, impl="mosaic")
    with pytest.raises(ValueError, match="bf16 or fp8_ds_mla"):
        sparse_mla.sparse_mla(q.astype(jnp.float32), z((8, 192), jnp.float32), z((2, 4), jnp.int32), scale=0.1,
                              kv_lora_rank=128, impl="mosaic")
    with pytest.raises(ValueError, match="GPU interpreter cannot run"):
        sparse_mla_mosaic.sparse_mla_mosaic(q, z((8, 128 + 4 + 128), jnp.uint8), z((2, 4), jnp.int32), scale=0.1,
                                            kv_lora_rank=128, interpret=True)
    # fp8_ds_mla rows the producer's 16-byte loads cannot read: at R = 128 a row is 260 bytes, so three rows in four
    # row starts off a 16-byte boundary (a misaligned-address fault on the device); refused for the device path
    q128 = z((2, 4, 128 + 64), jnp.bfloat16)
    why = sparse_mla_mosaic.supports(q128, z((8, 260), jnp.uint8), z((2, 4), jnp.int32), kv_lora_rank=128)
    assert why is not None and "260 bytes are not 16-byte aligned" in why
    q512 = z((2, 4, 512 + 64), jnp.bfloat16)
    assert sparse_mla_mosaic.supports(q512, z((8, 656), jnp.uint8), z((2, 4), jnp.int32), kv_lora_rank=512) is None


def test_auto_rule_picks_registered_impls():
    """The "auto" rule names an impl that takes the inputs: the Mosaic kernel only where it supports them."""
    z = jnp.zeros
    args = (z((32, 64, 576), jnp.bfloat16), z((8, 576), jnp.bfloat16), z((32, 2048), jnp.int32))
    chosen = registry.resolve("sparse_mla", "auto", *args, scale=0.1, kv_lora_rank=512)
    assert chosen in registry.impls("sparse_mla") and chosen != "auto"
    wide = (z((4, 128, 576), jnp.bfloat16), z((8, 576), jnp.bfloat16), z((4, 2048), jnp.int32))
    assert registry.resolve("sparse_mla", "auto", *wide, scale=0.1, kv_lora_rank=512) != "mosaic"
    assert registry.resolve("sparse_mla", "auto", *wide, scale=0.1, kv_lora_rank=512) == (
        "triton" if registry.on_gpu() else "xla")


# ------------------------------------------------------------------------------ GPU (native Mosaic GPU)

@pytest.mark.gpu
@pytest.mark.parametrize("fp8,producer", [(False, "cp_async"), (False, "tma"), (True, "cp_async")])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("t,h,k", [(1, 64, 2048), (32, 64, 2048), (128, 64, 2048), (33, 16, 2000)])
def test_gpu_glm5_shapes(t, h, k, fp8, producer, schedule):
    """fp8_ds_mla has one producer (its Lane code dequantises as it gathers)."""
    q, cache, idx = _inputs(t, h, k, 200_000, seed=t + h, r=512, fp8=fp8)
    o, lse = _run("mosaic", q, cache, idx, r=512, producer=producer, **SCHEDULES[schedule])
    _check_against_numpy(o, lse, q, _oracle_rows(cache, 512), idx, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("t,k,ahead", [(32, 2048, 1), (1, 2048, 2), (33, 2000, 3), (128, 2048, 2)])
def test_gpu_l2_prefetch(t, k, ahead, fp8):
    """Asking L2 for later tiles' rows changes no value: against numpy, and bit for bit against no prefetch
    (prefetches past a split's last tile and for slot -1 are not issued: a stray one would fault or not, but the
    second check would still catch a producer that read the wrong tile). fp8_ds_mla ignores the option."""
    q, cache, idx = _inputs(t, 64, k, 200_000, seed=t + k, r=512, fp8=fp8)
    o, lse = _run("mosaic", q, cache, idx, r=512, l2_prefetch=ahead)
    o0, lse0 = _run("mosaic", q, cache, idx, r=512, l2_prefetch=0)
    _check_against_numpy(o, lse, q, _oracle_rows(cache, 512), idx, 512)
    np.testing.assert_array_equal(o, o0)
    np.testing.assert_array_equal(lse, lse0)


@pytest.mark.gpu
def test_gpu_fp8_takes_its_own_producer():
    """An fp8_ds_mla cache always goes through its Lane-code producer, whatever `producer` names: with "tma" the
    tile barrier once waited for one TMA arrival per copy, which that producer never makes (a hang)."""
    q, cache, idx = _inputs(4, 64, 256, 5000, seed=9, r=512, fp8=True)
    o, lse = _run("mosaic", q, cache, idx, r=512, producer="tma")
    o1, lse1 = _run("mosaic", q, cache, idx, r=512, producer="cp_async")
    np.testing.assert_array_equal(o, o1)
    np.testing.assert_array_equal(lse, lse1)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("t,k", [(128, 2048), (32, 2048), (33, 2000), (3, 64)])
def test_gpu_fp8_slot_ids_from_shared_memory(t, k, schedule):
    """The fp8 producer's slot ids fetched a tile ahead into shared memory (the default) give the values read
    from gmem give: against numpy, and bit for bit. Shapes: one CTA a row (32 tiles through both id buffers),
    four splits a row, a row that is not whole tiles (2000: the last tile's ids padded with -1), a single tile
    (no fetch ahead)."""
    q, cache, idx = _inputs(t, 64, k, 200_000, seed=5 + t + k, r=512, fp8=True)
    o, lse = _run("mosaic", q, cache, idx, r=512, slot_source="smem", **SCHEDULES[schedule])
    o0, lse0 = _run("mosaic", q, cache, idx, r=512, slot_source="gmem", **SCHEDULES[schedule])
    _check_against_numpy(o, lse, q, _oracle_rows(cache, 512), idx, 512)
    np.testing.assert_array_equal(o, o0)
    np.testing.assert_array_equal(lse, lse0)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [4, 128])
def test_gpu_fp8_slot_minus_one_reads_no_garbage(t):
    """Slot -1 makes the fp8 producer read row 0 and zero what it read. Row 0 here is all 0xFF bytes: NaN e4m3
    values and NaN tile scales, so a zero made by multiplying (NaN x 0) instead of selecting shows as NaN.
    Row 0 is never selected for real; the oracle sees the other rows only."""
    q, cache, idx = _inputs(t, 64, 2048, 20_000, seed=11 + t, r=512, fp8=True)
    idx = np.where(idx == 0, 1, idx)
    cache = cache.at[0].set(jnp.full((cache.shape[1],), 0xFF, jnp.uint8))
    o, lse = _run("mosaic", q, cache, idx, r=512)
    cache_f32 = _oracle_rows(cache[1:], 512)
    cache_f32 = np.concatenate([np.zeros_like(cache_f32[:1]), cache_f32])  # row 0: never attended
    _check_against_numpy(o, lse, q, cache_f32, idx, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("consumer,follower,producer", [(216, 168, 120), (216, 184, 104), (208, None, 88),
                                                        (216, None, 72), (200, 168, 136)])
def test_gpu_register_splits_change_no_value(fp8, consumer, follower, producer):
    """Registers moved between the consumers and the producer change no value: bit for bit the default split, at
    B = 32 (four splits a row) and 128."""
    for t in (32, 128):
        q, cache, idx = _inputs(t, 64, 2048, 200_000, seed=3 + t, r=512, fp8=fp8)
        o, lse = _run("mosaic", q, cache, idx, r=512, consumer_registers=consumer, follower_registers=follower,
                      producer_registers=producer)
        o0, lse0 = _run("mosaic", q, cache, idx, r=512)
        np.testing.assert_array_equal(o, o0)
        np.testing.assert_array_equal(lse, lse0)


def test_shared_memory_estimate_and_refusal():
    """The native kernel's shared memory, by hand: at GLM-5's 576 columns q is 73728 bytes and the two K tiles
    147456; share_p adds P (8192) and its statistics (512, a 1024-byte allocation) and drops Mosaic's 2048-byte
    reduction scratch; the slot tiles (512, a 1024-byte allocation) come only with slot_source "smem"; 8 bytes a
    barrier (5, + 2 with share_p, + 2 with the slot tiles). Each equals what Mosaic GPU's lowering counts (lowered
    for CUDA on the CPU), and so does a 640-column row, over the H200's 232448 bytes. A config over the limit is
    refused by name before any lowering."""
    mk = sparse_mla_mosaic.MosaicSparseMLAConfig
    assert mk().share_p  # the default schedule (BENCHMARKS.md, sparse MLA)
    cases = {(576, mk(share_p=False)): 73728 + 147456 + 2048 + 5 * 8,
             (576, mk(share_p=True)): 73728 + 147456 + 8192 + 1024 + 7 * 8,
             (576, mk(share_p=True, slot_source="smem")): 73728 + 147456 + 1024 + 8192 + 1024 + 9 * 8,
             (640, mk(share_p=False)): 81920 + 163840 + 2048 + 5 * 8}
    for (width, cfg), want in cases.items():
        assert sparse_mla_mosaic.shared_memory_bytes(width, cfg) == want, (width, cfg)
        assert sparse_mla_mosaic.lowered_smem_bytes(width, cfg) == want, (width, cfg)
    assert sparse_mla_mosaic.shared_memory_bytes(576, mk(share_p=True)) <= sparse_mla_mosaic.SMEM_LIMIT
    z = jnp.zeros
    with pytest.raises(ValueError, match="247848 bytes of shared memory.*share_p=False.*640 columns.*232448"):
        sparse_mla_mosaic.sparse_mla_mosaic(z((1, 64, 640), jnp.bfloat16), z((64, 640), jnp.bfloat16),
                                            z((1, 64), jnp.int32), scale=0.1, kv_lora_rank=512, share_p=False)
