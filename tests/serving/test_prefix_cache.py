"""Automatic prefix caching: the same engine with caching off is the oracle (greedy tokens equal, float32 logits of
every sampled row within 1e-5), and the hits, pages and rows computed are checked against hand-computed counts.

Pages hold block_size x dcp consecutive tokens (G); a request reuses its longest cached prefix of full pages that
ends before its last known token, so the hit counts below are multiples of G."""

import numpy as np
import pytest

from glm_dsa import ParallelConfig, configs
from glm_dsa.model.mtp import init_mtp_params
from glm_dsa.model.random_init import init_params
from glm_dsa.serving.engine import Engine
from glm_dsa.serving.prefix_cache import PrefixCachingAllocator, chain_key
from glm_dsa.serving.sampling import SamplingParams
from glm_dsa.serving.scheduler import Request, Scheduler

CFG = configs.tiny  # index_topk 8: prompts past 8 tokens make the indexer's selection matter
BS = 4


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0, dtype="float32")


def _engine(params, on, **kw):
    args = dict(dtype="float32", max_model_len=64, block_size=BS, num_pages=48, max_num_seqs=4,
                max_num_batched_tokens=64)
    args.update(kw)
    return Engine(CFG, params, enable_prefix_caching=on, **args)


def _tokens(seed, n):
    return np.random.default_rng(seed).integers(2, CFG.vocab_size, n).tolist()


class Run:
    """Drives an engine's loop in this thread over scripted submits and aborts, keeping every sampled row's
    float32 logits by (request, token index) and the rows each step computed."""

    def __init__(self, eng):
        self.eng, self.logits, self.rows, self.prefill_rows, self.step = eng, {}, 0, 0, 0
        eng.runner.keep_logits = True
        execute = eng.runner.execute

        def recording(plan, dry=None):
            out = execute(plan, dry)
            got = np.asarray(eng.runner.last_logits)
            for j, r in enumerate(plan.sample_reqs):
                self.logits[(r.request_id, int(plan.sample_token_index[j]))] = got[j]
            self.rows += plan.num_rows
            self.prefill_rows += plan.prefill_rows
            return out
        eng.runner.execute = recording

    def __call__(self, jobs, max_tokens=5, aborts=()):
        """jobs: (loop step to submit at, request id, prompt); aborts: (loop step, request id). Returns the outputs
        by request id once everything has finished."""
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[])
        streams, start = {}, self.step
        last = max([at for at, _, _ in jobs] + [at for at, _ in aborts])
        while True:
            for at, rid, prompt in jobs:
                if at == self.step - start:
                    streams[rid] = self.eng.submit(prompt, params, request_id=rid)
            for at, rid in aborts:
                if at == self.step - start:
                    self.eng.abort(rid)
            busy = self.eng.step()
            self.step += 1
            if not busy and self.step - start > last:
                break
        return {rid: list(s.request.output) for rid, s in streams.items()}


def _same(a: Run, b: Run, out_a, out_b, skip=()):
    """Greedy tokens identical, and every sampled row's logits (of the requests not in `skip`) within 1e-5."""
    assert {k: v for k, v in out_a.items() if k not in skip} == {k: v for k, v in out_b.items() if k not in skip}
    keys = {k for k in a.logits if k[0] not in skip}
    assert keys == {k for k in b.logits if k[0] not in skip} and keys
    for k in sorted(keys):
        np.testing.assert_allclose(a.logits[k], b.logits[k], atol=1e-5, rtol=0, err_msg=str(k))


def _both(params, script, **kw):
    """Run `script(run)` (returns outputs) with caching off and on; checks they agree; returns both runs."""
    runs = []
    for on in (False, True):
        eng = _engine(params, on, **kw)
        run = Run(eng)
        runs.append((run, script(run)))
    (off, out_off), (on, out_on) = runs
    _same(off, on, out_off, out_on)
    return off, on, out_off


def _m(run):
    return run.eng.metrics()


# ---- the page pool alone ------------------------------------------------------------------------------------
def test_chain_keys_are_deterministic_and_chain_the_parent():
    k0 = chain_key(b"", [1, 2, 3, 4])
    assert k0 == chain_key(b"", [1, 2, 3, 4]) and len(k0) == 16
    # the fixed digest: a key must not depend on the process (Python's salted hash) or the run
    assert k0.hex() == __import__("hashlib").blake2b(np.asarray([1, 2, 3, 4], "<i8").tobytes(),
                                                     digest_size=16).hexdigest()
    assert chain_key(k0, [5, 6, 7, 8]) != chain_key(chain_key(b"", [1, 2, 3, 5]), [5, 6, 7, 8])
    assert chain_key(b"", [1, 2, 3, 4]) != chain_key(b"", [1, 2, 3, 4, 0])


