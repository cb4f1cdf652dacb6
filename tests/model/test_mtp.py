"""MTP speculative decoding (docs/math.md §12) on a random tiny checkpoint with a nextn layer.

Oracles: the engine without MTP (greedy tokens must be identical, under several TP / DCP layouts), oracle drafts
(the known continuation, whole or corrupted from a draft position on: every draft, some or none accepted, with
the per-position acceptance that follows), a float64 numpy evaluation of the nextn layer from the HF tensors
(SPEC §2, §12), and the exact target distribution for rejection sampling on a 5-token vocabulary.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm_dsa
from checkpoints import CheckpointError, HFCheckpoint
from checkpoints.random import write_random_checkpoint
from glm_dsa import configs
from glm_dsa.model.mtp import allocate_mtp_caches, run_mtp
from glm_dsa.model.options import StepOptions
from glm_dsa.model.paged_cache import owner_slots
from glm_dsa.serving.spec_step import accept_drafts, nucleus_probs
from glm_dsa.model.step import prefill_inputs, resolve_parallel
from sharding import ParallelConfig

CFG = configs.tiny
NEW = 10


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_mtp")
    write_random_checkpoint(CFG, path, seed=3, dtype="float32", progress=False, with_mtp=True)
    return path


def _prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(2, CFG.vocab_size, n).tolist() for n in (3, 17, 9)]


def _load(path, k=0, parallel=None, **kw):
    return glm_dsa.load(path, dtype="float32", max_model_len=64, progress=False, num_speculative_tokens=k,
                        parallel=parallel, **kw)


@pytest.fixture(scope="module")
def reference(mtp_ckpt):
    """Greedy tokens of the engine without MTP (its checkpoint's nextn layer is not even loaded)."""
    return _load(mtp_ckpt).generate(_prompts(), max_new_tokens=NEW, stop_token_ids=[])


def test_asking_for_mtp_without_a_nextn_layer_is_a_clear_error(ckpt):
    with pytest.raises(CheckpointError, match=r"no MTP \(nextn\) layer.*model\.layers\.4\.eh_proj\.weight"):
        _load(ckpt, k=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        glm_dsa.Engine(CFG, {}, num_speculative_tokens=2)


def test_convert_carries_the_nextn_layer_to_orbax(mtp_ckpt, ckpt, reference, tmp_path, capsys):
    """convert keeps the nextn layer: the orbax version restores it bit for bit (onto another mesh) and drafts as
    the HF one does (same acceptance, same tokens); loading it without MTP skips the layer; a version converted
    from a checkpoint without one is a clear error when MTP is asked of it."""
    from glm_dsa.cli import main

    out = tmp_path / "orbax"
    assert main(["convert", "--from", str(mtp_ckpt), "--to", str(out), "--dtype", "float32", "--no-progress"]) == 0
    assert "the MTP (nextn) layer included" in capsys.readouterr().out
    hf, orb = _load(mtp_ckpt, k=2), _load(out, k=2, parallel=ParallelConfig(2, 2))
    assert sorted(hf.spec.mtp_params) == sorted(orb.spec.mtp_params)
    for a, b in zip(jax.tree_util.tree_leaves(hf.spec.mtp_params), jax.tree_util.tree_leaves(orb.spec.mtp_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got = [orb.generate(_prompts(), max_new_tokens=NEW, stop_token_ids=[]), orb.last_timings]
    want = [hf.generate(_prompts(), max_new_tokens=NEW, stop_token_ids=[]), hf.last_timings]
    assert got[0] == want[0] == reference
    assert got[1]["spec_mean_accepted_length"] == want[1]["spec_mean_accepted_length"]
    assert _load(out).generate(_prompts(), max_new_tokens=NEW, stop_token_ids=[]) == reference  # layer skipped
    plain = tmp_path / "plain"
    assert main(["convert", "--from", str(ckpt), "--to", str(plain), "--dtype", "float32", "--no-progress"]) == 0
    assert "MTP" not in capsys.readouterr().out
    with pytest.raises(CheckpointError, match=r"has no MTP \(nextn\) layer \(no 'mtp\.\*' parameters"):
        _load(plain, k=2)


@pytest.mark.parametrize("tp,dcp,k", [(1, 1, 3), (2, 2, 2), (4, 4, 1)])
def test_greedy_with_mtp_equals_greedy_without(mtp_ckpt, reference, tp, dcp, k):
    par = ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp)
    eng = _load(mtp_ckpt, k=k, parallel=par)
    assert eng.generate(_prompts(), max_new_tokens=NEW, stop_token_ids=[]) == reference
    t = eng.last_timings
    assert t["spec_num_speculative_tokens"] == k and t["spec_drafts"] > 0
    assert len(t["spec_acceptance_per_position"]) == k
    m = eng.metrics()
    assert m["spec_drafts"] == t["spec_drafts"] and m["spec_requests_recent"] == len(reference)


def test_verify_step_padding_rows_keep_position_minus_one(mtp_ckpt, reference, monkeypatch):
    """The verify step pads its rows to a bucket; the padding rows reach the target and the nextn layer at position
    -1, as in the plain serving step, so they write no KV and route to no expert (tests/model/test_padding_rows.py)
    rather than computing as tokens at position 0. The tokens stay those of the engine without MTP."""
    from glm_dsa.serving import spec_step
    seen = []  # (layer, positions, slots) of every target and nextn batch a verify step runs
    run_sharded, run_mtp = spec_step.run_sharded, spec_step.run_mtp

    def record(kind, batch):
        jax.debug.callback(lambda p, s: seen.append((kind, np.asarray(p), np.asarray(s))), batch.positions,
                           batch.slot_mapping)

    def target_spy(fn, params, caches, batch, *a, **kw):
        record("target", batch)
        return run_sharded(fn, params, caches, batch, *a, **kw)

    def nextn_spy(params, mtp_params, mtp_caches, hidden, batch, **kw):
        record("nextn", batch)
        return run_mtp(params, mtp_params, mtp_caches, hidden, batch, **kw)

    monkeypatch.setattr(spec_step, "run_sharded", target_spy)
    monkeypatch.setattr(spec_step, "run_mtp", nextn_spy)
    assert _load(mtp_ckpt, k=2).generate(_prompts(), max_new_tokens=NEW, stop_token_ids=[]) == reference
    targets = [(p, s) for kind, p, s in seen if kind == "target"]
    assert any((s < 0).any() for _, s in targets), "no verify step had padding rows"
    for p, s in targets:  # a target row writes no KV exactly when it is a padding row: those sit at position -1
        assert ((s < 0) == (p < 0)).all(), (p, s)
    assert any((p < 0).any() for kind, p, _ in seen if kind == "nextn"), "the nextn layer saw no padding row"


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_oracle_drafts_accept_all_some_or_none(mtp_ckpt, reference, tp, dcp):
    """Drafts right up to draft position m and wrong after it: exactly m accepted per verify row, the tokens
    unchanged (rejected drafts' KV rows must be dead), per-position acceptance 1 before m and 0 from m on."""
    k = 3
    eng = _load(mtp_ckpt, k=k, parallel=ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp))
    for m in (k, 1, 0):
        def oracle(r, m=m):
            right = reference[r.prompt_index][len(r.output): len(r.output) + k]
            return [t if i < m else (t + 1 + i) % CFG.vocab_size for i, t in enumerate(right)]
        eng.spec.oracle = oracle
        assert eng.generate(_prompts(), max_new_tokens=NEW, stop_token_ids=[]) == reference, f"m={m}"
        t = eng.last_timings
        assert t["spec_acceptance_per_position"] == [1.0] * m + [0.0] * (k - m), f"m={m}"
        if m == k:  # every verify row emits all its drafts plus one (the last rows have fewer drafts: length)
            assert t["spec_acceptance_rate"] == 1.0 and t["spec_mean_accepted_length"] > 2.5
        if m == 0:
            assert t["spec_accepted"] == 0 and t["spec_mean_accepted_length"] == 1.0
    eng.spec.oracle = None


def test_sampling_with_mtp_is_reproducible_and_in_vocabulary(mtp_ckpt):
    eng = _load(mtp_ckpt, k=2)
    a = eng.generate(_prompts(), max_new_tokens=NEW, temperature=0.9, top_p=0.95, seed=7, stop_token_ids=[])
    b = eng.generate(_prompts(), max_new_tokens=NEW, temperature=0.9, top_p=0.95, seed=7, stop_token_ids=[])
    assert a == b and all(len(x) == NEW and all(0 <= t < CFG.vocab_size for t in x) for x in a)
    assert eng.last_timings["spec_drafts"] > 0


# ---- rejection sampling keeps the target distribution ---------------------------------------------------------

def test_rejection_sampling_keeps_the_target_distribution():
    """Context-free target p and draft q on 5 tokens, k = 2 drafts drawn from q: the first two emitted tokens must
    be i.i.d. p (the first always; the second when the first draft was accepted, or as the bonus), whatever q."""
    v, k, g = 5, 2, 40000
    p = np.array([0.4, 0.25, 0.2, 0.1, 0.05])
    q = np.array([0.1, 0.1, 0.5, 0.2, 0.1])
    rng = np.random.default_rng(0)
    drafts = rng.choice(v, size=(g, k), p=q).astype(np.int32)
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (g, k + 1, v))
    keys = jax.vmap(lambda i: jax.vmap(lambda j: jax.random.fold_in(jax.random.key(i), j))(jnp.arange(k + 1)))(
        jnp.arange(g))
    qs = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (g, k, v))
    ones = jnp.ones(g, jnp.float32)
    a, toks = accept_drafts(logits, jnp.asarray(drafts), jnp.full(g, k, jnp.int32), qs, keys, ones, ones)
    a, toks = np.asarray(a), np.asarray(toks)
    assert 0 < (a == 0).mean() < 1 and (a == k).any()  # rejections and full acceptances both happen
    first = np.bincount(toks[:, 0], minlength=v) / g
    assert np.abs(first - p).max() < 4 * np.sqrt(p * (1 - p) / g).max()
    two = a >= 1  # the second emitted token exists when the first draft was accepted
    second = np.bincount(toks[two, 1], minlength=v) / two.sum()
    assert np.abs(second - p).max() < 4 * np.sqrt(p * (1 - p) / two.sum()).max()
    took = a[:, None] > np.arange(k)
    assert np.all(toks[:, :k][took] == drafts[took])  # accepted positions emit the drafts themselves
    # acceptance of the first draft: sum_x min(p, q) (the overlap), here 0.1 + 0.1 + 0.2 + 0.1 + 0.05
    assert abs((a >= 1).mean() - np.minimum(p, q).sum()) < 4 * np.sqrt(0.25 / g)


