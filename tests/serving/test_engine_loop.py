"""The engine's serving loop on the tiny model (float32, CPU): continuous admission, preemption, streaming, abort,
the per-request sampling rule, warm-up, host-overhead figures. Oracles: an unconstrained run of the same prompts,
each prompt alone, and full-prefill logits sampled with the documented key rule."""

import jax
import numpy as np
import pytest

import glm_dsa
from glm_dsa import configs
from glm_dsa.serving.sampling import SamplingParams, sample

CFG = configs.tiny


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def eng(ckpt):
    """6 usable pages of 16 tokens: two sequences past 32 tokens (3 pages each) fill the cache."""
    return glm_dsa.load(ckpt, dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                        num_pages=7, progress=False)


def _all_pages_free(e):
    return e.allocator.free == e.num_pages - 1 and not e.scheduler.has_work


def test_preemption_under_a_tiny_page_budget_gives_the_same_tokens(ckpt, eng):
    ps = _prompts(0, [20, 9, 26, 14, 5, 17])
    want = [eng.generate([p], max_new_tokens=24, stop_token_ids=[])[0] for p in ps]  # alone: never short of pages
    assert eng.last_timings["preemptions"] == 0
    got = eng.generate(ps, max_new_tokens=24, stop_token_ids=[])
    assert eng.last_timings["preemptions"] > 0
    assert got == want
    assert _all_pages_free(eng)
    with pytest.raises(ValueError, match="need 4 KV cache pages per rank, more than the cache's 3"):
        glm_dsa.load(ckpt, dtype="float32", max_model_len=64, num_pages=4, progress=False).generate(
            [[1] * 40], max_new_tokens=20)


def test_a_request_arriving_while_others_decode_is_admitted_before_they_finish(eng):
    a, b = _prompts(1, [12, 7])
    long = eng.submit(a, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[]))
    while len(long.output) < 3:
        eng.step()
    short = eng.submit(b, SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=[]))
    steps = 0
    while not short.finished:
        eng.step()
        steps += 1
    assert not long.finished and 3 <= len(long.output) < 30
    assert steps <= 6  # prefill, 2 decode steps, the lag: not the 27 steps left to the long request
    assert list(long) and long.finish_reason == "length"  # iterating drives the engine to the end
    assert short.output == eng.generate([b], max_new_tokens=3, stop_token_ids=[])[0]
    assert long.output == eng.generate([a], max_new_tokens=30, stop_token_ids=[])[0]
    assert _all_pages_free(eng)


def test_draws_depend_only_on_seed_prompt_index_and_token_index(eng):
    ps = _prompts(2, [6, 11, 4])
    kw = dict(temperature=1.0, seed=123, stop_token_ids=[])
    together = eng.generate(ps, max_new_tokens=5, **kw)
    alone = eng.submit(ps[2], SamplingParams(max_tokens=5, **kw), prompt_index=2)
    assert list(alone) == together[2]
    # the documented rule on full-prefill logits: token n of prompt i uses fold_in(fold_in(key(seed), n), i)
    seq = list(ps[1])
    for n in range(5):
        logits = eng.logits(np.asarray([seq]))[0, -1]
        key = jax.random.fold_in(jax.random.fold_in(SamplingParams(seed=123).key(), n), 1)
        seq.append(int(sample(logits[None], key[None], np.float32([1.0]), np.float32([1.0]))[0]))
    assert together[1] == seq[len(ps[1]):]


def test_stream_yields_generate_tokens_and_closing_it_frees_pages(eng):
    ps = _prompts(3, [8, 15, 3])
    want = eng.generate(ps, max_new_tokens=6, stop_token_ids=[])
    got = [[] for _ in ps]
    for i, tok in eng.stream(ps, max_new_tokens=6, stop_token_ids=[]):
        got[i].append(tok)
    assert got == want
    it = eng.stream(ps, max_new_tokens=40, stop_token_ids=[])
    for _ in range(4):
        next(it)
    assert eng.scheduler.pages_used() > 0
    it.close()
    assert _all_pages_free(eng)


def test_abort_by_request_id_frees_the_pages(eng):
    s = eng.submit(_prompts(4, [10])[0], SamplingParams(max_tokens=40, stop_token_ids=[]), request_id="mine")
    got = []
    for tok in s:
        got.append(tok)
        if len(got) == 2:
            eng.abort("mine")
    assert s.finish_reason == "abort" and 2 <= len(got) < 40
    assert _all_pages_free(eng)
    with pytest.raises(RuntimeError, match="needs the engine loop running in the background"):
        s.__aiter__().__anext__().send(None)


def test_warmup_compiles_every_step_generate_runs(ckpt):
    # 30 prefill rows and 3 decode rows per step: two row buckets, so two compiled steps
    e = glm_dsa.load(ckpt, dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                     progress=False)
    e.warmup(3, 10, 6)
    compiled = e.runner.serve_step._cache_size()
    assert compiled >= 2 and _all_pages_free(e)
    e.generate(_prompts(5, [10, 10, 10]), max_new_tokens=6, stop_token_ids=[])
    assert e.runner.serve_step._cache_size() == compiled
    t = e.last_timings
    assert t["steps"] >= 6 and t["decode_steps"] >= 4 and 0 < t["host_ms_per_step"] <= t["step_ms"]
    m = e.metrics()
    assert m["running"] == m["waiting"] == m["kv_pages_used"] == 0 and m["kv_pages_free"] == e.num_pages - 1
    assert m["generated_tokens"] >= 18 and m["steps"] >= t["steps"]


def test_an_engine_whose_streams_finished_is_freed_at_once(ckpt):
    """A finished request drops its stream's callbacks, so an engine (and its device caches) whose finished streams
    are dropped goes by reference counting alone, before the next engine sizes its caches from free memory; with
    the callbacks kept, request and stream hold each other and the engine waits for a gc pass."""
    import gc
    import weakref
    e = glm_dsa.load(ckpt, dtype="float32", max_model_len=64, max_num_seqs=2, num_pages=7, progress=False)
    s = e.submit(_prompts(3, [5])[0], SamplingParams(temperature=0.0, max_tokens=2, stop_token_ids=[]))
    assert len(list(s)) == 2 and s.finish_reason == "length"
    assert s.request.on_token is None and s.request.on_finish is None
    ref = weakref.ref(e)
    gc.disable()
    try:
        del s, e
        assert ref() is None
    finally:
        gc.enable()
