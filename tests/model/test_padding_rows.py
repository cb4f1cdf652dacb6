"""Padding rows (position -1, as the serving runner pads a step to its row bucket) route to no expert: the real rows'
logits are bit for bit those of the same step with the padding rows unmarked (position 0, slot -1: routed like any
row), and the padding rows' (token, expert) pairs reach no tile of the routed experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm_dsa
from glm_dsa.model.options import StepOptions
from glm_dsa.model.step import prefill_inputs, resolve_parallel
from kernels import moe
from kernels.moe import tiles as moe_tiles

CFG = glm_dsa.configs.tiny
REAL, PAD = 11, 5  # a prefill of 11 rows padded to 16


@pytest.fixture(scope="module")
def params(ckpt):
    return glm_dsa.load(ckpt, dtype="float32", max_model_len=64, progress=False).params


def _batch(params, mark: bool):
    """The prefill of REAL tokens plus PAD padding rows (token 0, request 0, slot -1), at position -1 (`mark`) or 0;
    logits of the real rows only."""
    par = resolve_parallel(None, CFG)
    ids = np.random.default_rng(3).integers(0, CFG.vocab_size, (1, REAL))
    caches, b = prefill_inputs(params, ids, config=CFG, parallel=par)
    fill = lambda a, v: jnp.concatenate([a, jnp.full((PAD,), v, a.dtype)])  # noqa: E731
    batch = glm_dsa.StepBatch(fill(b.token_ids, 0), fill(b.positions, -1 if mark else 0), fill(b.slot_mapping, -1),
                              fill(b.token_req, 0), b.block_tables, b.logits_indices)
    return caches, batch, par


@pytest.mark.parametrize("options", [StepOptions(), StepOptions(batch_invariant=True), StepOptions(moe_mode="tiles")],
                         ids=["default", "batch_invariant", "tiles"])
def test_padding_rows_route_to_no_expert(params, monkeypatch, options):
    seen = []  # per MoE layer: (experts, rows of each tile_plan row's pair)
    routed = moe.routed_experts

    def spy(x, experts, weights, *a, **kw):
        t, k = experts.shape
        n_exp = a[0].shape[0]
        src, _ = moe_tiles.tile_plan(experts, n_exp, moe_tiles.tile_rows(t, k, n_exp))
        jax.debug.callback(lambda e, s: seen.append((np.asarray(e), np.asarray(s))), experts, src)
        return routed(x, experts, weights, *a, **kw)

    monkeypatch.setattr(moe, "routed_experts", spy)
    logits = {}
    for mark in (False, True):
        caches, batch, par = _batch(params, mark)
        seen.clear()
        logits[mark] = np.asarray(jax.jit(lambda p, c, b: glm_dsa.step(p, c, b, config=CFG, parallel=par,
                                                                      options=options))(params, caches, batch)[0])
        n_moe = sum(CFG.is_moe(i) for i in range(CFG.num_hidden_layers))
        assert len(seen) == n_moe > 0
        for experts, src in seen:
            pad_pairs = np.isin(src[src >= 0] // CFG.num_experts_per_tok, np.arange(REAL, REAL + PAD))
            if mark:  # the sentinel E, in no tile
                assert np.all(experts[REAL:] == CFG.n_routed_experts) and np.all(experts[:REAL] < CFG.n_routed_experts)
                assert not pad_pairs.any()
            else:  # unmarked padding rows are routed and computed like any row
                assert pad_pairs.sum() == PAD * CFG.num_experts_per_tok
    assert logits[True].shape == (REAL, logits[True].shape[1]) and np.all(np.isfinite(logits[True]))
    np.testing.assert_array_equal(logits[True], logits[False])


def test_trace_records_no_expert_for_padding_rows(params):
    """The trace tool records a padding row's experts as -1 ("none", as `attn.topk`'s unfilled entries), so the
    trace diff's set comparison sees no expert there; the real rows' experts are real ids."""
    from glm_dsa.debug.trace import diff_traces, traced_step
    caches, batch, par = _batch(params, mark=True)
    _, _, taps = traced_step(params, caches, batch, config=CFG, parallel=par)
    layers = [i for i in range(CFG.num_hidden_layers) if CFG.is_moe(i)]
    for i in layers:
        experts = np.asarray(taps[f"layers.{i}.moe.experts"])
        assert np.all(experts[REAL:] == -1) and np.all(np.asarray(taps[f"layers.{i}.moe.weights"])[REAL:] == 0)
        assert np.all((experts[:REAL] >= 0) & (experts[:REAL] < CFG.n_routed_experts))
    name = f"layers.{layers[0]}.moe.experts"
    rows, first = diff_traces({name: taps[name]}, {name: taps[name]})
    assert first is None and rows[0].jaccard == 1.0


@pytest.mark.parametrize("options", [StepOptions(), StepOptions(batch_invariant=True)],
                         ids=["default", "batch_invariant"])
def test_padding_rows_attend_to_no_cache_row(params, monkeypatch, options):
    """A padding row reaches sparse MLA with no valid slot (every index -1: the indexer sees no visible key, as its
    length is position + 1 = 0), so a kernel may skip its work; the real rows select real slots."""
    from kernels import sparse_mla
    seen = []
    attend = sparse_mla.sparse_mla

    def spy(q, cache, indices, **kw):
        jax.debug.callback(lambda i: seen.append(np.asarray(i)), indices)
        return attend(q, cache, indices, **kw)

    monkeypatch.setattr(sparse_mla, "sparse_mla", spy)
    caches, batch, par = _batch(params, mark=True)
    jax.block_until_ready(jax.jit(lambda p, c, b: glm_dsa.step(p, c, b, config=CFG, parallel=par, options=options))(
        params, caches, batch))
    assert len(seen) == CFG.num_hidden_layers
    for idx in seen:
        assert np.all(idx[REAL:] == -1)
        assert np.all((idx[:REAL] >= 0).sum(axis=1) == np.minimum(np.arange(1, REAL + 1), idx.shape[1]))


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])
def test_serving_steps_keep_padding_rows_unrouted(ckpt, monkeypatch, invariant):
    """The engine's steps pad their rows to a bucket; those rows reach the model at position -1, so none of their
    pairs is routed (a position clamped to 0 made every padding row a token at position 0, routed and computed in
    every serving step), while the real rows are routed. Prefill and decode steps, both modes."""
    seen = []  # per MoE layer call: the experts [T, k]

    routed = moe.routed_experts

    def spy(x, experts, weights, *a, **kw):
        jax.debug.callback(lambda e: seen.append(np.asarray(e)), experts)
        return routed(x, experts, weights, *a, **kw)

    monkeypatch.setattr(moe, "routed_experts", spy)
    eng = glm_dsa.load(ckpt, dtype="float32", max_model_len=64, block_size=4, max_num_seqs=8, progress=False,
                       batch_invariant=invariant, invariant_step_rows=(32, 16) if invariant else None)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (5, 9, 3)]
    eng.generate(prompts, max_new_tokens=3, stop_token_ids=[])
    assert seen
    e = CFG.n_routed_experts
    real_rows = {len(p) for p in prompts} | {len(prompts)}  # a prompt step's and a decode step's real rows (at most)
    for experts in seen:
        routed_rows = int(np.all(experts < e, axis=1).sum())
        unrouted = np.all(experts == e, axis=1)
        assert routed_rows + int(unrouted.sum()) == experts.shape[0]  # a row is all routed or all padding
        assert unrouted.sum() > 0 and routed_rows <= sum(real_rows)  # every step here has padding rows
        assert not unrouted[:routed_rows].any() and unrouted[routed_rows:].all()  # the real rows first
