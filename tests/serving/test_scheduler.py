"""The host scheduler alone (no model): plans checked against hand-computed rows, pages and preemptions.

Samples are fed back by hand with `process`, as the engine loop does one step late."""

import collections

import numpy as np
import pytest

from glm_dsa.model.paged_cache import PageAllocator
from glm_dsa.serving.prefix_cache import PrefixCachingAllocator
from glm_dsa.serving.sampling import SamplingParams
from glm_dsa.serving.scheduler import Request, Scheduler, Status


def _sched(num_pages=64, **kw):
    args = dict(block_size=4, dcp=1, interleave=1, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32)
    args.update(kw)
    return Scheduler(PageAllocator(num_pages), **args)


def _req(name, n, max_tokens=4, stop=()):
    return Request(name, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stop)),
                   frozenset(stop))


def _rows(plan):
    """(request id, position, token or 'src:k') per row."""
    return [(plan.requests[q].request_id, int(p), int(t) if s < 0 else f"src:{s}")
            for q, p, t, s in zip(plan.req, plan.pos, plan.token, plan.src)]


def test_chunked_prefill_then_decode_rows_gathered_from_the_device():
    s = _sched()
    a, b = _req("a", 6), _req("b", 5)
    s.add(a)
    s.add(b)
    p1 = s.schedule()  # budget 8: a's whole prompt (6 rows), then b's first 2 rows
    assert _rows(p1) == [("a", i, i + 1) for i in range(6)] + [("b", 0, 1), ("b", 1, 2)]
    assert p1.sample_rows.tolist() == [5] and p1.sample_token_index.tolist() == [0]
    assert (len(a.pages), len(b.pages)) == (2, 1)  # ceil(6 / 4), ceil(2 / 4)
    # a's first token is in flight: its decode row gathers it from the previous step's ids (index 0); b's
    # remaining 3 prompt rows come after, and b's last row is sampled
    p2 = s.schedule()
    assert _rows(p2) == [("a", 6, "src:0"), ("b", 2, 3), ("b", 3, 4), ("b", 4, 5)]
    assert p2.sample_rows.tolist() == [0, 3] and p2.sample_token_index.tolist() == [1, 0]
    assert p2.prefill_rows == 3
    s.process(p1, np.array([40]))
    assert a.output == [40] and a.in_flight == 1
    p3 = s.schedule()
    assert _rows(p3) == [("a", 7, "src:0"), ("b", 5, "src:1")] and p3.prefill_rows == 0
    assert p3.sample_token_index.tolist() == [2, 1]


def test_decode_rows_are_kept_when_a_prefill_chunk_fills_the_budget():
    s = _sched(max_num_batched_tokens=4)
    a, b = _req("a", 2), _req("b", 9)
    s.add(a)
    s.add(b)
    s.schedule()  # a (2 rows) + b's first 2
    s.process(s.schedule(), np.array([7, 0]))  # a decodes (row 1 of its output), b continues
    p = s.schedule()
    names = [r for r, _, _ in _rows(p)]
    assert names.count("a") == 1 and len(names) == 4


def test_stop_id_finishes_one_step_late_and_frees_pages():
    s = _sched()
    a = _req("a", 3, max_tokens=10, stop=[99])
    s.add(a)
    p1 = s.schedule()
    p2 = s.schedule()  # planned before p1's id is known
    s.process(p1, np.array([99]))
    assert a.status is Status.FINISHED and a.finish_reason == "stop" and a.output == [99]
    assert s.allocator.free == s.allocator.num_pages - 1
    s.process(p2, np.array([5]))  # the extra row's sample is dropped
    assert a.output == [99] and s.schedule() is None


