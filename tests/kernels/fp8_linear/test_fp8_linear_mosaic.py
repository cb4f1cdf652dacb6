"""The dense FP8 linear through the Mosaic GPU W8A8 grouped GEMM with one group (impl "mosaic" of the op
"fp8_linear", the op "fp8_swiglu", kernels/fp8_linear/mosaic.py): against a float64 numpy oracle of the W8A8 rule
(SPEC §11; `kernels.fp8_gemm.reference.oracle`) at small shapes with ragged widths (kv_a's 576 outputs, K of 300),
zero blocks, both tile layouts and both weight layouts; what it refuses; where the registry's rules pick it (a GPU,
and only where `fp8_linear.MOSAIC_ROWS` or GLM_DSA_FP8_LINEAR_MOSAIC names the row class), in the rule, in the
model's linears and SwiGLU MLPs, and in a traced model step.

On CPU the kernel runs under the Mosaic GPU interpreter."""

import functools
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from glm_dsa.model import linear
from kernels import fp8_formats, fp8_linear, registry
from kernels.fp8_gemm import reference
from kernels.fp8_linear import mosaic as fp8_linear_mosaic

_MOSAIC = "mosaic" if jax.default_backend() == "gpu" else "mosaic_interpret"


def _np_quantize_rows(x):
    """The activation rule in numpy float32: s_a = max(amax / 448, 2**-126), a_q = e4m3(x / s_a)."""
    m, k = x.shape
    xb = x.reshape(m, k // 128, 128)
    s = np.maximum(np.abs(xb).max(-1) / np.float32(448.0), np.float32(1.1754944e-38))
    q = np.clip(xb / s[..., None], -448, 448)
    return q.astype(ml_dtypes.float8_e4m3fn).reshape(m, k), s


def _oracle(x, w_q, w_s):
    """float64 [T, N] of the W8A8 rule for rows x [T, K] and the e4m3 weight w_q [N, K] with grid w_s: x and the
    weight zero-padded to the grid's whole blocks, then `reference.oracle` (one group)."""
    x = np.asarray(jnp.asarray(x, jnp.float32))
    (t, k), (n, _), (nb, kb) = x.shape, w_q.shape, w_s.shape
    xp = np.zeros((t, kb * 128), np.float32)
    xp[:, :k] = x
    a_q, s_a = _np_quantize_rows(xp)
    wp = np.zeros((nb * 128, kb * 128), ml_dtypes.float8_e4m3fn)
    wp[:n, :k] = np.asarray(w_q)
    return reference.oracle(a_q, s_a, wp[None], np.asarray(w_s)[None], np.zeros(t, np.int32))[:, :n]


def _weight(n, k, seed):
    """A block-quantised random weight [N, K] (rows scaled unevenly, one all-zero 128 x 128 block) and its grid."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(n, k)) * rng.uniform(0.05, 4.0, size=(n, 1))
    w[:128, 128:256] = 0.0
    return fp8_formats.quantize_weight_blocks(w)


def _rows(t, k, seed, dtype):
    """Rows of a wide dynamic range with whole zero 128-blocks (s_a at its floor) and one all-zero row."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(t, k)) * np.exp(rng.normal(size=(t, 1)))
    x[::3, :128] = 0.0
    x[-1] = 0.0
    return jnp.asarray(x, dtype)


def _done(y):
    """`y` once computed. An interpreted kernel's thread callbacks dispatch jax ops; eager jax ops issued while it is
    still in flight (async dispatch) can deadlock with them on the CPU client, so each result is waited for."""
    return jax.block_until_ready(y)


def _rel(a, b):
    return np.linalg.norm(np.asarray(jnp.asarray(a, jnp.float32), np.float64) - b) / np.linalg.norm(b)


def _given(w_q, w_s, w_layout):
    return (w_q.T, w_s.T) if w_layout == "kn" else (w_q, w_s)


# name: (T, N, K, w_layout, x dtype, layout the rule picks)
LINEAR = {
    "kv_a_576_decode": (5, 576, 256, "kn", jnp.float32, "swap_ab"),  # 512 + 64 outputs: N padded to 640
    "ragged_prefill": (70, 200, 300, "nk", jnp.float32, "grouped"),  # ragged N and K, rows padded to a 128-tile
    "bf16_decode": (16, 256, 256, "kn", jnp.bfloat16, "swap_ab"),
}


@pytest.mark.parametrize("name", sorted(LINEAR))
def test_linear_matches_the_w8a8_rule(name):
    """float32 rows: within float32 rounding of the oracle (exact e4m3 products summed in float32), and of the op's
    own W8A8 reference (impl "xla"); bf16 rows: one bf16 rounding. Zero rows give zeros."""
    t, n, k, w_layout, dtype, layout = LINEAR[name]
    w_q, w_s = _weight(n, k, seed=n + k)
    x = _rows(t, k, seed=t, dtype=dtype)
    with registry.record() as log:
        y = _done(fp8_linear.fp8_linear(x, *_given(w_q, w_s, w_layout), form="w8a8", impl=_MOSAIC,
                                        w_layout=w_layout))
    assert ("fp8_linear.mosaic_layout", layout) in {(d.rule, d.choice) for d in log}
    assert y.shape == (t, n) and y.dtype == dtype
    want = _oracle(x, w_q, w_s)
    assert _rel(y, want) < (1e-6 if dtype == jnp.float32 else 4e-3)
    assert not np.asarray(y.astype(jnp.float32))[-1].any()
    if dtype == jnp.float32:
        ref = fp8_linear.fp8_linear(x, *_given(w_q, w_s, w_layout), form="w8a8", impl="xla", w_layout=w_layout)
        assert _rel(y, np.asarray(ref, np.float64)) < 2e-6
    if layout == "grouped":  # the other layout (rows on wgmma's N side, 64-row tiles): the same numbers
        y2 = _done(fp8_linear.fp8_linear(x, *_given(w_q, w_s, w_layout), form="w8a8", impl=_MOSAIC,
                                         w_layout=w_layout, layout="swap_ab"))
        assert _rel(y2, want) < 1e-6


# name: (T, N, K, w_layout, x dtype, layout)
SWIGLU = {
    "decode_ragged_kn": (5, 200, 256, "kn", jnp.float32, "swap_ab"),
    "prefill_bf16": (64, 128, 256, "nk", jnp.bfloat16, "grouped"),
}


@pytest.mark.parametrize("name", sorted(SWIGLU))
def test_swiglu_matches_the_w8a8_rule(name):
    """silu(gate) * up of the two W8A8 products (one GEMM, the SwiGLU epilogue in float32): within float32
    rounding of the float64 oracle for float32 rows, one bf16 rounding for bf16 rows; and the op's reference."""
    t, n, k, w_layout, dtype, layout = SWIGLU[name]
    (gq, gs), (uq, us) = _weight(n, k, seed=1), _weight(n, k, seed=2)
    x = _rows(t, k, seed=3, dtype=dtype)
    (wg, sg), (wu, su) = _given(gq, gs, w_layout), _given(uq, us, w_layout)
    y = _done(fp8_linear.fp8_swiglu(x, wg, wu, sg, su, impl=_MOSAIC, w_layout=w_layout, layout=layout))
    assert y.shape == (t, n) and y.dtype == dtype
    want = reference.silu_mul(_oracle(x, gq, gs), _oracle(x, uq, us))
    assert _rel(y, want) < (1e-5 if dtype == jnp.float32 else 4e-3)
    ref = fp8_linear.fp8_swiglu(x, wg, wu, sg, su, impl="xla", w_layout=w_layout)
    assert _rel(ref, want) < (1e-5 if dtype == jnp.float32 else 4e-3)


def test_refuses_what_it_does_not_take():
    w_q, w_s = _weight(256, 256, seed=0)
    x = jnp.ones((4, 256), jnp.float32)
    with pytest.raises(ValueError, match="impl 'mosaic_interpret' does not support these inputs: form 'w8a16'"):
        fp8_linear.fp8_linear(x, w_q, w_s, impl="mosaic_interpret")
    with pytest.raises(ValueError, match="n_offset 64: the Mosaic kernel takes shards starting on a 128-block"):
        fp8_linear.fp8_linear(x, w_q[:192], w_s, form="w8a8", impl="mosaic_interpret", n_offset=64)
    with pytest.raises(ValueError, match="k_offset .*block boundary"):
        jax.eval_shape(lambda o: fp8_linear.fp8_linear(x, w_q, w_s, form="w8a8", impl="mosaic_interpret",
                                                       k_offset=o), jnp.int32(0))
    with pytest.raises(ValueError, match="must have one shape"):
        fp8_linear.fp8_swiglu(x, w_q, w_q[:128], w_s, w_s[:1], impl="mosaic_interpret")
    with pytest.raises(ValueError, match="config must be an Fp8GemmConfig with swiglu=False"):
        fp8_linear.fp8_linear(x, w_q, w_s, form="w8a8", impl="mosaic_interpret",
                              config=fp8_linear_mosaic.linear_config("swap_ab", 4, swiglu=True))
    with pytest.raises(ValueError, match="fp8_swiglu: unknown impl 'triton'"):
        fp8_linear.fp8_swiglu(x, w_q, w_q, w_s, w_s, impl="triton")


def test_rule_picks_mosaic_only_where_asked(monkeypatch):
    """The GPU default takes "w8a8_mosaic" for prompt-step rows only (`MOSAIC_ROWS`: {"prefill"}), "fp8_linear" at
    decode; GLM_DSA_FP8_LINEAR_MOSAIC names the
    row classes that take "w8a8_mosaic" (a GPU, a kernel impl, shards on block boundaries only); batch-invariant
    mode keeps "fp8_linear"; the layout is "grouped" from 64 rows."""
    def form(t, platform="gpu", impl="auto", **offsets):
        with registry.deciding_for(platform):
            return fp8_linear.model_form(jax.ShapeDtypeStruct((t, 2048), jnp.bfloat16), impl=impl, **offsets)

    monkeypatch.delenv(fp8_linear.MOSAIC_ENV, raising=False)
    assert fp8_linear.MOSAIC_ROWS == frozenset({"prefill"})
    assert (form(32), form(8192)) == ("fp8_linear", "w8a8_mosaic")
    monkeypatch.setenv(fp8_linear.MOSAIC_ENV, "none")
    assert (form(32), form(8192)) == ("fp8_linear", "dequant")
    monkeypatch.setenv(fp8_linear.MOSAIC_ENV, "prefill")
    assert (form(32), form(8192)) == ("fp8_linear", "w8a8_mosaic")
    monkeypatch.setenv(fp8_linear.MOSAIC_ENV, "decode,prefill")
    assert (form(32), form(8192), form(8192, impl="triton")) == ("w8a8_mosaic",) * 3
    assert form(32, platform="cpu") == "fp8_linear" and form(8192, impl="xla") == "fp8_linear"
    assert form(8192, n_offset=64) == "dequant" and form(32, k_offset=jnp.int32(0)) == "fp8_linear"
    with registry.deciding_for("gpu"), registry.batch_invariant():
        assert fp8_linear.model_form(jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16), impl="auto") == "fp8_linear"
        assert fp8_linear.mosaic_layout(8192) == "swap_ab"
    monkeypatch.setattr(fp8_linear, "MOSAIC_ROWS", frozenset({"decode"}))  # the in-code switch; the variable wins
    monkeypatch.setenv(fp8_linear.MOSAIC_ENV, "none")
    assert (form(32), form(8192)) == ("fp8_linear", "dequant")
    monkeypatch.delenv(fp8_linear.MOSAIC_ENV)
    assert (form(32), form(8192)) == ("w8a8_mosaic", "dequant")
    with registry.deciding_for("gpu"):
        assert [fp8_linear.mosaic_layout(t) for t in (1, 32, 63, 64, 8192)] == \
            ["swap_ab", "swap_ab", "swap_ab", "grouped", "grouped"]
    monkeypatch.setenv(fp8_linear.MOSAIC_ENV, "decoding")
    with pytest.raises(ValueError, match="GLM_DSA_FP8_LINEAR_MOSAIC='decoding'"):
        form(32)


