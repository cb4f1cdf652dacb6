"""Batch-invariant mode (`Engine(batch_invariant=True)`) on the CPU: one request's tokens and logprobs, bitwise,
alone against the same request beside random others (at several row positions), with other prefill chunk sizes
(max_num_batched_tokens), after a preemption, and with its prompt's pages found in the prefix cache against
computed. The oracle is the same request run alone.

On the CPU this tiny float32 model's numbers do not move with the step's shape: the default mode passed the same
comparisons, and so did steps of 16 to 8192 rows against 256 (checked when the two step kinds came in). So the
bitwise comparisons here cannot see a token computed in the wrong shape; what guards that is structural: every
executed step is recorded (`_Steps`) and must hold prompt tokens only, padded to the prompt rows, or no prompt
token, padded to the power-of-two bucket of its rows up to the decode rows (`registry.decode_step_rows`), also
when a preempted request is recomputed; that a decode step computes a row alike at every bucket (the same rule
choices and launch configs, kernel bodies and XLA program, XLA's products at the decode rows) is checked by
tracing, in tests/model/test_invariant_buckets.py. The GPU tests (tests/serving/test_gpu_batch_invariance.py)
compare numbers where shapes do change them, with the default mode's differences as the negative control. The
engines here run steps of `ROWS` (the defaults, 8192 and 256 rows, cost more on a CPU; `test_default_step_rows`
runs them once). The engines run the xla impls (the CPU's), which take the same forms in both step kinds;
`test_prompt_steps_on_the_kernels` runs the GPU's Triton kernels interpreted, where the prompt steps take the
prefill forms (kernels.registry: the rules' `invariant_prompt`)."""

import collections
import functools

import numpy as np
import pytest

import glm_dsa
from glm_dsa import configs
from kernels import registry

CFG = configs.tiny
NEW = 5  # decode steps compared
ROWS = (64, 16)  # the prompt and most decode step rows of the engines here (Engine invariant_step_rows)


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


TARGET = _prompts(100, [13])[0]
OTHERS = _prompts(101, [9, 21, 4, 17, 30, 6, 12])


@functools.lru_cache(maxsize=None)
def _engine(ckpt, invariant: bool, max_num_batched_tokens: int, num_pages: int | None = None, rows=ROWS):
    return glm_dsa.load(ckpt, dtype="float32", max_model_len=64, block_size=4, max_num_seqs=8, progress=False,
                        max_num_batched_tokens=max_num_batched_tokens, num_pages=num_pages,
                        batch_invariant=invariant, invariant_step_rows=rows if invariant else None)


class _Steps:
    """Records every step `eng` executes: its padded rows and, per row, (request id, position, whether the token
    is a prompt token). `check` asserts the two kinds: a step of prompt tokens only has the prompt rows, a step of
    no prompt token the bucket of its rows (8, 16, ... up to the decode rows), never a mix."""

    def __init__(self, eng):
        self.eng, self.steps = eng, []
        self._execute = eng.runner.execute
        eng.runner.execute = self

    def __call__(self, plan, dry=None):
        t = self.eng.runner.step_shapes(plan)[0]
        self.steps.append((t, [(r.request_id, int(p), int(p) < len(r.prompt))
                               for r, p in zip((plan.requests[q] for q in plan.req), plan.pos)]))
        return self._execute(plan, dry)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        del self.eng.runner.execute  # the bound method again

    def check(self, rows):
        assert self.steps
        buckets = registry.decode_buckets(rows[1])
        for t, step in self.steps:
            kinds = {prompt for _, _, prompt in step}
            assert len(kinds) == 1, f"a step mixes prompt tokens and others: {step}"
            if kinds == {True}:
                assert t == rows[0], (t, step)
            else:  # the smallest bucket that holds its rows
                assert t in buckets and len(step) <= t and not [b for b in buckets if len(step) <= b < t], (t, step)

    def decode_rows(self) -> set:
        """The padded rows of the decode steps recorded."""
        return {t for t, step in self.steps if not any(p for _, _, p in step)}

    def computed(self) -> collections.Counter:
        """How often each (request id, position, whether a prompt token) was computed."""
        return collections.Counter(row for _, step in self.steps for row in step)


