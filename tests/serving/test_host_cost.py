"""The serving loop's host work per decode step does not grow with the context: a step sends the rows, the
logits rows and the block-table entries that changed, never whole block tables (which grow with the pages a
request holds). Measured by what is built, not by the clock: the bytes of the host arrays each step hands to the
device, and the device-to-host reads (one per step: the previous step's ids)."""

import jax
import numpy as np

import glm_dsa
from glm_dsa import configs

CFG = configs.tiny


def _decode_step_bytes(eng, prompt_len: int, batch: int = 2) -> int:
    rng = np.random.default_rng(prompt_len)
    prompts = [rng.integers(0, CFG.vocab_size, prompt_len).tolist() for _ in range(batch)]
    syncs0, steps0 = eng.stats.syncs, eng.stats.steps
    eng.generate(prompts, max_new_tokens=3, stop_token_ids=[])
    assert eng.stats.syncs - syncs0 == eng.stats.steps - steps0  # one read per step, nothing else waits
    return eng.stats.last_h2d_bytes  # the last step decodes one row per prompt


def test_bytes_sent_per_decode_step_do_not_grow_with_the_context(ckpt):
    eng = glm_dsa.load(ckpt, dtype="float32", max_model_len=2048 + 8, block_size=16, max_num_seqs=2,
                       max_num_batched_tokens=4096, num_pages=2 * 130 + 1, progress=False)
    short = _decode_step_bytes(eng, 256)  # 16 pages per request
    long = _decode_step_bytes(eng, 2048)  # 128 pages per request: 8x the block-table entries
    assert eng.pages_per_seq >= 128
    assert 0 < long <= 2 * short, (short, long)


class _DeviceIds:
    """What the stubbed step returns for its sampled ids: records when the loop copies them to the host."""

    def __init__(self, k: int, events: list, n: int):
        self.k, self.events, self.n = k, events, n

    def __array__(self, dtype=None, copy=None):
        self.events.append(("read", self.k))
        return np.zeros(self.n, np.int32)


def test_the_loop_launches_the_next_step_before_reading_the_last_ones_ids_and_sends_one_buffer():
    """The host overlaps the device only if step n + 1 is launched before step n's ids are read (the read blocks
    until step n is done) and nothing else blocks in between; and each step's host inputs go as one transfer."""
    from glm_dsa.serving.engine import Engine
    from glm_dsa.model.random_init import init_params
    eng = Engine(CFG, init_params(CFG, seed=0, dtype="float32"), dtype="float32", max_model_len=64, block_size=16,
                 max_num_seqs=4, max_num_batched_tokens=64)
    events, host_arrays = [], []

    def step(params, caches, tables, *args, **kw):
        host_arrays.append(sum(isinstance(a, np.ndarray) for a in args))
        k = len(host_arrays) - 1
        events.append(("launch", k))
        return _DeviceIds(k, events, eng.runner.n_out), caches, tables
    eng.runner.serve_step = step
    rng = np.random.default_rng(0)
    eng.generate([rng.integers(0, CFG.vocab_size, n).tolist() for n in (5, 20, 9)], 6, stop_token_ids=[])
    n = len(host_arrays)
    assert n == 6 and host_arrays == [1] * n  # one prefill step (the first tokens), one per later token
    reads = [k for kind, k in events if kind == "read"]
    assert reads == list(range(n))  # every step's ids read once, in order
    for k in range(n - 1):
        assert events.index(("launch", k + 1)) < events.index(("read", k)), events


def test_bench_host_overhead_replays_the_decode_steps_and_gives_the_engine_back():
    """benchmarks/bench_serving.py's device time per decode step comes from replaying the recorded decode steps:
    every decode step is recorded and replayed without compiling, and the engine is left as it was (its own
    dispatch and compiled step, the same tokens from a later generate)."""
    from benchmarks.bench_serving import host_overhead
    from glm_dsa.serving.engine import Engine
    from glm_dsa.model.random_init import init_params
    eng = Engine(CFG, init_params(CFG, seed=0, dtype="float32"), dtype="float32", max_model_len=64, block_size=16,
                 max_num_seqs=2, max_num_batched_tokens=64)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, CFG.vocab_size, 12).tolist() for _ in range(2)]
    eng.warmup(2, 12, 5)
    before = eng.generate(prompts, 5, stop_token_ids=[])
    row = host_overhead(eng, prompts, 5)
    assert row["B"] == 2 and row["decode_steps"] == row["window_steps"] == 4 and row["compiles"] == 0
    assert row["device_step_ms"] > 0 and abs(row["idle_ms"] - (row["step_ms"] - row["device_step_ms"])) < 1e-9
    assert "execute" not in vars(eng.runner) and "process" not in vars(eng.scheduler)
    assert hasattr(eng.runner.serve_step, "_cache_size")
    assert eng.generate(prompts, 5, stop_token_ids=[]) == before


