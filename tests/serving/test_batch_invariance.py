"""Batch-invariant mode (`Engine(batch_invariant=True)`) on the CPU: one request's tokens and logprobs, bitwise,
alone against the same request beside random others (at several row positions), with other prefill chunk sizes
(max_num_batched_tokens) and after a preemption. The oracle is the same request run alone.

On the CPU with this tiny float32 model the default mode happened to pass the same comparisons (XLA's CPU forms
at these shapes round alike); the GPU tests (tests/serving/test_gpu_batch_invariance.py) record the default
mode's differences as the negative control."""

import functools

import numpy as np
import pytest

import glm_dsa
from glm_dsa import configs

CFG = configs.tiny
NEW = 5  # decode steps compared


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


TARGET = _prompts(100, [13])[0]
OTHERS = _prompts(101, [9, 21, 4, 17, 30, 6, 12])


@functools.lru_cache(maxsize=None)
def _engine(ckpt, invariant: bool, max_num_batched_tokens: int, num_pages: int | None = None):
    return glm_dsa.load(ckpt, dtype="float32", max_model_len=64, block_size=4, max_num_seqs=8, progress=False,
                        max_num_batched_tokens=max_num_batched_tokens, num_pages=num_pages,
                        batch_invariant=invariant)


def _run(eng, prompts, at):
    """The target's Completion when it is prompt `at` of `prompts` (greedy: the prompt index does not enter)."""
    out = eng.generate(prompts, max_new_tokens=NEW, stop_token_ids=[], logprobs=4)
    return out[at]


def _same(a, b) -> bool:
    """Bitwise: the tokens, the float32 logprobs and every alternative with its logprob."""
    bits = lambda c: (c.token_ids, np.asarray(c.logprobs, np.float32).tobytes(),  # noqa: E731
                      [(list(t), np.asarray(list(t.values()), np.float32).tobytes()) for t in c.top_logprobs])
    return bits(a) == bits(b)


def _batches():
    """The target among others at the first, a middle and the last row position."""
    yield [TARGET] + OTHERS[:3], 0
    yield OTHERS[:3] + [TARGET] + OTHERS[3:7], 3
    yield OTHERS + [TARGET], len(OTHERS)


def test_a_request_is_bitwise_the_same_alone_and_in_batches(ckpt):
    eng = _engine(ckpt, True, 16)
    alone = _run(eng, [TARGET], 0)
    assert len(alone.logprobs) == NEW
    for prompts, at in _batches():
        assert _same(_run(eng, prompts, at), alone), f"target at row {at} of {len(prompts)}"
    # prefill in other chunk sizes: the prompt's last-token logprobs and every decode step's
    for mbt in (5, 64):
        other = _engine(ckpt, True, mbt)
        assert _same(_run(other, [TARGET], 0), alone), f"max_num_batched_tokens={mbt} alone"
        assert _same(_run(other, OTHERS[:3] + [TARGET], 3), alone), f"max_num_batched_tokens={mbt} in a batch"


def test_the_same_after_a_preemption(ckpt):
    alone = _run(_engine(ckpt, True, 16), [TARGET], 0)
    # 15 pages of 4 tokens: the eight requests cannot all hold their pages, so later ones are preempted and
    # recomputed (the target last, the newest arrival, preempted first)
    eng = _engine(ckpt, True, 16, 15)
    got = _run(eng, OTHERS + [TARGET], len(OTHERS))
    assert eng.last_timings["preemptions"] > 0
    assert _same(got, alone)


@pytest.mark.parametrize("tp,dcp", [(2, 2)])
def test_bitwise_the_same_on_a_tp_dcp_layout(ckpt, tp, dcp):
    """Under TP x DCP (a fixed layout): alone against a batch, and after a prefill in other chunks."""
    par = glm_dsa.ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp)
    eng = glm_dsa.load(ckpt, dtype="float32", max_model_len=64, block_size=4, max_num_seqs=8, progress=False,
                       max_num_batched_tokens=16, batch_invariant=True, parallel=par)
    alone = _run(eng, [TARGET], 0)
    assert _same(_run(eng, OTHERS[:5] + [TARGET], 5), alone)
    eng.scheduler.max_num_batched_tokens = 5  # the same compiled step, prefill in chunks of 5 rows
    assert _same(_run(eng, [TARGET] + OTHERS[:2], 0), alone)


def test_flag_is_checked_and_reaches_the_steps(ckpt):
    with pytest.raises(TypeError, match="batch_invariant"):
        glm_dsa.load(ckpt, dtype="float32", max_model_len=64, progress=False, batch_invariant=1)
    eng = _engine(ckpt, True, 16)
    assert eng.batch_invariant and eng.runner.options.batch_invariant
    with pytest.raises(TypeError, match="batch_invariant"):
        glm_dsa.StepOptions(batch_invariant="yes")
