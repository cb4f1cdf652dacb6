"""The paged-cache engine against the cache-free `forward` (an independent path: no pages, no chunks, no
decode steps), plus its API contract: errors, sampling, stop ids, no recompilation per token."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm_dsa
from glm_dsa import configs

CFG = configs.tiny  # the fixtures `ckpt` and `eng` (conftest.py) hold a random checkpoint of it


@functools.lru_cache(maxsize=None)
def _jit_forward(config):
    return jax.jit(functools.partial(glm_dsa.forward, config=config))


def _fwd(eng, ids):
    return np.asarray(_jit_forward(eng.config)(eng.params, jnp.asarray(ids)))


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


def test_logits_match_forward_and_chunked_prefill(ckpt, eng):
    ids = np.asarray(_prompts(0, [21, 21]))  # 21 > index_topk: the indexer's selection matters
    want = _fwd(eng, ids)
    np.testing.assert_allclose(eng.logits(ids), want, atol=2e-5)
    chunked = glm_dsa.load(ckpt, dtype="float32", max_model_len=64, progress=False, max_num_batched_tokens=5,
                           block_size=4)
    np.testing.assert_allclose(chunked.logits(ids), want, atol=2e-5)


def test_greedy_generate_matches_full_recompute(eng):
    prompts = _prompts(1, [3, 12, 17])
    out = eng.generate(prompts, max_new_tokens=10, stop_token_ids=[])
    for p, new in zip(prompts, out):
        seq = list(p)
        for _ in range(10):
            # causal: trailing padding does not change row len-1, so one padded length compiles once
            padded = np.zeros((1, 32), np.int64)
            padded[0, : len(seq)] = seq
            seq.append(int(np.argmax(_fwd(eng, padded)[0, len(seq) - 1])))
        assert new == seq[len(p):]


def test_mixed_prefill_and_decode_rows_in_one_step(eng):
    """A decode row of request 0 and a prefill chunk of request 1 in one ragged batch, through `glm_dsa.step`."""
    a, b = _prompts(2, [9, 13])
    bs = 4
    caches = jax.tree.map(jnp.zeros_like, eng.caches)
    tables = np.array([[1, 2, 3, 0], [4, 5, 6, 7]], np.int32)
    run = jax.jit(functools.partial(glm_dsa.step, config=eng.config))

    def batch(rows, logits_rows):
        req = np.array([r for r, _, _ in rows], np.int32)
        pos = np.array([p for _, p, _ in rows], np.int32)
        ids = np.array([t for _, _, t in rows], np.int32)
        slots = tables[req, pos // bs] * bs + pos % bs
        return glm_dsa.StepBatch(*(jnp.asarray(x) for x in (ids, pos, slots, req, tables,
                                                            np.asarray(logits_rows, np.int32))))

    caches4 = jax.tree.map(lambda c: c.reshape(-1, bs, c.shape[-1])[: 8], caches)
    _, caches4 = run(eng.params, caches4, batch([(0, p, t) for p, t in enumerate(a[:8])], [7]))
    rows = [(0, 8, a[8])] + [(1, p, t) for p, t in enumerate(b)]
    logits, _ = run(eng.params, caches4, batch(rows, [0, len(rows) - 1]))
    np.testing.assert_allclose(np.asarray(logits[0]), _fwd(eng, np.asarray([a]))[0, -1], atol=2e-5)
    np.testing.assert_allclose(np.asarray(logits[1]), _fwd(eng, np.asarray([b]))[0, -1], atol=2e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_single_device(ckpt, eng, tp):
    ids = np.asarray(_prompts(3, [19]))
    par = glm_dsa.load(ckpt, dtype="float32", max_model_len=64, progress=False,
                       parallel=glm_dsa.ParallelConfig(tensor_parallel_size=tp))
    q_b = par.params["layers"][0]["attn"]["q_b_proj"]
    assert len(q_b.sharding.device_set) == tp
    assert q_b.addressable_shards[0].data.shape[1] == CFG.num_attention_heads // tp
    np.testing.assert_allclose(par.logits(ids), eng.logits(ids), atol=2e-5)


def test_input_errors_name_the_culprit(eng):
    with pytest.raises(ValueError, match=r"prompt 1 has 65 tokens, longer than max_model_len=64"):
        eng.generate([[1, 2], [3] * 65], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt 0, position 2: token id 256 is outside the vocabulary \[0, 256\)"):
        eng.generate([[1, 2, 256]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"token id -3"):
        eng.logits(np.array([[1, -3]]))
    with pytest.raises(ValueError, match="integer array"):
        eng.logits(np.ones((2, 3), np.float32))
    assert eng.allocator.free == eng.num_pages - 1  # nothing leaked by the failed calls


def test_sampling_seeded_and_top_p(eng):
    prompts = _prompts(4, [5, 8])
    kw = dict(max_new_tokens=6, stop_token_ids=[])
    a = eng.generate(prompts, temperature=1.0, seed=7, **kw)
    assert a == eng.generate(prompts, temperature=1.0, seed=7, **kw)
    assert a != eng.generate(prompts, temperature=1.0, seed=8, **kw)
    assert all(0 <= t < CFG.vocab_size for s in a for t in s)
    # a nucleus smaller than the top token's mass keeps only the top token: greedy
    assert eng.generate(prompts, temperature=0.7, top_p=1e-6, **kw) == eng.generate(prompts, **kw)


def test_stop_ids_and_max_model_len(eng):
    p = _prompts(5, [6])
    first = eng.generate(p, max_new_tokens=4, stop_token_ids=[])[0]
    assert eng.generate(p, max_new_tokens=4, stop_token_ids=[first[0]]) == [[first[0]]]
    long = _prompts(6, [62])
    assert len(eng.generate(long, max_new_tokens=10, stop_token_ids=[])[0]) == 2  # stops at max_model_len 64


def test_generate_records_its_timings(eng):
    out = eng.generate(_prompts(11, [5, 9]), max_new_tokens=4, stop_token_ids=[])
    t = eng.last_timings
    assert [len(o) for o in out] == [4, 4] and t["decode_steps"] == 3
    assert t["prefill_s"] > 0 and t["decode_s"] > 0


def test_compiled_steps_are_reused(eng):
    prompts = _prompts(7, [4, 6])
    eng.generate(prompts, max_new_tokens=5, stop_token_ids=[])
    before = eng.runner.serve_step._cache_size()  # generate's compiled step (the model step with its sampler)
    eng.generate(_prompts(8, [5, 7]), max_new_tokens=9, stop_token_ids=[])  # same buckets, more tokens
    assert eng.runner.serve_step._cache_size() == before


@pytest.mark.parametrize("mode", ["gather", "dense", "tiles", "ragged"])
def test_moe_forms_agree(eng, monkeypatch, mode):
    """The routed-expert forms (gathered weights, masked dense, expert tiles, ragged_dot) give the same logits;
    the form is forced through StepOptions.moe_mode, which reaches every MoE layer's op."""
    from glm_dsa.model.options import StepOptions
    from kernels import moe as moe_mod
    ids = np.asarray(_prompts(9, [13]))
    want = _fwd(eng, ids)
    forms = []
    experts_xla = moe_mod.experts_xla
    monkeypatch.setattr(moe_mod, "experts_xla", lambda *a, mode=None: forms.append(mode) or experts_xla(*a, mode=mode))
    fwd = functools.partial(glm_dsa.forward, config=eng.config, options=StepOptions(moe_mode=mode))
    got = np.asarray(jax.jit(fwd)(eng.params, jnp.asarray(ids)))
    assert forms == [mode] * sum(map(eng.config.is_moe, range(eng.config.num_hidden_layers)))
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_fp8_cache_close_to_bf16_cache(ckpt):
    """fp8_ds_mla caches on a model with the usual init: relative L2 logit error vs a bf16 cache <= 0.01
    (measured ~0.003: e4m3 moves each cached vector by ~2.5%, and attention averages over many rows)."""
    ids = np.asarray(_prompts(10, [40, 40]))
    kw = dict(dtype="float32", max_model_len=64, progress=False)
    a = glm_dsa.load(ckpt, kv_cache_dtype="bfloat16", **kw).logits(ids)
    b = glm_dsa.load(ckpt, kv_cache_dtype="fp8_ds_mla", **kw).logits(ids)
    assert np.linalg.norm(b - a) / np.linalg.norm(a) <= 0.01
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9
    eng = glm_dsa.load(ckpt, kv_cache_dtype="fp8_ds_mla", **kw)
    assert eng.caches["mla"][0].dtype == jnp.uint8 and eng.caches["mla"][0].shape[-1] == 68  # 32 + 4 + 2 * 16