def _chat(eng, arrivals, system, turns=2, max_tokens=3):
    """Conversations on one system prompt through `eng`'s loop in this thread: conversation i's first turn is
    submitted at loop step arrivals[i], each later turn (the prompt so far, the answer, 3 new tokens) as soon as
    the previous answer is complete. Returns every answer and the step shapes met (`ModelRunner.step_shapes`)."""
    from glm_dsa.serving.sampling import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[])
    shapes, execute = set(), eng.runner.execute

    def recording(plan, dry=None):
        shapes.add(eng.runner.step_shapes(plan))
        return execute(plan, dry)
    eng.runner.execute = recording
    prompts = {i: system + [2 + i, 3 + i] for i in range(len(arrivals))}
    done, live, answers, step = {i: 0 for i in prompts}, {}, [], 0
    try:
        while len(answers) < turns * len(prompts):
            for i in prompts:
                if i not in live and done[i] < turns and step >= arrivals[i]:
                    live[i] = eng.submit(prompts[i], params, prompt_index=i)
            eng.step()
            step += 1
            for i, s in list(live.items()):
                if s.finished:
                    del live[i]
                    answers.append(s.output)
                    done[i] += 1
                    prompts[i] = prompts[i] + s.output + [4, 5, 6]
    finally:
        del eng.runner.execute
    return answers, shapes


def test_prefix_cached_chats_compile_no_step_in_the_loop_after_warmup_steps():
    """With prefix caching the rows of a step follow the arrival timing (an admission computes only its uncached
    tail, beside however many decode rows run then), so serving sample traffic does not meet every step shape the
    loop can reach: a chat arriving with other timings met shapes the first did not, and each compiled inside
    the loop, stalling every request (on the GPU, seconds per shape: the multi-turn benchmark's host time per
    step and TTFT p99 with caching were those compiles). `Engine.warmup_steps` compiles every shape ahead: then
    no timing compiles anything, and its padding steps leave the caches and the cached pages as they were."""
    from glm_dsa.serving.engine import Engine
    from glm_dsa.model.random_init import init_params
    params = init_params(CFG, seed=0, dtype="float32")
    system = np.random.default_rng(3).integers(2, CFG.vocab_size, 18).tolist()
    timings = ([0] * 9, [0, 1, 2, 20, 21, 40, 41, 60, 61])  # all at once; in pairs, a few running at a time
    kw = dict(dtype="float32", max_model_len=64, block_size=4, num_pages=160, max_num_seqs=9,
              max_num_batched_tokens=64)

    plain = Engine(CFG, params, **kw)
    _, seen = _chat(plain, timings[0], system)
    compiled = plain.runner.serve_step._cache_size()
    plain_answers, seen_later = _chat(plain, timings[1], system)
    assert seen_later - seen and plain.runner.serve_step._cache_size() > compiled  # the old way: compiles later

    eng = Engine(CFG, params, **kw)
    _chat(eng, timings[0], system)  # caches and cached pages to keep
    caches = [np.asarray(c) for c in jax.tree.leaves(eng.caches)]
    tables = np.asarray(eng.runner.tables)
    cached = eng.scheduler.cached_pages
    n = eng.warmup_steps(pages=range(1, 9))  # prompts and answers within 8 pages: one block-table width
    assert n == len(eng.runner.serving_shapes(64, {8})) - len(seen) > 0  # every shape not compiled yet, once
    for a, b in zip(caches, jax.tree.leaves(eng.caches)):
        np.testing.assert_array_equal(a, np.asarray(b))
    np.testing.assert_array_equal(tables, np.asarray(eng.runner.tables))
    assert eng.scheduler.cached_pages == cached and eng.warmup_steps(pages=[8]) == 0
    compiled = eng.runner.serve_step._cache_size()
    answers, _ = _chat(eng, timings[1], system)  # reads the pages cached before the warm-up
    assert eng.runner.serve_step._cache_size() == compiled  # nothing compiled in the loop
    assert eng.metrics()["prefix_cache_hits"] > 0
    assert answers == plain_answers


def test_warmup_steps_covers_batch_invariant_steps():
    """Batch-invariant mode: warmup_steps compiles the prompt rows and every decode bucket a step of at most
    max_rows rows pads to (8 up to the decode rows), so a generate compiles no step of its own; here its decode
    steps of 3 requests are the 8-row bucket, under the decode rows (32)."""
    from glm_dsa.serving.engine import Engine
    from glm_dsa.model.random_init import init_params
    eng = Engine(CFG, init_params(CFG, seed=0, dtype="float32"), dtype="float32", max_model_len=64, block_size=4,
                 max_num_seqs=4, max_num_batched_tokens=64, batch_invariant=True, invariant_step_rows=(64, 32))
    width, nr = eng.pages_per_seq, 8
    assert eng.runner.serving_shapes(64) == [(8, width, nr), (16, width, nr), (32, width, nr), (64, width, nr)]
    assert eng.runner.serving_shapes(12) == [(8, width, nr), (16, width, nr), (64, width, nr)]
    assert eng.warmup_steps() == 4
    rng = np.random.default_rng(2)
    eng.generate([rng.integers(0, CFG.vocab_size, n).tolist() for n in (5, 40, 9)], 4, stop_token_ids=[])
    assert eng.runner.serve_step._cache_size() == 4