def test_model_linears_run_the_kernel_where_the_rule_says(monkeypatch):
    """`glm_dsa.model.linear` deciding for a GPU with the switch on, under an interpreted kernel impl: a SwiGLU MLP
    (FP8 gate, up, down in the model's [in, out] layout) runs gate and up as one Mosaic GEMM with the SwiGLU epilogue
    and down through the Mosaic linear, and a 576-wide linear (kv_a) the Mosaic linear; each within float32 rounding
    of the ops' W8A8 references. With the switch off the model's forms are as before."""
    d, i, t = 256, 256, 5
    (gq, gs), (uq, us), (dq, ds), (aq, as_) = (_weight(n, k, seed=s) for s, (n, k) in
                                                enumerate(((i, d), (i, d), (d, i), (576, d))))
    module = types.SimpleNamespace(gate=gq.T, gate_scale=gs.T, up=uq.T, up_scale=us.T, down=dq.T, down_scale=ds.T,
                                   kv_a=aq.T, kv_a_scale=as_.T)
    x = _rows(t, d, seed=4, dtype=jnp.float32)
    monkeypatch.setenv(fp8_linear.MOSAIC_ENV, "decode")
    with registry.deciding_for("gpu"), registry.record() as log:
        y = _done(linear.swiglu(module, ("gate", "up", "down"), x, impl="triton_interpret"))
        a = _done(linear.apply(module, "kv_a", x, impl="triton_interpret"))
    assert {(r.rule, r.choice) for r in log} == {("fp8_linear.model_form", "w8a8_mosaic"),
                                                 ("fp8_linear.mosaic_layout", "swap_ab"), ("launch_rows", "rows")}
    assert sum(r.rule == "fp8_linear.model_form" for r in log) == 3  # gate+up once, down, kv_a
    h = fp8_linear.fp8_swiglu(x, gq, uq, gs, us)
    want = np.asarray(fp8_linear.fp8_linear(h, dq, ds, form="w8a8"), np.float64)
    assert y.shape == (t, d) and _rel(y, want) < 1e-5
    assert a.shape == (t, 576) and _rel(a, _oracle(x, aq, as_)) < 1e-6
    monkeypatch.delenv(fp8_linear.MOSAIC_ENV)
    with registry.deciding_for("gpu"), registry.record() as log:
        jax.eval_shape(functools.partial(linear.swiglu, module, ("gate", "up", "down"), impl="triton"), x)
    assert {(r.rule, r.choice) for r in log if r.rule.startswith("fp8_linear")} == {
        ("fp8_linear.model_form", "fp8_linear")}


