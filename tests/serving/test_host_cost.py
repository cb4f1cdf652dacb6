"""The serving loop's host work per decode step does not grow with the context: a step sends the rows, the
logits rows and the block-table entries that changed, never whole block tables (which grow with the pages a
request holds). Measured by what is built, not by the clock: the bytes of the host arrays each step hands to the
device, and the device-to-host reads (one per step: the previous step's ids)."""

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