def _run(eng, prompts, at):
    """The target's Completion when it is prompt `at` of `prompts` (greedy: the prompt index does not enter),
    every prompt computed (the prefix cache emptied first)."""
    eng.reset_prefix_cache()
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
    with _Steps(eng) as steps:
        for prompts, at in _batches():
            assert _same(_run(eng, prompts, at), alone), f"target at row {at} of {len(prompts)}"
    steps.check(ROWS)
    # prefill in other chunk sizes (5 rows; 100, over the prompt rows: 64): the prompt's last-token logprobs and
    # every decode step's, from the same compiled steps (max_num_batched_tokens changes no step shape)
    for mbt in (5, 100):
        eng.scheduler.max_num_batched_tokens = mbt
        try:
            with _Steps(eng) as steps:
                assert _same(_run(eng, [TARGET], 0), alone), f"max_num_batched_tokens={mbt} alone"
                assert eng.last_timings["prompt_steps"] == -(-len(TARGET) // min(mbt, ROWS[0]))
                got = _run(eng, OTHERS[:5] + [TARGET] + OTHERS[5:], 5)
                assert _same(got, alone), f"max_num_batched_tokens={mbt} in a batch"
        finally:
            eng.scheduler.max_num_batched_tokens = 16
        steps.check(ROWS)
        assert max(sum(1 for _, _, p in s if p) for _, s in steps.steps) == min(mbt, ROWS[0])


def test_decode_buckets_alone_and_in_a_larger_batch(ckpt):
    """Alone, the target's decode steps are of the smallest bucket (8 rows); beside 11 others of 12 rows, the next
    (16, the decode rows here): the same tokens and logprobs."""
    eng = glm_dsa.load(ckpt, dtype="float32", max_model_len=64, block_size=4, max_num_seqs=16, progress=False,
                       max_num_batched_tokens=64, batch_invariant=True, invariant_step_rows=ROWS)
    others = OTHERS + _prompts(102, [5, 11, 8, 15])
    with _Steps(eng) as steps:
        alone = _run(eng, [TARGET], 0)
    assert steps.decode_rows() == {8}
    steps.check(ROWS)
    with _Steps(eng) as steps:
        assert _same(_run(eng, others[:6] + [TARGET] + others[6:], 6), alone)
    assert 16 in steps.decode_rows()
    steps.check(ROWS)


def test_the_same_after_a_preemption(ckpt):
    alone = _run(_engine(ckpt, True, 16), [TARGET], 0)
    # 15 pages of 4 tokens: the eight requests cannot all hold their pages, so later ones are preempted and
    # recomputed (the target last, the newest arrival, preempted first)
    eng = _engine(ckpt, True, 16, 15)
    with _Steps(eng) as steps:
        got = _run(eng, OTHERS + [TARGET], len(OTHERS))
    assert eng.last_timings["preemptions"] > 0
    assert _same(got, alone)
    steps.check(ROWS)
    # some request's generated tokens were recomputed after its preemption: in decode steps (checked above)
    assert any(n > 1 and not prompt for (_, _, prompt), n in steps.computed().items())


def test_a_prefix_cache_hit_is_the_same_as_a_miss(ckpt):
    """A chat's next turn (the first turn's prompt and answer, then more) with the first turn's pages cached:
    only the first prompt's pages are reused (the answer was computed in decode steps, a miss computes it in
    prompt steps), and the logprobs are the miss's."""
    eng = _engine(ckpt, True, 16)
    first = _run(eng, [TARGET], 0)
    turn = TARGET + first.token_ids + OTHERS[0]
    miss = _run(eng, [turn], 0)
    eng.reset_prefix_cache()
    hits0 = eng.metrics()["prefix_cache_hits"]
    with _Steps(eng) as steps:
        eng.generate([TARGET], max_new_tokens=NEW, stop_token_ids=[])  # the first turn, its pages cached
        hit = eng.generate([turn], max_new_tokens=NEW, stop_token_ids=[], logprobs=4)[0]
    # TARGET's 3 full pages (13 tokens); the 4th holds answer tokens (the default mode reuses it: 16)
    assert eng.metrics()["prefix_cache_hits"] - hits0 == 12
    assert _same(hit, miss)
    steps.check(ROWS)


@pytest.mark.parametrize("tp,dcp", [(2, 2)])
def test_bitwise_the_same_on_a_tp_dcp_layout(ckpt, tp, dcp):
    """Under TP x DCP (a fixed layout): alone against a batch, and after a prefill in other chunks."""
    par = glm_dsa.ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp)
    eng = glm_dsa.load(ckpt, dtype="float32", max_model_len=64, block_size=4, max_num_seqs=8, progress=False,
                       max_num_batched_tokens=16, batch_invariant=True, invariant_step_rows=ROWS, parallel=par)
    alone = _run(eng, [TARGET], 0)
    with _Steps(eng) as steps:
        assert _same(_run(eng, OTHERS[:5] + [TARGET], 5), alone)
        eng.scheduler.max_num_batched_tokens = 5  # the same compiled steps, prefill in chunks of 5 rows
        assert _same(_run(eng, [TARGET] + OTHERS[:2], 0), alone)
    steps.check(ROWS)


