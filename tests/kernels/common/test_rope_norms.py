"""RoPE, RMSNorm / LayerNorm and row chunking against hand-computed numpy."""

import jax.numpy as jnp
import numpy as np

from kernels import chunking, norms, rope


def test_rope_interleaved_and_neox_by_hand():
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    cos, sin = rope.rope_cos_sin(jnp.asarray([3]), 8, 10000.0)
    ang = 3 * 10000.0 ** (-np.arange(0, 8, 2) / 8)
    a, b = x[0, 0::2], x[0, 1::2]
    want = np.empty(8)
    want[0::2], want[1::2] = a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)
    np.testing.assert_allclose(np.asarray(rope.apply_rope(jnp.asarray(x), cos, sin))[0], want, rtol=1e-5, atol=1e-5)
    a, b = x[0, :4], x[0, 4:]
    want = np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)])
    got = rope.apply_rope(jnp.asarray(x), cos, sin, interleave=False)
    np.testing.assert_allclose(np.asarray(got)[0], want, rtol=1e-5, atol=1e-5)


def test_norms_match_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 24)).astype(np.float32) * 3
    w, b = rng.normal(size=24).astype(np.float32), rng.normal(size=24).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(np.asarray(norms.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6)), want, rtol=1e-5,
                               atol=1e-5)
    want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-6) * w + b
    got = norms.layer_norm(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), 1e-6)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert norms.rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), 1e-6).dtype == jnp.bfloat16


def test_row_chunking_equals_one_call():
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.normal(size=(37, 5)).astype(np.float32))
    b = jnp.asarray(rng.normal(size=(37,)).astype(np.float32))
    fn = lambda x, y: (x * y[:, None]).sum(-1)  # noqa: E731
    np.testing.assert_allclose(np.asarray(chunking.map_row_chunks(fn, (a, b), 8)), np.asarray(fn(a, b)), rtol=1e-5,
                               atol=1e-6)