def test_model_step_takes_mosaic_where_the_switch_says(monkeypatch):
    """A traced step of the `heads` preset with FP8 weights at TP = 2 (every dense shard on block boundaries),
    deciding for a GPU with GLM_DSA_FP8_LINEAR_MOSAIC set: its dense FP8 linears run "w8a8_mosaic" (swap-AB tiles at
    decode, grouped tiles for a 256-row prefill chunk). Without it: tests/model/test_kernel_table.py."""
    from glm_dsa import configs
    from glm_dsa.model.kernel_table import step_decisions
    from sharding import ParallelConfig

    def decided(rows, requests):
        log = step_decisions(configs.heads, parallel=ParallelConfig(tensor_parallel_size=2), rows=rows,
                             requests=requests, context=256, block_size=64, quantization="fp8")
        return {(d.rule, d.choice) for d in log if d.rule.startswith("fp8_linear.")}

    monkeypatch.setenv(fp8_linear.MOSAIC_ENV, "prefill,decode")
    assert decided(4, 4) == {("fp8_linear.model_form", "w8a8_mosaic"), ("fp8_linear.mosaic_layout", "swap_ab")}
    assert decided(256, 1) == {("fp8_linear.model_form", "w8a8_mosaic"), ("fp8_linear.mosaic_layout", "grouped")}
    monkeypatch.delenv(fp8_linear.MOSAIC_ENV)  # the default: prompt steps only
    assert ("fp8_linear.model_form", "fp8_linear") in decided(4, 4)
    assert not any(rule == "fp8_linear.mosaic_layout" for rule, _ in decided(4, 4))
    assert decided(256, 1) == {("fp8_linear.model_form", "w8a8_mosaic"), ("fp8_linear.mosaic_layout", "grouped")}