def test_allocator_refcounts_and_evicts_least_recently_released_tail_first():
    a = PrefixCachingAllocator(6)  # pages 1..5
    p = a.allocate(3)
    for i, page in enumerate(p):
        assert a.insert(bytes([i]), page)
    assert not a.insert(bytes([0]), 4)  # a key already cached keeps its page
    assert a.match([bytes([0]), bytes([1]), bytes([9]), bytes([2])]) == p[:2]
    a.acquire(p[:2])  # a second request reads the first two
    assert [a.refs(x) for x in p] == [2, 2, 1]
    a.release(p)  # the first request finishes: all stay cached, p[2] unheld
    assert a.free == 3 and a.cached_pages == 3
    a.release(p[:2])  # the second too: released tail first, so p[1] is evicted before p[0]
    assert a.free == 5
    got = a.allocate(4)  # 2 free pages, then evictions in release order: p[2], then p[1]
    assert got[2:] == [p[2], p[1]] and a.evictions == 2
    assert a.match([bytes([0]), bytes([1])]) == [p[0]]  # the chain's parent survives
    a.reset()
    assert a.cached_pages == 0 and a.free == 1


def _sched(**kw):
    args = dict(block_size=4, dcp=1, interleave=1, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32,
                prefix_caching=True)
    args.update(kw)
    return Scheduler(PrefixCachingAllocator(kw.pop("num_pages", 33)), **args)


def _req(name, prompt, max_tokens=4):
    return Request(name, list(prompt), SamplingParams(max_tokens=max_tokens, stop_token_ids=[]), frozenset())


def test_scheduler_starts_prefill_after_the_cached_pages_and_decodes_into_a_fresh_page():
    s = _sched()
    a = _req("a", range(1, 13))  # 12 tokens: 3 full pages
    s.add(a)
    p1 = s.schedule()
    assert p1.num_rows == 12 and s.cached_pages == 3  # final once scheduled: indexed at once
    # b: the same 12 tokens. Its last token is always computed, and a page is never shared partly written:
    # pages 0 and 1 are reused, page 2 (positions 8..11) is computed again into a fresh page
    b = _req("b", range(1, 13))
    s.add(b)
    p2 = s.schedule()
    assert [int(x) for x in p2.pos[p2.req == p2.requests.index(b)]] == list(range(8, 12))
    assert b.pages[:2] == a.pages[:2] and b.pages[2] != a.pages[2]
    assert (s.prefix_queries, s.prefix_hits) == (24, 8)
    assert s.allocator.refs(a.pages[0]) == 2 and s.allocator.refs(a.pages[2]) == 1
    # b's first decode row (position 12) goes to a page of its own
    s.process(p1, np.array([50]))
    s.process(p2, np.array([60, 61]))
    s.schedule()
    assert len(b.pages) == 4 and s.allocator.refs(b.pages[3]) == 1 and b.pages[3] not in a.pages
    # a strict prefix of 9 tokens: 2 pages reused, one row computed
    c = _req("c", range(1, 10))
    s.add(c)
    p = s.schedule()
    assert [int(x) for x in p.pos[p.req == p.requests.index(c)]] == [8] and s.prefix_hits == 16


def test_scheduler_never_caches_a_partial_page_or_the_in_flight_token():
    s = _sched()
    a = _req("a", range(1, 15), max_tokens=8)  # 14 tokens: 3 full pages and 2 tokens of the 4th
    s.add(a)
    p1 = s.schedule()
    assert s.cached_pages == 3
    s.schedule()  # position 14 (the in-flight token's row) is scheduled, its token not yet known
    assert s.cached_pages == 3
    s.process(p1, np.array([7]))
    s.schedule()  # 15 known now (14 prompt + 1), position 15 scheduled: page 3 holds 12..15, token 15 unknown
    assert s.cached_pages == 3
    b = _req("b", list(range(1, 15)) + [7, 99])  # shares a's 15 known tokens: only the 3 full pages
    s.add(b)
    s.schedule()
    assert b.cached_tokens == 12


