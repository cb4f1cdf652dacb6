"""The MoE impl "mosaic" / FP8 form "w8a8_mosaic" (kernels/fp8_gemm/experts.py through kernels/moe): routed FP8
experts through the Mosaic GPU W8A8 grouped GEMM (SwiGLU fused), against a float64 numpy oracle of the W8A8 rule
(SPEC §11), both tile layouts, each row's result bitwise independent of the other rows; where the registry's rules
pick it (GPU only, and only where `moe.MOSAIC_ROWS` or GLM_DSA_MOE_MOSAIC names the row class), in the rule and in a
traced model step; what it refuses.

On CPU the kernels run under the Mosaic GPU interpreter at tiny shapes; the gpu tests run them natively."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels import moe, registry

from moe_inputs import fp8_expert_stacks  # the folder is on sys.path under pytest

_MOSAIC = "mosaic" if jax.default_backend() == "gpu" else "mosaic_interpret"


def _inputs(t, k, n_exp, d, i, *, seed, dtype=jnp.bfloat16):
    """K-major FP8 stacks (gate/up [E, I, D], down [E, D, I], the model's layout) of block-quantised random weights
    with their grids, routing weights and rows."""
    rng = np.random.default_rng(seed)
    stacks, grids = fp8_expert_stacks(rng, n_exp, d, i)
    experts = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)])
    x = rng.normal(size=(t, d)) * rng.uniform(0.1, 10.0, size=(t, 1))
    w = rng.uniform(0.1, 1.0, size=(t, k))
    args = (jnp.asarray(x, dtype), jnp.asarray(experts, jnp.int32), jnp.asarray(w, jnp.float32), *stacks)
    return args, dict(wg_scale=grids[0], wu_scale=grids[1], wd_scale=grids[2], w_layout="nk")


def _np_quantize_rows(a):
    """(decoded e4m3 float64, float64 scales) of the activation rule, in numpy float32 (IEEE division)."""
    a = np.asarray(a, np.float32)
    blk = a.reshape(a.shape[0], -1, 128)
    s = np.maximum(np.abs(blk).max(-1) / np.float32(448), np.float32(1.1754944e-38)).astype(np.float32)
    q = np.clip(blk / s[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float64).reshape(a.shape), s.astype(np.float64)


def _oracle_w8a8(x, experts, weights, qg, qu, qd, wg_scale, wu_scale, wd_scale, dequantised=False, **_):
    """float64 [T, D] of the W8A8 routed experts over K-major stacks: x and h quantised per row and 128 channels,
    each 128-K partial scaled by the row's and the weight block's scales, h and each pair's down output rounded to
    x's dtype (the kernels store them so). `dequantised`: the float function of the dequantised experts instead
    (no activation rounding), to show the bound tells W8A8 from it."""
    dec = lambda q: np.asarray(jnp.asarray(q).astype(jnp.float32), np.float64)  # noqa: E731
    xf = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)

    def gemm(a, w, grid):  # a [R, K] x w [N, K] (one expert, [out, in]), 128-K partials scaled
        if dequantised:
            return a @ (w * np.repeat(np.repeat(grid, 128, 0), 128, 1)).T
        aq, sa = _np_quantize_rows(a)
        out = np.zeros((a.shape[0], w.shape[0]))
        for kb in range(w.shape[1] // 128):
            part = aq[:, kb * 128:(kb + 1) * 128] @ w[:, kb * 128:(kb + 1) * 128].T
            out += part * sa[:, kb:kb + 1] * np.repeat(grid[:, kb], 128)[None, :]
        return out

    experts = np.asarray(experts)
    y = np.zeros(xf.shape)
    for e in np.unique(experts):
        rows, slot = np.nonzero(experts == e)
        sg, su, sd = (np.asarray(a[e], np.float64) for a in (wg_scale, wu_scale, wd_scale))
        g, u = gemm(xf[rows], dec(qg[e]), sg), gemm(xf[rows], dec(qu[e]), su)
        h = g / (1 + np.exp(-g)) * u
        if not dequantised:
            h = np.asarray(jnp.asarray(h, jnp.float32).astype(x.dtype).astype(jnp.float32), np.float64)
        down = gemm(h, dec(qd[e]), sd)
        if not dequantised:  # each pair's output stored in x's dtype, then weighted and summed in float32
            down = np.asarray(jnp.asarray(down, jnp.float32).astype(x.dtype).astype(jnp.float32), np.float64)
        y[rows] += np.asarray(weights, np.float64)[rows, slot][:, None] * down
    return y


def _rel(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


# (t, k, n_exp, d, i, x dtype, layout): decode-sized swap-AB tiles of 8 rows over bf16 rows (h stored in bf16, as
# the model does), the grouped 128-row tiles over float32 rows (h stored in float32: the tiny test models)
CASES = {
    "swap_ab": (6, 2, 4, 256, 256, jnp.bfloat16, "swap_ab"),
    "grouped_f32": (6, 2, 4, 256, 128, jnp.float32, "grouped"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_mosaic_experts_match_the_w8a8_rule(name):
    """Within the float32 rounding of the rule (CPU: exact e4m3 products summed in float32, so only an h value
    that lands on a bf16 or e4m3 rounding boundary can move); the float function of the dequantised experts is
    over 1e-2 away (the activation rounding), so the bound tells the arithmetic apart."""
    t, k, n_exp, d, i, dtype, layout = CASES[name]
    args, fp8 = _inputs(t, k, n_exp, d, i, seed=len(name), dtype=dtype)
    got = jax.jit(functools.partial(moe.routed_experts, impl=_MOSAIC, layout=layout, **fp8))(*args)
    want = _oracle_w8a8(*args, **fp8)
    assert got.shape == (t, d) and got.dtype == jnp.float32
    assert _rel(got, want) < 2e-3
    assert _rel(_oracle_w8a8(*args, **fp8, dequantised=True), want) > 1e-2


def test_kernel_impls_run_the_form_as_mosaic():
    """form "w8a8_mosaic" under a Triton impl is impl "mosaic" in that impl's run mode (the same program), its
    layout by the rule "moe.mosaic_layout" unless given, its launch configs for the registry's `config_rows`."""
    args, fp8 = _inputs(6, 2, 4, 256, 128, seed=0)
    trace = lambda **kw: str(jax.make_jaxpr(functools.partial(moe.routed_experts, **fp8, **kw))(*args))  # noqa
    interpreted = trace(impl="mosaic_interpret")
    assert interpreted.count("name=_run") == 2 and "wgmma" in interpreted  # the two grouped GEMMs
    assert trace(impl="triton_interpret", form="w8a8_mosaic") == interpreted
    assert trace(impl="mosaic_interpret", layout="swap_ab") == interpreted  # 3 rows per expert: swap-AB tiles
    assert trace(impl="mosaic_interpret", layout="grouped") != interpreted
    with registry.record() as log:
        jax.eval_shape(functools.partial(moe.routed_experts, impl="mosaic_interpret", **fp8), *args)
    assert [(d.rule, d.choice) for d in log] == [("moe.mosaic_layout", "swap_ab"), ("launch_rows", "rows")]


def test_mosaic_refuses_what_it_does_not_take():
    args, fp8 = _inputs(3, 2, 4, 256, 128, seed=1)
    x, e, w, qg, qu, qd = args
    with pytest.raises(ValueError, match="impl 'mosaic' does not support these inputs: .*FP8 experts"):
        z = jnp.zeros((4, 256, 128), jnp.bfloat16)
        moe.routed_experts(x, e, w, z, z, jnp.zeros((4, 128, 256), jnp.bfloat16), impl="mosaic")
    kn = {n: jnp.swapaxes(fp8[n], 1, 2) for n in ("wg_scale", "wu_scale", "wd_scale")}
    with pytest.raises(ValueError, match="read K-major stacks"):
        moe.routed_experts(x, e, w, *(jnp.swapaxes(q, 1, 2) for q in (qg, qu, qd)), impl="mosaic", **kn)
    with pytest.raises(ValueError, match="runs form 'w8a8_mosaic' only"):
        moe.routed_experts(*args, impl="mosaic", form="w8a8", **fp8)
    with pytest.raises(ValueError, match="layout 'rows' is not one of"):
        moe.routed_experts(*args, impl="mosaic_interpret", layout="rows", **fp8)


GLM = (256, 8, 256, 6144, 256)  # E, k and the TP = 8 shard's widths: (n_exp, k) below are (256, 8)


def test_rule_picks_mosaic_only_where_asked(monkeypatch):
    """The GPU default takes "w8a8_mosaic" for prompt steps only (`moe.MOSAIC_ROWS`: {"prefill"}), the Triton
    "w8a8" at decode; GLM_DSA_MOE_MOSAIC names the row classes
    that take "w8a8_mosaic" (K-major, whole-block shards on a GPU only); batch-invariant decode steps take "w8a8"
    at every row count (no transposed copy of the K-major stacks; "w8a16" for ragged shards) and swap-AB tiles, its
    prompt steps take the default's form and layout for their rows."""
    def form(t, platform="gpu", w_layout="nk", i=256, i_offset=0):
        with registry.deciding_for(platform):
            return moe.fp8_form(t, 8, 256, 6144, i, i_offset, w_layout=w_layout)

    monkeypatch.delenv(moe.MOSAIC_ENV, raising=False)
    assert moe.MOSAIC_ROWS == frozenset({"prefill"})
    assert (form(32), form(8192)) == ("w8a8", "w8a8_mosaic")
    monkeypatch.setenv(moe.MOSAIC_ENV, "none")
    assert (form(32), form(8192)) == ("w8a8", "dequant")
    monkeypatch.setenv(moe.MOSAIC_ENV, "prefill")
    assert (form(32), form(8192)) == ("w8a8", "w8a8_mosaic")
    monkeypatch.setenv(moe.MOSAIC_ENV, "decode,prefill")
    assert (form(32), form(8192)) == ("w8a8_mosaic", "w8a8_mosaic")
    assert form(32, platform="cpu") == "w8a8" and form(8192, w_layout="kn") == "dequant"
    assert form(32, i=200) == form(32, i_offset=64) == "w8a16"
    with registry.deciding_for("gpu"), registry.batch_invariant():
        assert [moe.fp8_form(t, 8, 256, 6144, 256, 0, w_layout="nk") for t in (8, 32, 256)] == ["w8a8"] * 3
        assert moe.fp8_form(32, 8, 256, 6144, 200, 0, w_layout="nk") == "w8a16"
        assert moe.mosaic_layout(8192, 8, 256) == "swap_ab"
    with registry.deciding_for("gpu"), registry.batch_invariant(rows=8192):
        assert moe.fp8_form(8192, 8, 256, 6144, 256, 0, w_layout="nk") == "w8a8_mosaic"
        assert moe.mosaic_layout(8192, 8, 256) == "grouped"
    monkeypatch.setattr(moe, "MOSAIC_ROWS", frozenset({"decode"}))  # the in-code switch; the variable overrides it
    monkeypatch.setenv(moe.MOSAIC_ENV, "none")
    assert (form(32), form(8192)) == ("w8a8", "dequant")
    monkeypatch.delenv(moe.MOSAIC_ENV)
    assert (form(32), form(8192)) == ("w8a8_mosaic", "dequant")
    with registry.deciding_for("gpu"):
        assert [moe.mosaic_layout(t, 8, 256) for t in (1, 32, 128, 2048, 8192)] == \
            ["swap_ab", "swap_ab", "swap_ab", "grouped", "grouped"]
    monkeypatch.setenv(moe.MOSAIC_ENV, "decoding")
    with pytest.raises(ValueError, match="GLM_DSA_MOE_MOSAIC='decoding'"):
        form(32)


def test_model_step_takes_mosaic_where_the_rule_says(monkeypatch):
    """A traced step of the `heads` preset with FP8 weights at TP = 2 (expert shards of 128 on block boundaries),
    deciding for a GPU: with GLM_DSA_MOE_MOSAIC set, its MoE layers run "w8a8_mosaic" (swap-AB tiles at decode,
    grouped tiles for a 256-row prefill chunk); without it, the Triton forms."""
    from glm_dsa import configs
    from glm_dsa.model.kernel_table import step_decisions
    from sharding import ParallelConfig

    def decided(rows, requests):
        log = step_decisions(configs.heads, parallel=ParallelConfig(tensor_parallel_size=2), rows=rows,
                             requests=requests, context=256, block_size=64, quantization="fp8")
        return {(d.rule, d.choice) for d in log if d.rule.startswith("moe.")}

    monkeypatch.setenv(moe.MOSAIC_ENV, "prefill,decode")
    assert decided(4, 4) >= {("moe.fp8_form", "w8a8_mosaic"), ("moe.mosaic_layout", "swap_ab")}
    assert decided(256, 1) >= {("moe.fp8_form", "w8a8_mosaic"), ("moe.mosaic_layout", "grouped")}
    monkeypatch.delenv(moe.MOSAIC_ENV)  # the default: prompt steps only
    default = decided(4, 4)
    assert ("moe.fp8_form", "w8a8") in default and not any(r == "moe.mosaic_layout" for r, _ in default)
    assert decided(256, 1) >= {("moe.fp8_form", "w8a8_mosaic"), ("moe.mosaic_layout", "grouped")}


@pytest.mark.gpu
@pytest.mark.parametrize("t,layout", [(32, "swap_ab"), (128, "swap_ab"), (512, "grouped"), (8, "grouped")])
def test_gpu_mosaic_experts(t, layout):
    """Native kernels at GLM-5.2's hidden width and the TP = 8 shard's expert width (64 experts, top-8): within
    1e-2 of the W8A8 oracle. The tensor core's short accumulator (tests/kernels/fp8_gemm, `accumulation_bound`)
    moves a few h values across a bf16 or e4m3 rounding boundary; the Triton W8A8 kernels were 7.2e-3 away on
    the H200 for the same reason (test_moe.py). The dequantised float function is over 1e-2 away."""
    args, fp8 = _inputs(t, 8, 64, 6144, 256, seed=t)
    got = jax.jit(functools.partial(moe.routed_experts, impl="mosaic", layout=layout, **fp8))(*args)
    want = _oracle_w8a8(*args, **fp8)
    err = _rel(got, want)
    print(f"t={t} {layout}: relative error {err:.3g}")
    assert err < 1e-2
    triton = jax.jit(functools.partial(moe.routed_experts, impl="triton", form="w8a8", **fp8))(*args)
    print(f"t={t}: Triton W8A8 relative error {_rel(triton, want):.3g}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_padding_rows_reach_no_group(name):
    """Rows marked padding (expert ids E, the model's sentinel, or -1; weights 0; x NaN): their pairs are in no
    group of either layout (`pair_rows` gives them the row past the end), so their NaN rows reach no real row and
    their outputs are 0; the real rows are the W8A8 rule's over the real rows alone and bit for bit those of the
    call without padding."""
    from kernels.fp8_gemm.experts import pair_rows
    t, k, n_exp, d, i, dtype, layout = CASES[name]
    args, fp8 = _inputs(t, k, n_exp, d, i, seed=7, dtype=dtype)
    x, experts, w, *stacks = args
    pad, real = np.array([1, 4]), np.array([0, 2, 3, 5])
    sentinel = jnp.asarray([[n_exp] * k, [-1] * k], jnp.int32)
    padded = (x.at[pad].set(jnp.nan), experts.at[pad].set(sentinel), w.at[pad].set(0.0), *stacks)
    run = jax.jit(functools.partial(moe.routed_experts, impl=_MOSAIC, layout=layout, **fp8))
    got, before = np.asarray(run(*padded)), np.asarray(run(*args))
    assert np.all(got[pad] == 0)
    assert _rel(got[real], _oracle_w8a8(*(a[real] for a in args[:3]), *stacks, **fp8)) < 2e-3
    np.testing.assert_array_equal(got[real], before[real])
    dest, _, tile_group = pair_rows(padded[1], n_exp, 8)
    rows = tile_group.shape[0] * 8
    dest = np.asarray(dest).reshape(t, k)
    assert np.all(dest[pad] == rows)
    kept = dest[real].ravel()  # every real pair on its own row, in a tile of its expert
    assert len(set(kept.tolist())) == kept.size and np.all(kept < rows)
    np.testing.assert_array_equal(np.asarray(tile_group)[kept // 8], np.asarray(experts)[real].ravel())


@pytest.mark.parametrize("layout", ["grouped", "swap_ab"])
def test_rows_do_not_depend_on_the_other_rows(layout):
    """A group of rows (their x, experts and routing weights fixed) comes out bitwise the same in a step of T rows
    whatever the other rows route to (skewed to two experts or spread, so the experts' tiles start and end at other
    rows and the group's pairs share tiles with others) and wherever the group sits: each output row of both GEMMs
    reduces over K alone, in an order fixed by the launch config (the same at a fixed T), and the glue moves rows
    without arithmetic, then adds a token's k pair rows in j order. What batch-invariant steps need of the form: its
    prompt steps take the grouped tiles and its decode steps the swap-AB ones (`moe.mosaic_layout`)."""
    t, k, n_exp, d, i, rows = 24, 2, 4, 256, 128, 5
    args, fp8 = _inputs(t, k, n_exp, d, i, seed=12)
    x, experts, weights, *stacks = args
    run = jax.jit(functools.partial(moe.routed_experts, impl=_MOSAIC, layout=layout, **fp8))

    def place(at, seed):
        r = np.random.default_rng(seed)
        xs = np.asarray(r.normal(size=(t, d)) * r.uniform(0.1, 20.0, size=(t, 1)), np.float32)  # louder rows too
        if seed % 2:  # skewed: every other row's first expert 0, its second 1
            ex = np.tile(np.arange(k), (t, 1))
        else:
            ex = np.stack([r.choice(n_exp, k, replace=False) for _ in range(t)])
        ws = r.uniform(0.1, 1.0, size=(t, k))
        xs[at:at + rows] = np.asarray(x[:rows].astype(jnp.float32))
        ex[at:at + rows], ws[at:at + rows] = np.asarray(experts[:rows]), np.asarray(weights[:rows])
        return jnp.asarray(xs, x.dtype), jnp.asarray(ex, jnp.int32), jnp.asarray(ws, jnp.float32)

    outs = [np.asarray(run(*place(at, seed), *stacks))[at:at + rows] for at, seed in ((0, 1), (t - rows, 2), (9, 3))]
    for got in outs[1:]:
        np.testing.assert_array_equal(got.view(np.uint32), outs[0].view(np.uint32))
    want = _oracle_w8a8(x[:rows], experts[:rows], weights[:rows], *stacks, **fp8)
    assert _rel(outs[0], want) < 2e-3


@pytest.mark.parametrize("t,k,n_exp,tm", [(40, 4, 8, 16), (5, 2, 64, 8), (1, 1, 4, 8)])
def test_pair_rows_map_pairs_and_rows_both_ways(t, k, n_exp, tm):
    """`pair_rows`: every routed pair on its own row, in a tile of its expert, each expert's pairs from its tile-aligned
    start in pair order; src names the pair at each row (src[dest[p]] = p) and -1 at every row holding none; unrouted
    pairs (ids n_exp or -1) have dest one past the last row and no row."""
    from kernels.fp8_gemm.experts import pair_rows
    rng = np.random.default_rng(t * 100 + n_exp)
    experts = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)]).astype(np.int32)
    experts[rng.random((t, k)) < 0.2] = n_exp
    experts[0, -1] = -1
    dest, src, tile_group = (np.asarray(a) for a in jax.jit(pair_rows, static_argnums=(1, 2))(experts, n_exp, tm))
    rows = tile_group.size * tm
    assert tile_group.size == -(-t * k // tm) + n_exp - 1 and src.shape == (rows,)
    flat = experts.ravel()
    routed = (flat >= 0) & (flat < n_exp)
    assert np.all(dest[~routed] == rows)
    p = np.nonzero(routed)[0]
    assert np.array_equal(src[dest[p]], p) and np.sum(src >= 0) == p.size
    assert np.array_equal(tile_group[dest[p] // tm], flat[p])
    for e in range(n_exp):  # each expert's pairs from a tile boundary, consecutive, in pair order
        pe = p[flat[p] == e]
        if pe.size:
            assert dest[pe[0]] % tm == 0 and np.array_equal(dest[pe], dest[pe[0]] + np.arange(pe.size))


def test_glue_is_the_scatter_layout_bit_for_bit():
    """`group_rows` (one gather per operand) gives the bits of the zero-filled buffer scattered
    into at `dest` (the layout's definition: rows holding no pair zeros with scale 1); `combine` the weighted sum of
    each token's pair rows (float32, a NaN at an unrouted pair's row adds nothing). The glue's jaxpr has no loop and
    one scatter (dest's P int32), none over rows of x."""
    from kernels.fp8_gemm import experts as fe
    from kernels.fp8_gemm.reference import quantize_rows
    t, k, n_exp, d, tm = 24, 4, 8, 256, 16
    rng = np.random.default_rng(3)
    experts = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)]).astype(np.int32)
    experts[[2, 7]] = n_exp
    x = jnp.asarray(rng.normal(size=(t, d)) * 3, jnp.bfloat16)
    dest, src, tile_group = fe.pair_rows(jnp.asarray(experts), n_exp, tm)
    rows = tile_group.size * tm
    a_q, s_a = quantize_rows(x)
    token = jnp.arange(t * k) // k
    want_a = jnp.zeros((rows, d), a_q.dtype).at[dest].set(a_q[token], mode="drop")
    want_s = jnp.ones((rows, d // 128), jnp.float32).at[dest].set(s_a[token], mode="drop")
    a_rows, s_rows = jax.jit(fe.group_rows, static_argnums=3)(a_q, s_a, src, k)
    assert np.array_equal(np.asarray(a_rows).view(np.uint8), np.asarray(want_a).view(np.uint8))
    assert np.array_equal(np.asarray(s_rows), np.asarray(want_s))
    y = jnp.asarray(rng.normal(size=(rows, d)), jnp.bfloat16).at[jnp.asarray(src) < 0].set(jnp.nan)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
    got = np.asarray(jax.jit(fe.combine)(y, dest.reshape(t, k), w))
    yf = np.asarray(y.astype(jnp.float32), np.float64)
    d2 = np.asarray(dest).reshape(t, k)
    want = sum(np.where((d2[:, j] < rows)[:, None], yf[np.minimum(d2[:, j], rows - 1)] * np.asarray(w)[:, j:j + 1],
                        0.0) for j in range(k))
    assert np.all(got[[2, 7]] == 0) and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    rows_map = fe.pair_rows(jnp.asarray(experts), n_exp, tm)
    prims = _primitives(jax.make_jaxpr(lambda e, a, s, yy, ww: (
        fe.group_rows(a, s, fe.pair_rows(e, n_exp, tm).src, k),
        fe.combine(yy, fe.pair_rows(e, n_exp, tm).dest.reshape(t, k), ww)))(experts, a_q, s_a, y, w).jaxpr)
    assert "while" not in prims and prims.count("scatter") == 2  # dest's, once per pair_rows call here
    assert rows_map.dest.shape == (t * k,)


def _primitives(jaxpr) -> list:
    """The primitive names of a jaxpr's equations, nested jaxprs (jit, loops) included."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _primitives(inner)
    return out