# name: (rows, N, K, swiglu): GLM-5.2 at TP = 8 in the model's [in, out] layout; the rule's layout per row count
GLM = {
    "q_b_prefill": (8192, 2048, 2048, False),
    "o_proj_decode": (32, 6144, 2048, False),
    "kv_a_decode": (1, 576, 6144, False),
    "dense_gate_up_prefill": (8192, 1536, 6144, True),
    "shared_gate_up_decode": (32, 256, 6144, True),
}


@pytest.mark.parametrize("name", sorted(GLM))
def test_lowers_for_cuda_at_glm_widths(name):
    from kernels.common.triton_common import lower_for_gpu
    t, n, k, swiglu = GLM[name]
    S = jax.ShapeDtypeStruct
    x, w, s = S((t, k), jnp.bfloat16), S((k, n), jnp.float8_e4m3fn), S((k // 128, -(-n // 128)), jnp.float32)
    if swiglu:
        fn, args = functools.partial(fp8_linear.fp8_swiglu, impl="mosaic", w_layout="kn"), (x, w, w, s, s)
    else:
        fn, args = functools.partial(fp8_linear.fp8_linear, form="w8a8", impl="mosaic", w_layout="kn"), (x, w, s)
    assert "mosaic_gpu" in lower_for_gpu(fn, *args)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [32, 256])
@pytest.mark.parametrize("n,k", [(2048, 2048), (6144, 2048), (576, 6144)])  # q_b, o_proj at TP = 8; kv_a
def test_gpu_glm52_shapes(t, n, k):
    """Native kernels at GLM-5.2 TP = 8 widths, the model's [in, out] layout: within 1e-2 of the W8A8 oracle (the
    tensor core's short accumulator and the bf16 output; tests/kernels/fp8_gemm bound it per element)."""
    w_q, w_s = _weight(n, k, seed=n)
    x = jax.random.normal(jax.random.key(t), (t, k), jnp.bfloat16)
    y = jax.jit(functools.partial(fp8_linear.fp8_linear, form="w8a8", impl="mosaic", w_layout="kn"))(x, w_q.T,
                                                                                                       w_s.T)
    assert _rel(y, _oracle(x, w_q, w_s)) < 1e-2