# ---- the engine against itself without caching --------------------------------------------------------------
def test_two_requests_sharing_three_pages_admitted_in_the_same_step(params):
    base = _tokens(1, 12)
    a, b = base + _tokens(2, 5), base + _tokens(3, 3)

    def script(run):
        return run([(0, "a", a), (0, "b", b)])
    off, on, _ = _both(params, script)
    # b is admitted in the step that computes a's first 3 pages, and reads them: 12 rows fewer
    assert _m(on)["prefix_cache_hits"] == 12
    assert _m(on)["prefix_cache_queries"] == len(a) + len(b)
    assert off.prefill_rows - on.prefill_rows == 12 and off.rows - on.rows == 12
    assert _m(off)["prefix_cache_hits"] == 0 and off.prefill_rows == len(a) + len(b)  # off computes everything
    assert _m(off)["prefix_cache_pages"] == 0


def test_strict_prefix_and_partial_last_page(params):
    full = _tokens(4, 22)

    def script(run):
        out = run([(0, "a", full)])
        out.update(run([(0, "b", full[:13])]))  # 3 full pages + 1: 12 cached, 1 row computed
        out.update(run([(0, "c", full[:12])]))  # ends on a page boundary: 2 pages cached, the 3rd recomputed
        # 14 tokens: a's 4th page holds 12..15 and is full, but c's copy of it ends at 14 (partial): 3 pages only
        out.update(run([(0, "d", full[:14] + [3, 3])]))
        return out
    off, on, _ = _both(params, script)
    assert _m(on)["prefix_cache_hits"] == 12 + 8 + 12
    assert off.prefill_rows - on.prefill_rows == 12 + 8 + 12


def test_a_long_hit_with_few_rows_sends_all_its_pages(params):
    """A request admitted on 20 cached pages computes 1 row: its step adds 21 block-table entries, more than a
    step's rows bucket (16) holds."""
    long = _tokens(17, 80)

    def script(run):
        out = run([(0, "a", long)], max_tokens=2)
        out.update(run([(0, "b", long + [3])], max_tokens=2))
        return out
    off, on, _ = _both(params, script, max_model_len=96, max_num_batched_tokens=128)
    assert _m(on)["prefix_cache_hits"] == 80


def _record_table_inputs(eng) -> list:
    """Wrap `eng`'s runner's `table_inputs`: each call appends (rows bucket t, the plan's table updates, the
    columns of the step's updates array) to the returned list."""
    seen, table_inputs = [], eng.runner.table_inputs

    def recording(plan, t, nr):
        plan_rows, upd, resets = table_inputs(plan, t, nr)
        seen.append((t, plan.table_updates.shape[1], upd.shape[1]))
        return plan_rows, upd, resets
    eng.runner.table_inputs = recording
    return seen


def test_multi_turn_step_shapes_do_not_depend_on_cache_hits(params):
    """Two conversations on one 60-token system prompt, the second arriving while the first decodes, then a second
    turn of each (prompt, answer, 3 new tokens): admissions gain 15 to 17 cached pages with a few rows computed.
    Every step's updates array has its rows bucket's columns (the entries past it are written before the step, by
    the one table write compiled with the engine), and the tokens are those without caching."""
    system = _tokens(30, 60)
    first = {"a": system + _tokens(31, 6), "b": system + _tokens(32, 5)}
    seen = {}

    def script(run):
        seen[run.eng.scheduler.prefix_caching] = _record_table_inputs(run.eng)
        compiled.append(run.eng.runner._change_tables._cache_size())
        out = run([(0, "a1", first["a"]), (2, "b1", first["b"])], max_tokens=4)
        out.update(run([(0, "a2", first["a"] + out["a1"] + [5, 6, 7]),
                        (1, "b2", first["b"] + out["b1"] + [8, 9, 4])], max_tokens=4))
        compiled[-1] = run.eng.runner._change_tables._cache_size() - compiled[-1]
        return out
    compiled = []  # per run: the table-write executables compiled while serving
    off, on, _ = _both(params, script, max_model_len=96, max_num_batched_tokens=128, num_pages=64)
    assert _m(on)["prefix_cache_hits"] >= 60 + 2 * 64
    assert any(nu > t for t, nu, _ in seen[True])  # some step's admissions bring more pages than its rows bucket
    for steps in seen.values():
        assert all(u == t for t, _, u in steps), steps
    assert compiled == [0, 0]  # the table write compiled with the engine, never in the loop