def test_fp8_cache_pages_capped_for_the_kernels_offsets():
    """FP8 rows per layer (656 B for GLM-5.2) x pages x block stay under 2**31 bytes on the Triton path."""
    from glm_dsa import configs
    from glm_dsa.model.paged_cache import max_addressable_pages
    cfg = configs.get("glm52")
    pages = max_addressable_pages(cfg, 64, "fp8_ds_mla")
    assert pages == (2**31 - 1) // (64 * 656) and max_addressable_pages(cfg, 64, "bfloat16") is None
    with pytest.raises(ValueError, match="num_pages=60000"):
        glm_dsa.Engine(cfg, None, kv_cache_dtype="fp8_ds_mla", impl="triton", block_size=64, num_pages=60000)


def test_pages_sized_from_free_device_memory(ckpt, monkeypatch):
    from glm_dsa.serving import runner as runner_mod
    from glm_dsa.model.paged_cache import cache_bytes_per_token, plan_pages
    # by hand: 10 pages per sequence of 1 KiB each; 25.6 KiB free at fraction 0.5 -> 12 pages -> 1 sequence
    assert plan_pages(max_num_seqs=4, pages_per_seq=10, page_bytes=1024, free_bytes=25600,
                      memory_fraction=0.5) == (12, 1)
    assert plan_pages(max_num_seqs=4, pages_per_seq=10, page_bytes=1024, free_bytes=None,
                      memory_fraction=0.5) == (41, 4)  # unknown (CPU): what max_num_seqs needs
    with pytest.raises(ValueError, match="one sequence of max_model_len needs"):
        plan_pages(max_num_seqs=4, pages_per_seq=10, page_bytes=1024, free_bytes=10240, memory_fraction=0.5)
    # FP8 caches: at most max_pages (2 GiB per layer): 25 pages hold 2 sequences of 10 (+ the padding page)
    assert plan_pages(max_num_seqs=4, pages_per_seq=10, page_bytes=1024, free_bytes=None, memory_fraction=0.5,
                      max_pages=25) == (25, 2)
    with pytest.raises(ValueError, match="under 2 GiB per layer"):
        plan_pages(max_num_seqs=4, pages_per_seq=10, page_bytes=1024, free_bytes=None, memory_fraction=0.5,
                   max_pages=10)
    page = 16 * cache_bytes_per_token(CFG, "float32")
    monkeypatch.setattr(runner_mod, "free_device_bytes", lambda device: int(9.5 * page / 0.8))
    eng = glm_dsa.load(ckpt, dtype="float32", max_model_len=64, progress=False, max_num_seqs=8)
    assert (eng.num_pages, eng.max_num_seqs) == (9, 2)  # 4 pages per sequence of 64 tokens
    assert eng.generate(_prompts(11, [5, 6, 7]), max_new_tokens=2, stop_token_ids=[])  # served in groups of 2
