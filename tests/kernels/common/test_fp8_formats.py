"""FP8 cache formats (docs/math.md §3) against hand-written numpy (ml_dtypes) references."""

import math

import ml_dtypes
import numpy as np
import jax.numpy as jnp
import pytest

from kernels import fp8_formats as f8

E4M3 = ml_dtypes.float8_e4m3fn


def np_quant_mla(kv, k_pe):
    """numpy reference of one fp8_ds_mla row per token."""
    n, r = kv.shape
    tile = 128 if r % 128 == 0 else r
    out = []
    for i in range(n):
        q_parts, scales = [], []
        for t0 in range(0, r, tile):
            x = kv[i, t0:t0 + tile].astype(np.float32)
            s = np.float32(max(np.float32(np.abs(x).max()) / np.float32(448.0), np.float32(1.1754944e-38)))
            q_parts.append(np.clip(x / s, -448, 448).astype(E4M3))
            scales.append(s)
        row = (np.concatenate(q_parts).view(np.uint8).tobytes() + np.array(scales, np.float32).tobytes()
               + k_pe[i].astype(ml_dtypes.bfloat16).tobytes())
        out.append(np.frombuffer(row, np.uint8))
    return np.stack(out)


def np_ue8m0(amax):
    x = max(float(np.float32(max(amax, np.float32(1e-4))) / np.float32(448.0)), 0.0)
    x = float(np.float32(x))
    return np.float32(2.0 ** math.ceil(math.log2(x)))


def np_quant_index(k):
    out = []
    for i in range(k.shape[0]):
        x = k[i].astype(np.float32)
        s = np_ue8m0(np.float32(np.abs(x).max()))
        q = np.clip(x / s, -448, 448).astype(E4M3)
        out.append(np.frombuffer(q.view(np.uint8).tobytes() + np.array([s], np.float32).tobytes(), np.uint8))
    return np.stack(out)


def test_row_bytes():
    assert f8.mla_row_bytes(512, 64) == 656
    assert f8.mla_num_tiles(512) == 4 and f8.mla_tile(512) == 128
    assert f8.mla_tile(32) == 32 and f8.mla_row_bytes(32, 16) == 32 + 4 + 32
    assert f8.mla_row_bytes(64, 16) == 64 + 4 + 32
    assert f8.index_row_bytes(128) == 132


@pytest.mark.parametrize("r,dr", [(512, 64), (32, 16), (64, 16)])
def test_mla_rows_match_numpy_and_round_trip(r, dr):
    rng = np.random.default_rng(r)
    kv = (rng.normal(size=(9, r)) * rng.uniform(0.01, 30, size=(9, 1))).astype(np.float32)
    kv[2] = 0.0  # all-zero row: scale floors at the smallest normal, values stay 0
    kv[3, :5] = 1e4  # a large outlier in the first tile
    k_pe = rng.normal(size=(9, dr)).astype(np.float32)
    rows = np.asarray(f8.quantize_mla_rows(jnp.asarray(kv), jnp.asarray(k_pe)))
    ref = np_quant_mla(kv, k_pe)
    assert rows.dtype == np.uint8 and rows.shape == (9, f8.mla_row_bytes(r, dr))
    np.testing.assert_array_equal(rows, ref)  # bytes identical: fp8 codes, scales and bf16 exact

    q, scale, kpe_b = f8.split_mla_rows(jnp.asarray(rows), r, dr)
    tile = f8.mla_tile(r)
    amax = np.abs(kv.reshape(9, -1, tile)).max(-1)
    np.testing.assert_array_equal(np.asarray(scale), np.maximum(amax / np.float32(448), np.float32(1.1754944e-38)))
    kv_d, kpe_d = f8.dequantize_mla_rows(jnp.asarray(rows), r, dr)
    np.testing.assert_array_equal(np.asarray(kpe_d).astype(np.float32),
                                  k_pe.astype(ml_dtypes.bfloat16).astype(np.float32))
    # e4m3 has a 3-bit mantissa: relative error <= 2^-4 for normals; subnormal floor 2^-9 * scale.
    s_full = np.repeat(np.asarray(scale), tile, axis=-1)
    err = np.abs(np.asarray(kv_d) - kv)
    assert np.all(err <= np.abs(kv) * 2.0 ** -4 + s_full * 2.0 ** -10 + 1e-30)
    assert np.all(np.asarray(kv_d)[2] == 0)