def test_max_tokens_and_max_model_len_need_no_lookahead():
    s = _sched(max_model_len=8, max_num_batched_tokens=16)
    a, b = _req("a", 3, max_tokens=2), _req("b", 6, max_tokens=10)
    s.add(a)
    s.add(b)
    p1 = s.schedule()
    p2 = s.schedule()
    assert [(r, p) for r, p, _ in _rows(p2)] == [("a", 3), ("b", 6)]  # a samples its 2nd (last) token here
    s.process(p1, np.array([1, 2]))
    # a has its 2 tokens in flight or on the host; b's 8th token (max_model_len) is in flight and is never
    # fed back: no rows are left to compute
    assert s.schedule() is None and s.has_work
    s.process(p2, np.array([3, 4]))
    assert (a.output, a.finish_reason) == ([1, 3], "length")
    assert (b.output, b.finish_reason) == ([2, 4], "length")
    assert s.schedule() is None and not s.has_work


def test_admission_waits_for_free_pages_and_sequence_slots():
    s = _sched(num_pages=5, max_num_seqs=2, max_num_batched_tokens=32)  # 4 usable pages of 4 tokens
    a, b, c = _req("a", 8, max_tokens=1), _req("b", 8), _req("c", 2)
    for r in (a, b, c):
        s.add(r)
    p1 = s.schedule()
    assert [r.request_id for r in p1.requests] == ["a", "b"] and c.status is Status.WAITING  # 2 slots
    assert s.allocator.free == 0
    s.process(p1, np.array([5, 6]))  # a is done (max_tokens 1): its slot and pages come back
    p2 = s.schedule()
    assert [r.request_id for r in p2.requests] == ["b", "c"] and a.finish_reason == "length"
    # pages: a 12-token prompt needs 3 pages; with 2 free it waits, and so does the small request behind it
    s = _sched(num_pages=5, max_num_batched_tokens=32)
    a, b, c = _req("a", 8, max_tokens=1), _req("b", 12), _req("c", 2)
    for r in (a, b, c):
        s.add(r)
    p1 = s.schedule()
    assert [r.request_id for r in p1.requests] == ["a"] and s.schedule() is None
    s.process(p1, np.array([5]))
    assert [r.request_id for r in s.schedule().requests] == ["b", "c"]  # 3 + 1 of the 4 pages


def test_preemption_takes_the_newest_and_keeps_its_tokens():
    s = _sched(num_pages=5, max_num_seqs=4)  # 4 usable pages
    a, b = _req("a", 4, max_tokens=8), _req("b", 4, max_tokens=8)
    s.add(a)
    s.add(b)
    p1 = s.schedule()  # both prompts: 1 page each
    s.process(p1, np.array([11, 21]))
    # positions 4..7 need a 2nd page each: 2 free pages cover them
    for _ in range(4):
        s.process(s.schedule(), np.array([12, 22]))
    assert s.allocator.free == 0 and s.preemptions == 0
    p = s.schedule()  # a needs a 3rd page at position 8: b, the newest, is preempted; its tokens stay
    assert s.preemptions == 1 and b.status is Status.WAITING and b.pages == [] and b.num_computed == 0
    assert [r.request_id for r in p.requests] == ["a"]
    assert b.output == [21, 22, 22, 22, 22] and b.in_flight == 0
    s.process(p, np.array([13]))
    with pytest.raises(ValueError, match="32 tokens need 8 KV cache pages per rank, more than the cache's 4"):
        s.check_fits(_req("big", 30, max_tokens=10))


def test_abort_frees_pages_at_the_next_step():
    s = _sched()
    a, b = _req("a", 5), _req("b", 3)
    s.add(a)
    s.add(b)
    p = s.schedule()
    s.abort(a)
    s.schedule()
    assert a.finish_reason == "abort" and a.pages == [] and s.running == [b]
    s.process(p, np.array([1, 2]))  # a's in-flight sample is dropped
    assert a.output == [] and b.output == [2]