def test_eviction_under_a_tiny_page_budget_while_a_request_reads_the_chain_parent(params):
    first = _tokens(5, 16)
    other = first[:4] + _tokens(6, 20)

    def script(run):
        out = run([(0, "a", first)], max_tokens=2)  # 17 computed rows: pages 0..4, 4 of them cached
        # b shares page 0 only and needs 7 pages: with 8 pages in all (7 usable) it takes the 2 free ones and
        # evicts a's cached tail (pages 3, 2, 1, last released first) while it reads page 0
        out.update(run([(0, "b", other)], max_tokens=4))
        out.update(run([(0, "c", first)], max_tokens=2))  # a's prompt again: only what survived
        return out
    off, on, _ = _both(params, script, num_pages=8, max_model_len=28)
    eng = on.eng
    assert eng.allocator.evictions >= 3
    assert _m(on)["prefix_cache_hits"] == 4 + 4  # b: page 0; c: page 0 (the rest of a's chain was evicted)


def test_preemption_and_recompute_of_a_request_whose_prefix_is_shared(params):
    base = _tokens(7, 8)
    a, b = base + _tokens(8, 3), base + _tokens(9, 2)

    def script(run):
        return run([(0, "a", a), (0, "b", b)], max_tokens=14)
    # 7 usable pages of 4: a (25 tokens) and b (24) need 7 + 6 - 2 shared: b is preempted and recomputed
    off, on, _ = _both(params, script, num_pages=8, max_model_len=32)
    assert _m(off)["preemptions"] >= 1 and _m(on)["preemptions"] >= 1
    # b's readmission recomputes its tokens as prompt and finds its cached pages (and a's) again
    assert _m(on)["prefix_cache_hits"] > 8


def test_abort_during_the_prefill_of_a_shared_prefix(params):
    a = _tokens(10, 30)
    b, c = a[:20] + [9], a[:10] + [1]

    def script(run):
        # chunks of 6 rows: a's first chunk writes positions 0..5 (page 0 and half of page 1), then a is aborted
        # as b arrives: b reuses page 0 only (page 1 was never completed) and computes the rest; c arrives during
        # b's prefill and reuses 2 of b's pages
        return run([(0, "a", a), (1, "b", b), (3, "c", c)], aborts=[(1, "a")])
    off, on, out = _both(params, script, max_num_batched_tokens=6)
    assert out["a"] == []
    assert _m(on)["prefix_cache_hits"] == 4 + 8 and _m(on)["requests_aborted"] == 1
    assert on.eng.allocator.free == on.eng.num_pages - 1  # nothing leaked; cached pages count as free


@pytest.mark.parametrize("tp,dcp,interleave", [(2, 1, 1), (4, 2, 2)])  # TP alone; TP x DCP, runs of 2
def test_tp_and_dcp_layouts(tp, dcp, interleave):
    par = ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                         cp_kv_cache_interleave_size=interleave)
    g = BS * dcp  # tokens per page across the DCP ranks
    base = _tokens(11, 2 * g)
    a, b = base + _tokens(12, 3), base + _tokens(13, 2)

    def script(run):
        out = run([(0, "a", a)], max_tokens=4)
        out.update(run([(0, "b", b), (0, "c", a[: 2 * g])], max_tokens=4))
        return out
    placed = init_params(CFG, seed=0, dtype="float32", parallel=par)  # on the layout's devices
    off, on, _ = _both(placed, script, parallel=par, num_pages=24)
    assert _m(on)["prefix_cache_hits"] == 2 * g + g  # b: 2 pages; c ends on a page boundary: 1


def _record_verify_logits(eng, logits: dict, drafts: dict) -> None:
    """Keep the target's logits of every emitted token of `eng`'s speculative steps by (request, token index), and
    the drafts each step proposes (the nextn layer's argmax over its cache) by (request, token index)."""
    spec = eng.spec
    spec.keep_logits = True
    dispatch = spec.dispatch

    def recording(plan):
        out = dispatch(plan)
        got = np.asarray(spec.last_logits)
        for j, r in enumerate(plan.sample_reqs):
            for i in range(int(out[j, 0]) + 1):  # the accepted drafts' rows and the row of the target's token
                logits[(r.request_id, int(plan.sample_token_index[j]) + i)] = got[j, i]
            drafts[(r.request_id, int(plan.sample_token_index[j]))] = out[j, spec.k + 2:].tolist()
        return out
    spec.dispatch = recording