def test_nucleus_probs_cut_and_renormalise():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]], jnp.float32))
    np.testing.assert_allclose(nucleus_probs(logits, jnp.ones(1), jnp.asarray([0.7])), [[0.625, 0.375, 0, 0]],
                               atol=1e-6)
    np.testing.assert_allclose(nucleus_probs(logits, jnp.ones(1), jnp.ones(1)), [[0.5, 0.3, 0.15, 0.05]], atol=1e-6)


# ---- the nextn layer against float64 numpy --------------------------------------------------------------------

def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x, pos, theta):
    """Interleaved RoPE over the last axis of x [T, ..., d] at positions pos [T] (SPEC §2)."""
    d = x.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, d, 2) / d)
    ang = ang.reshape(ang.shape[:1] + (1,) * (x.ndim - 2) + ang.shape[1:])
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)
    return out


def _decoder_layer(w, x, pos, cfg):
    """One decoder layer (SPEC §2) in float64 over rows x [T, D] at positions 0..T-1, dense causal attention (the
    indexer's top-k keeps every position while T <= index_topk), MoE with group-limited sigmoid routing."""
    t, nh = x.shape[0], cfg.num_attention_heads
    dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    h = _rms(x, w("input_layernorm"), cfg.rms_norm_eps)
    qr = _rms(h @ w("self_attn.q_a_proj").T, w("self_attn.q_a_layernorm"), 1e-6)
    q = (qr @ w("self_attn.q_b_proj").T).reshape(t, nh, dn + dr)
    c = h @ w("self_attn.kv_a_proj_with_mqa").T
    kv = _rms(c[:, :r], w("self_attn.kv_a_layernorm"), 1e-6)
    k_pe = _rope(c[:, r:], pos, cfg.rope_theta)
    kvb = (kv @ w("self_attn.kv_b_proj").T).reshape(t, nh, dn + dv)
    q_pe = _rope(q[..., dn:], pos, cfg.rope_theta)
    s = np.einsum("thd,shd->hts", q[..., :dn], kvb[..., :dn]) + np.einsum("thd,sd->hts", q_pe, k_pe)
    s = s * cfg.softmax_scale + np.where(np.tril(np.ones((t, t))) > 0, 0, -np.inf)
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", prob, kvb[..., dn:]).reshape(t, nh * dv)
    x = x + o @ w("self_attn.o_proj").T
    h = _rms(x, w("post_attention_layernorm"), cfg.rms_norm_eps)

    def swiglu(pre, v):
        g, u = v @ w(pre + "gate_proj").T, v @ w(pre + "up_proj").T
        return (g / (1 + np.exp(-g)) * u) @ w(pre + "down_proj").T

    sc = 1 / (1 + np.exp(-(h @ w("mlp.gate").T)))
    choice = sc + w("mlp.gate.e_score_correction_bias")
    e, ng = cfg.n_routed_experts, cfg.n_group
    grouped = choice.reshape(t, ng, e // ng)
    gscore = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    keep = np.argsort(-gscore, axis=-1, kind="stable")[:, : cfg.topk_group]
    mask = np.zeros((t, ng), bool)
    mask[np.arange(t)[:, None], keep] = True
    choice = np.where(np.repeat(mask, e // ng, axis=1), choice, -np.inf)
    out = swiglu("mlp.shared_experts.", h)
    for i in range(t):
        top = np.argsort(-choice[i], kind="stable")[: cfg.num_experts_per_tok]
        wt = sc[i, top] / (sc[i, top].sum() + 1e-20) * cfg.routed_scaling_factor
        for ex, we in zip(top, wt):
            out[i] += we * swiglu(f"mlp.experts.{ex}.", h[i:i + 1])[0]
    return x + out


def _nextn_numpy(ckpt, h, tokens, pos, cfg, shared_head):
    """SPEC §12 in float64: hn rows and logits of the nextn layer for hidden states h [T, D], tokens [T]."""
    pre = f"model.layers.{cfg.num_hidden_layers}."

    def w(name):
        key = name if name.startswith("model.") or name == "lm_head.weight" else pre + name
        key = key if key.endswith(("weight", "bias")) else key + ".weight"
        return np.asarray(ckpt.read(key), np.float64)

    e = w("model.embed_tokens.weight")[tokens]
    e[pos == 0] = 0.0  # vLLM's mask of position 0's embedding
    u = np.concatenate([_rms(e, w("enorm"), cfg.rms_norm_eps), _rms(h, w("hnorm"), cfg.rms_norm_eps)], axis=-1)
    z = _decoder_layer(w, u @ w("eh_proj").T, pos, cfg)
    hn = _rms(z, w("shared_head.norm"), cfg.rms_norm_eps)
    head = w("shared_head.head") if shared_head else w("lm_head.weight")
    return hn, hn @ head.T


@pytest.mark.parametrize("shared_head,tp,dcp", [(True, 1, 1), (False, 2, 2)])
def test_nextn_logits_match_float64_numpy(tmp_path, shared_head, tp, dcp):
    """Rows at positions 0..5 (each: a hidden state and the token after it), then one chained row at position 6
    fed the last row's normed output: hidden states and logits within float32 rounding of float64."""
    write_random_checkpoint(CFG, tmp_path, seed=9, dtype="float32", progress=False, with_mtp=True,
                            mtp_shared_head=shared_head)
    eng = _load(tmp_path, k=1, parallel=ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp))
    assert ("head" in eng.spec.mtp_params) == shared_head
    t = 6
    rng = np.random.default_rng(2)
    h = rng.standard_normal((t + 1, CFG.hidden_size)).astype(np.float32)
    tokens = rng.integers(0, CFG.vocab_size, t + 1)
    par = resolve_parallel(eng.parallel, CFG)
    target_caches, batch = prefill_inputs(eng.params, tokens[None, :t], config=CFG, parallel=par)
    caches = allocate_mtp_caches(CFG, target_caches["mla"][0].shape[0], 16, jnp.float32)
    run = jax.jit(lambda caches, h, batch: run_mtp(eng.params, eng.spec.mtp_params, caches, h, batch, config=CFG,
                                                    parallel=par, options=StepOptions()))
    hn, logits, caches = run(caches, jnp.asarray(h[:t]), batch)
    slot = owner_slots(np.asarray(batch.block_tables), [0], [t], 16, par.dcp, par.interleave)
    chained = type(batch)(jnp.asarray(tokens[t:], jnp.int32), jnp.asarray([t], jnp.int32), jnp.asarray(slot),
                          batch.token_req[:1], batch.block_tables, jnp.zeros(1, jnp.int32))
    hn2, logits2, _ = run(caches, hn[t - 1:t], chained)
    ck = HFCheckpoint(tmp_path)
    want_hn, want = _nextn_numpy(ck, h[:t].astype(np.float64), tokens[:t], np.arange(t), CFG, shared_head)
    np.testing.assert_allclose(np.asarray(hn), want_hn, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-4)
    h_all = np.concatenate([h[:t], np.asarray(hn)[t - 1:t]]).astype(np.float64)
    _, want_all = _nextn_numpy(ck, h_all, tokens, np.arange(t + 1), CFG, shared_head)
    np.testing.assert_allclose(np.asarray(logits2), want_all[t:], rtol=1e-4, atol=1e-4)
    assert np.isfinite(np.asarray(logits)).all()