@pytest.mark.parametrize("dcp", [1, 2])
def test_long_prompts_are_admitted_whole_so_their_chunks_never_preempt(dcp):
    """Prompts of two chunks under a page budget that holds 2.5 of them per DCP rank (the H200 run's shape: DCP=2
    thrashed with 78 preemptions): a request waits until its whole prompt fits beside the running prefills, so no
    chunk ever preempts, everything finishes, two at a time."""
    per_seq = 8 // dcp  # a 32-token prompt is 8 pages of 4 tokens, split over the DCP ranks
    s = _sched(num_pages=1 + (5 * per_seq) // 2 + 1, dcp=dcp, max_num_batched_tokens=16, max_num_seqs=8,
               max_model_len=40)
    reqs = [_req(f"r{i}", 32, max_tokens=2) for i in range(5)]
    for r in reqs:
        s.add(r)
    peak = 0
    pending = None
    for _ in range(400):
        plan = s.schedule()
        peak = max(peak, len(s.running))
        if pending is not None:
            s.process(pending, np.full(len(pending.sample_rows), 9))
        pending = plan
        if not s.has_work and pending is None:
            break
    assert all(r.status == Status.FINISHED for r in reqs) and s.preemptions == 0
    assert peak == 2


# ---- batch-invariant mode: prompt steps and decode steps ------------------------------------------------------

def _drive(s, tok=9, limit=2000):
    """Run `s` as the engine loop does (a step's ids processed after the next step is planned, every sample
    `tok`) until it has no work; returns the plans."""
    plans, pending = [], None
    for _ in range(limit):
        plan = s.schedule()
        if pending is not None:
            s.process(pending, np.full(len(pending.sample_rows), tok))
        pending = plan
        if plan is not None:
            plans.append(plan)
        if not s.has_work and pending is None:
            return plans
    raise AssertionError("the scheduler did not finish")


def _kind(plan):
    """'prompt' when every row is a prompt token (position < len(prompt)), 'decode' when none is, else 'mixed'."""
    prompt = [int(p) < len(plan.requests[q].prompt) for q, p in zip(plan.req, plan.pos)]
    return "prompt" if all(prompt) else "decode" if not any(prompt) else "mixed"


def test_batch_invariant_steps_hold_one_kind_and_alternate():
    """Prompt steps (prompt tokens, at most 8 rows) and decode steps (the rest, at most 4) never share a step and
    take turns while both have work; the default mode mixes them (the first two steps below are one there)."""
    s = _sched(invariant_rows=(8, 4), max_num_batched_tokens=64)
    a, b = _req("a", 3, max_tokens=6), _req("b", 14, max_tokens=2)
    s.add(a)
    s.add(b)
    p1 = s.schedule()  # prompt: a's prompt and b's first 5 rows; a's first token is sampled
    assert _rows(p1) == [("a", i, i + 1) for i in range(3)] + [("b", i, i + 1) for i in range(5)]
    assert (p1.prompt_rows, p1.sample_rows.tolist()) == (8, [2])
    p2 = s.schedule()  # decode: a's row of its in-flight token, although b's prompt waits
    assert _rows(p2) == [("a", 3, "src:0")] and p2.prompt_rows == 0
    s.process(p1, np.array([40]))
    p3 = s.schedule()  # prompt: b's next 8 rows (a's next row waits for this step)
    assert _rows(p3) == [("b", i, i + 1) for i in range(5, 13)] and p3.sample_rows.tolist() == []
    s.process(p2, np.array([41]))
    p4 = s.schedule()  # decode: a's token from the host
    assert _rows(p4) == [("a", 4, 41)]
    s.process(p3, np.array([], np.int64))
    p5 = s.schedule()  # prompt: b's last prompt row, sampled: a first token comes from a prompt step
    assert _rows(p5) == [("b", 13, 14)] and p5.sample_rows.tolist() == [0]
    d = _sched(max_num_batched_tokens=8)  # the default mode: a's decode row rides with b's prompt
    a, b = _req("a", 3, max_tokens=6), _req("b", 14, max_tokens=2)
    d.add(a)
    d.add(b)
    d.schedule()
    assert _kind(d.schedule()) == "mixed"