def test_index_rows_match_numpy_and_round_trip():
    rng = np.random.default_rng(0)
    k = (rng.normal(size=(11, 128)) * rng.uniform(1e-6, 50, size=(11, 1))).astype(np.float32)
    k[0] = 0.0
    k[1, 0] = 448.0 * 0.25  # amax / 448 an exact power of two: ceil(log2) must not round up
    k[1, 1:] = 0.01
    rows = np.asarray(f8.quantize_index_rows(jnp.asarray(k)))
    np.testing.assert_array_equal(rows, np_quant_index(k))
    q, s = f8.split_index_rows(jnp.asarray(rows), 128)
    s = np.asarray(s)
    assert s[1] == 0.25
    assert s[0] == np_ue8m0(0.0)  # amax floor 1e-4
    mant = s.view(np.int32) & 0x7FFFFF
    assert np.all(mant == 0)  # powers of two
    back = np.asarray(f8.dequantize_index_rows(jnp.asarray(rows), 128))
    assert np.all(np.abs(back - k) <= np.abs(k) * 2.0 ** -4 + s[:, None] * 2.0 ** -10)


def test_index_queries():
    rng = np.random.default_rng(1)
    q = (rng.normal(size=(5, 4, 128)) * 3).astype(np.float32)
    qf, sq = f8.quantize_index_queries(jnp.asarray(q))
    assert qf.dtype == jnp.float8_e4m3fn and sq.shape == (5, 4)
    for t in range(5):
        for h in range(4):
            s = np_ue8m0(np.float32(np.abs(q[t, h]).max()))
            assert np.asarray(sq)[t, h] == s
            np.testing.assert_array_equal(np.asarray(qf)[t, h].view(np.uint8),
                                          np.clip(q[t, h] / s, -448, 448).astype(E4M3).view(np.uint8))


def test_ue8m0_edges():
    amax = np.array([0.0, 1e-4, 448.0, 448.0 * 2 ** -3, 448.0 * 1.0000001, 1e6], np.float32)
    s = np.asarray(f8.ue8m0_scale(jnp.asarray(amax)))
    np.testing.assert_array_equal(s, np.array([np_ue8m0(a) for a in amax], np.float32))
    assert s[2] == 1.0 and s[3] == 0.125 and s[4] == 2.0


def test_ue8m0_at_power_of_two_boundaries():
    """The division-free UE8M0 rule equals ceil(log2(fl(m / 448))) (IEEE) around every boundary 448 * 2^k."""
    k = np.arange(-13, 20, dtype=np.float64)
    base = (448.0 * 2.0 ** k).astype(np.float32)
    m = np.concatenate([np.nextafter(base, np.float32(0)), base, np.nextafter(base, np.float32(np.inf)),
                        np.random.default_rng(5).uniform(1e-4, 1e5, 2000).astype(np.float32)]).astype(np.float32)
    want = np.exp2(np.ceil(np.log2((np.maximum(m, np.float32(1e-4)) / np.float32(448)).astype(np.float64))))
    np.testing.assert_array_equal(np.asarray(f8.ue8m0_scale(jnp.asarray(m))), want.astype(np.float32))


def test_e4m3_helpers_match_ml_dtypes():
    """to_e4m3 / e4m3_bits (saturating, RNE) and decode_e4m3_bits (every one of the 256 codes) against ml_dtypes."""
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.normal(size=500) * 100, [0.0, -0.0, 448.0, 449.0, -1e6, 1e-9, 464.0]]).astype(np.float32)
    want = np.clip(x, -448, 448).astype(E4M3)
    np.testing.assert_array_equal(np.asarray(f8.e4m3_bits(jnp.asarray(x))), want.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(f8.to_e4m3(jnp.asarray(x))).view(np.uint8), want.view(np.uint8))
    codes = np.arange(256, dtype=np.uint8)
    finite = ~np.isnan(codes.view(E4M3).astype(np.float32))
    for dtype in (jnp.float32, jnp.bfloat16):
        got = np.asarray(f8.decode_e4m3_bits(jnp.asarray(codes), dtype)).astype(np.float32)
        np.testing.assert_array_equal(got[finite], codes.view(E4M3).astype(np.float32)[finite])
    np.testing.assert_array_equal(np.asarray(f8.e4m3_to_f32(jnp.asarray(codes).view(jnp.float8_e4m3fn)))[finite],
                                  codes.view(E4M3).astype(np.float32)[finite])


def test_ue8m0_inverse_is_exact():
    amax = np.concatenate([[0.0, 1e-4, 448.0], np.random.default_rng(4).uniform(1e-3, 1e5, 300)]).astype(np.float32)
    s, inv = (np.asarray(a) for a in f8.ue8m0_scale_and_inverse(jnp.asarray(amax)))
    np.testing.assert_array_equal(s, np.asarray(f8.ue8m0_scale(jnp.asarray(amax))))
    np.testing.assert_array_equal(s * inv, np.ones_like(s))  # powers of two: the product is exactly 1


def test_row_widths_are_checked_by_name():
    with pytest.raises(ValueError, match="split_mla_rows: rows of 60 bytes.*= 68"):
        f8.split_mla_rows(jnp.zeros((2, 60), jnp.uint8), 32, 16)
    with pytest.raises(ValueError, match="split_index_rows: rows of 40 bytes.*= 36"):
        f8.split_index_rows(jnp.zeros((2, 40), jnp.uint8), 32)