def test_prompt_steps_on_the_kernels(ckpt):
    """The GPU's kernels, interpreted (impl "triton_interpret", bfloat16): the prompt steps (128 rows here) take the
    rules' prompt-step choices, the default mode's prefill forms for their shape (the indexer's row-block scores,
    launch configs for their rows: here 32-row expert tiles, 16 in decode steps), the decode steps the fixed
    per-row ones; a request's tokens and logprobs are bitwise the same alone and beside others, its prompt
    then split over prompt steps at other row offsets (chunks of at most 16 rows)."""
    rows = (128, 16)
    eng = glm_dsa.load(ckpt, dtype="bfloat16", max_model_len=64, block_size=4, max_num_seqs=4, progress=False,
                       max_num_batched_tokens=16, batch_invariant=True, invariant_step_rows=rows,
                       impl="triton_interpret")
    assert eng.runner.options.invariant_prompt_rows == rows[0]
    with registry.record() as log:
        alone = _run(eng, [TARGET], 0)
    decided = {(d.rule, d.choice, d.step_kind) for d in log}
    assert {("indexer.scores_form", "row_block", "prompt"), ("launch_rows", "rows", "prompt"),
            ("indexer.scores_form", "per_row", "decode"), ("launch_rows", "fixed", "decode")} <= decided, decided
    assert not any(kind is None for _, _, kind in decided)
    with _Steps(eng) as steps:
        assert _same(_run(eng, OTHERS[:2] + [TARGET] + OTHERS[2:3], 2), alone)
    steps.check(rows)
    assert len({t for t, _ in steps.steps}) == 2


def test_default_step_rows(ckpt):
    """The engine's own step rows (kernels.registry's 8192 and 256): alone against a batch, both kinds run."""
    eng = _engine(ckpt, True, 16, rows=None)
    rows = (registry.INVARIANT_PROMPT_ROWS, registry.INVARIANT_STEP_ROWS)
    assert eng.runner.invariant_rows == rows == (8192, 256)
    alone = _run(eng, [TARGET], 0)
    with _Steps(eng) as steps:
        assert _same(_run(eng, OTHERS[:2] + [TARGET], 2), alone)
    steps.check(rows)
    assert {t for t, _ in steps.steps} == {rows[0], 8}  # 3 decode rows: the smallest bucket


def test_flag_is_checked_and_reaches_the_steps(ckpt):
    with pytest.raises(TypeError, match="batch_invariant"):
        glm_dsa.load(ckpt, dtype="float32", max_model_len=64, progress=False, batch_invariant=1)
    eng = _engine(ckpt, True, 16)
    assert eng.batch_invariant and eng.runner.options.batch_invariant
    assert eng.scheduler.invariant_rows == eng.runner.invariant_rows == ROWS
    with pytest.raises(TypeError, match="batch_invariant"):
        glm_dsa.StepOptions(batch_invariant="yes")
    assert eng.runner.options.invariant_prompt_rows == ROWS[0]  # the prompt steps decide as prompt steps
    with pytest.raises(ValueError, match="invariant_prompt_rows=64 is for batch_invariant=True"):
        glm_dsa.StepOptions(invariant_prompt_rows=64)
    with pytest.raises(ValueError, match="invariant_prompt_rows must be None or an integer >= 1"):
        glm_dsa.StepOptions(batch_invariant=True, invariant_prompt_rows=0)
    for rows, err in (((64, 0), ValueError), ((64,), TypeError), (64, TypeError), ((16, 16), ValueError)):
        with pytest.raises(err, match="invariant_step_rows"):
            glm_dsa.load(ckpt, dtype="float32", max_model_len=64, progress=False, batch_invariant=True,
                         invariant_step_rows=rows)
    with pytest.raises(ValueError, match="invariant_step_rows=.* is for batch_invariant=True"):
        glm_dsa.load(ckpt, dtype="float32", max_model_len=64, progress=False, invariant_step_rows=(64, 16))