def test_batch_invariant_recompute_splits_prompt_and_generated_tokens():
    """After a preemption the prompt is recomputed in a prompt step (nothing sampled: the next token is known)
    and the generated tokens in a decode step, whose last row samples; the default mode recomputes both in one."""
    for rows in ((8, 4), None):
        s = _sched(invariant_rows=rows, max_num_batched_tokens=64)
        a = _req("a", 5, max_tokens=8)
        s.add(a)
        prev = s.schedule()
        for tok in (50, 51, 52):
            plan = s.schedule()
            s.process(prev, np.array([tok]))
            prev = plan
        s.process(prev, np.array([53]))
        assert a.output == [50, 51, 52, 53] and a.num_computed == 8
        s._preempt(a)
        p = s.schedule()
        if rows is None:
            assert _rows(p) == [("a", i, t) for i, t in enumerate([1, 2, 3, 4, 5, 50, 51, 52, 53])]
            continue
        assert _rows(p) == [("a", i, i + 1) for i in range(5)] and p.sample_rows.tolist() == []
        q = s.schedule()
        assert _rows(q) == [("a", 5, 50), ("a", 6, 51), ("a", 7, 52), ("a", 8, 53)]
        assert q.sample_rows.tolist() == [3] and q.sample_token_index.tolist() == [4]
        assert q.prompt_rows == 0 and _kind(q) == "decode"


@pytest.mark.parametrize("mbt", [3, 64])
def test_batch_invariant_steps_never_mix_under_preemption(mbt):
    """Many requests on a small page budget (preempted and recomputed): every step is all prompt tokens within
    the prompt rows or all others within the decode rows (and max_num_batched_tokens), and every request ends."""
    rng = np.random.default_rng(mbt)
    s = _sched(num_pages=9, invariant_rows=(8, 4), max_num_batched_tokens=mbt, max_num_seqs=4, max_model_len=32)
    reqs = [_req(f"r{i}", int(n), max_tokens=int(m)) for i, (n, m) in
            enumerate(zip(rng.integers(1, 14, 10), rng.integers(6, 16, 10)))]
    for r in reqs:
        s.add(r)
    plans = _drive(s)
    assert s.preemptions > 0 and all(r.finished for r in reqs)
    computed = collections.Counter()
    for p in plans:
        kind = _kind(p)
        assert kind != "mixed" and p.prompt_rows == (p.num_rows if kind == "prompt" else 0)
        assert p.num_rows <= min(mbt, 8 if kind == "prompt" else 4)
        computed.update((p.requests[q].request_id, int(pos), kind) for q, pos in zip(p.req, p.pos))
    # generated tokens were recomputed (in decode steps, as above)
    assert any(n > 1 and kind == "decode" for (_, _, kind), n in computed.items())


def test_batch_invariant_prefix_cache_keeps_prompt_pages_only():
    """A later request whose prompt repeats an earlier request's prompt and answer (a chat's next turn) reuses
    only the pages of the earlier prompt in batch-invariant mode (the answer's pages were computed in decode
    steps; a miss computes them in prompt steps); the default mode reuses the answer's pages too. And a request
    recomputed after a preemption matches pages of its prompt only, though pages of its generated tokens are
    cached (computed as another request's prompt): its miss computes those in decode steps."""
    for rows, pages in (((8, 4), 1), (None, 2)):
        s = Scheduler(PrefixCachingAllocator(64), block_size=4, dcp=1, interleave=1, max_num_seqs=4,
                      max_num_batched_tokens=64, max_model_len=32, prefix_caching=True, invariant_rows=rows)
        a = _req("a", 6, max_tokens=6)  # page 0: prompt; page 1: prompt 4, 5 and answer 6, 7; page 2: answer
        s.add(a)
        _drive(s)
        assert s.cached_pages == pages
        b = Request("b", a.prompt + a.output + [3, 3], SamplingParams(max_tokens=2), frozenset())
        s.add(b)
        _drive(s)
        assert b.cached_tokens == 4 * pages
        # as if preempted after 4 tokens: its 10 known tokens begin with b's pages 0 and 1
        c = Request("c", list(a.prompt), SamplingParams(max_tokens=6), frozenset(), output=list(a.output[:4]))
        s.add(c)
        _drive(s)
        assert c.cached_tokens == 4 * pages