def test_mtp_reuses_the_nextn_layer_pages(params):
    mtp = init_mtp_params(CFG, seed=1, dtype="float32")
    base = _tokens(14, 12)
    outs, hits, runs = [], [], []
    for on in (False, True):
        eng = _engine(params, on, num_speculative_tokens=2, mtp_params=mtp)
        run = Run(eng)
        run.drafts = {}
        _record_verify_logits(eng, run.logits, run.drafts)
        out = run([(0, "a", base + [5])], max_tokens=6)
        out.update(run([(0, "b", base + [6, 7]), (0, "c", base + [5])], max_tokens=6))
        outs.append((out, eng.spec.summary()))
        hits.append(_m(run)["prefix_cache_hits"])
        runs.append(run)
    assert outs[0] == outs[1]  # tokens, and the drafts' acceptance: the nextn layer's cached rows are right
    # the drafts are the nextn layer's greedy picks over its cache: equal only if the cached nextn rows are right
    assert runs[0].drafts == runs[1].drafts and runs[0].drafts
    _same(runs[0], runs[1], outs[0][0], outs[1][0])
    # b differs from a at token 12, which page 2's key takes under MTP (the nextn row at position 11 reads it):
    # b reuses 2 pages, c (a's prompt) 3
    assert hits == [0, 8 + 12]


def test_enable_prefix_caching_false_and_reset(params):
    eng = _engine(params, True)
    p = _tokens(15, 13)
    eng.generate([p], max_new_tokens=2, stop_token_ids=[])
    assert eng.metrics()["prefix_cache_pages"] == 3
    eng.reset_prefix_cache()
    assert eng.metrics()["prefix_cache_pages"] == 0 and eng.allocator.free == eng.num_pages - 1
    eng.generate([p], max_new_tokens=2, stop_token_ids=[])
    assert eng.metrics()["prefix_cache_hits"] == 0
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        _engine(params, "yes")


def test_openai_server_same_completions_and_metrics_show_the_hits(params):
    """The in-process OpenAI app (glm_dsa.serving.server.create_app) over the engine with caching on and off: a
    chat's second turn repeats the first turn's prompt and answer, and the completions agree."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from glm_dsa.serving.server import create_app
    first = _tokens(16, 14)
    got = []
    for on in (False, True):
        eng = _engine(params, on)
        with TestClient(create_app(eng, model_name="m")) as client:
            def complete(prompt):
                r = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 4,
                                                         "temperature": 0, "return_token_ids": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]
            answer = complete(first)
            second = complete(first + answer + [5, 6, 7])
            metrics = dict(line.split(" ") for line in client.get("/metrics").text.splitlines()
                           if not line.startswith("#"))
        got.append((answer, second, float(metrics["glm_dsa:prefix_cache_hits"])))
    assert got[0][:2] == got[1][:2]
    # turn 2 begins with turn 1's 18 tokens (prompt and answer), of which 17 were computed (the answer's last token
    # was sampled, never fed back): 4 full pages (16 tokens) were cached and are reused
    assert (got[0][2], got[1][2]) == (0, 16)


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_cli_prefix_caching_flags(cmd):
    from glm_dsa.cli import build_parser
    base = [cmd, "--checkpoint", "x"] + (["--prompt-ids", "1,2"] if cmd == "generate" else [])
    parse = build_parser().parse_args
    assert parse(base).enable_prefix_caching is True
    assert parse(base + ["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse(base + ["--enable-prefix-caching"]).enable_prefix_caching is True


def test_reset_while_serving_is_a_step_event_that_lockstep_carries(params):
    """Under a background loop or lockstep, `reset_prefix_cache` waits for the loop's next step (so every
    process applies it at the same step), and the lockstep message carries it."""
    from glm_dsa.serving.lockstep import decode_events, encode_events
    assert decode_events(encode_events([("reset_prefix_cache", None)])) == [("reset_prefix_cache", None)]
    eng = _engine(params, True)
    eng.generate([_tokens(18, 9)], max_new_tokens=1, stop_token_ids=[])
    assert eng.metrics()["prefix_cache_pages"] == 2
    seen = []
    eng.step_sync = lambda events: seen.extend(events) or events  # what a leader would publish
    eng.reset_prefix_cache()
    assert eng.metrics()["prefix_cache_pages"] == 2  # not yet: at the next step
    eng.step()
    assert seen == [("reset_prefix_cache", None)] and eng.metrics()["prefix_cache_pages"] == 0
