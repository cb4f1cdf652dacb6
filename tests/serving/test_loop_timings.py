"""`Engine.last_timings`' decode figures time the loop's decode steps only: a loop turn's wall time counts as
decode time when the step whose ids it waited for was decode-only (the turn launching the first decode step waits
for the last prefill step). The device is stubbed: its steps take known times."""

import time

import numpy as np

from glm_dsa import configs

CFG = configs.tiny


class _SlowIds:
    """Stubbed sampled ids whose host copy takes `wait_s` (the device finishing the step), noting when it ended."""

    def __init__(self, wait_s: float, n: int, reads: list, decode: bool):
        self.wait_s, self.n, self.reads, self.decode = wait_s, n, reads, decode

    def __array__(self, dtype=None, copy=None):
        time.sleep(self.wait_s)
        self.reads.append((time.perf_counter(), self.decode))
        return np.zeros(self.n, np.int32)


def test_decode_step_ms_excludes_the_wait_for_the_last_prefill_step():
    """The turn launching the first decode step waits for the last prefill step's ids: a slow prefill step must not
    enter decode_step_ms, which is the wall time per decode step from the host receiving the last prefill step's
    ids to its receiving the last decode step's (benchmarks/bench_serving.py's window, computed here from when the
    stubbed ids reached the host)."""
    from glm_dsa.serving.engine import Engine
    from glm_dsa.model.random_init import init_params
    eng = Engine(CFG, init_params(CFG, seed=0, dtype="float32"), dtype="float32", max_model_len=64, block_size=16,
                 max_num_seqs=2, max_num_batched_tokens=64)
    prefill_s, decode_s, reads = 0.3, 0.01, []
    eng.runner.serve_step = lambda params, caches, tables, *args, **kw: (None, caches, tables)  # nothing compiled
    execute = eng.runner.execute

    def slow(plan, dry=None):
        execute(plan, dry)
        decode = plan.prefill_rows == 0
        return _SlowIds(decode_s if decode else prefill_s, eng.runner.n_out, reads, decode)
    eng.runner.execute = slow
    rng = np.random.default_rng(2)
    eng.generate([rng.integers(0, CFG.vocab_size, 7).tolist() for _ in range(2)], 5, stop_token_ids=[])
    t = eng.last_timings
    assert [d for _, d in reads] == [False] + [True] * 4  # one prefill step, then one decode step per token
    assert t["decode_steps"] == t["decode_timed_steps"] == 4
    window_ms = 1e3 * (reads[-1][0] - reads[0][0]) / 4
    assert 1e3 * decode_s <= t["decode_step_ms"] < 1e3 * decode_s + 20, t  # counting the prefill wait: >= 82 ms
    assert abs(t["decode_step_ms"] - window_ms) < 5, (t, window_ms)
    assert 0 <= t["decode_host_ms_per_step"] <= t["decode_step_ms"] - 1e3 * decode_s + 1e-6, t
