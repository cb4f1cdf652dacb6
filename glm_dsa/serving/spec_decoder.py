"""The host side of MTP speculative decoding for an `Engine` (docs/math.md §12): the nextn layer's parameters and
caches, the draft distributions kept on the device, the compiled step (`spec_step.spec_serve_step`), one
synchronous serving turn, and the acceptance statistics.

A speculative turn cannot be planned before the previous one's accepted counts are known (they move every
request's positions), so unlike the plain loop (one step of lag, ids left on the device) each turn waits for its
step: one device read per step, of [requests, 2k + 2] int32.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding import cache_spec

from ..model.mtp import allocate_mtp_caches
from ..model.paged_cache import cache_dtype
from . import host_buffer
from .scheduler import Request, StepPlan
from .spec_step import spec_serve_step_packed


class SpecDecoder:
    """MTP speculative decoding state of one engine (`Engine.spec`): k drafts per step."""

    def __init__(self, eng, mtp_params, k: int):
        self.eng, self.k, self.mtp_params = eng, k, mtp_params
        cfg, n = eng.config, eng.parallel.dcp
        self.caches = allocate_mtp_caches(cfg, eng.num_pages * n, eng.block_size,
                                          cache_dtype(eng.kv_cache_dtype, eng.dtype),
                                          NamedSharding(eng.mesh, cache_spec()), eng.kv_cache_dtype)
        replicated = NamedSharding(eng.mesh, P())
        # each running request's draft distributions (its table row; the last row is the padding groups'): read by
        # the next step's rejection sampling. Greedy requests leave zeros here.
        shape = (eng.max_num_seqs + 1, k, cfg.vocab_size)
        self.draft_probs = jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=replicated)()
        shardings = (replicated, jax.tree.map(lambda c: c.sharding, eng.caches),
                     jax.tree.map(lambda c: c.sharding, self.caches), replicated, replicated)
        # one executable per (rows, requests, width, greedy) bucket: the accepted counts move positions and tokens,
        # never shapes, so turns with different acceptance reuse it (tests/serving/test_mtp_turn.py)
        self._step = jax.jit(functools.partial(spec_serve_step_packed, config=cfg, parallel=eng.parallel,
                                               impl=eng.impl, k=k, block_size=eng.block_size),
                             static_argnames=("width", "greedy", "layout"), donate_argnums=(2, 3, 4, 5),
                             out_shardings=shardings)
        # tests: with keep_logits set, each step keeps the target's float32 logits of its verify rows
        # [G, k + 1, V] (device) in last_logits, from a second compiled step
        self.keep_logits = False
        self.last_logits = None
        self._step_logits = jax.jit(functools.partial(spec_serve_step_packed, config=cfg, parallel=eng.parallel,
                                                      impl=eng.impl, k=k, block_size=eng.block_size,
                                                      with_logits=True),
                                    static_argnames=("width", "greedy", "layout"), donate_argnums=(2, 3, 4, 5),
                                    out_shardings=shardings + (replicated,))
        # acceptance statistics since the engine was made
        self.steps = 0  # speculative steps run
        self.verified = 0  # sample rows that brought at least one draft
        self.drafted = np.zeros(k, np.int64)  # per draft position: drafts verified
        self.accepted = np.zeros(k, np.int64)  # per draft position: drafts accepted
        self.emitted = 0  # tokens emitted by sample rows with drafts (accepted + 1 each)
        self.finished = collections.deque(maxlen=256)  # (verify steps, accepted) of recently finished requests
        # an oracle draft source for tests and benchmarks (the upper bound of acceptance): called after each step
        # with every running request, it replaces the nextn layer's drafts. Greedy requests only: a sampling
        # request's drafts must be drawn from the distributions the step kept, or rejection sampling is biased.
        self.oracle: Callable[[Request], list[int]] | None = None

    # ---- statistics -----------------------------------------------------------------------------
    def snapshot(self) -> tuple:
        return self.verified, self.drafted.copy(), self.accepted.copy(), self.emitted

    def summary(self, since: tuple | None = None) -> dict:
        """Acceptance since `snapshot()` (or since the start): "spec_mean_accepted_length" (tokens per verify
        row: accepted drafts + 1; 1 = no draft ever accepted), "spec_acceptance_rate" (accepted / drafted),
        "spec_acceptance_per_position" (per draft position: accepted / drafted), "spec_drafts", "spec_accepted"."""
        v, d, a, e = self.snapshot()
        if since is not None:
            v, d, a, e = v - since[0], d - since[1], a - since[2], e - since[3]
        return {"spec_num_speculative_tokens": self.k, "spec_verify_rows": int(v),
                "spec_drafts": int(d.sum()), "spec_accepted": int(a.sum()),
                "spec_mean_accepted_length": e / v if v else 0.0,
                "spec_acceptance_rate": float(a.sum() / d.sum()) if d.sum() else 0.0,
                "spec_acceptance_per_position": [float(x / y) if y else 0.0 for x, y in zip(a, d)]}

    def metrics(self) -> dict:
        """Flat numeric counters for `Engine.metrics` (/metrics): totals, per position, and the mean accepted length
        of recently finished requests (each request's own: accepted drafts per verify row + 1)."""
        s = self.summary()
        out = {k: v for k, v in s.items() if not isinstance(v, list)}
        for i, x in enumerate(s["spec_acceptance_per_position"]):
            out[f"spec_acceptance_pos_{i}"] = x
        per_req = [acc / rows + 1 for rows, acc in self.finished if rows]
        out["spec_requests_recent"] = len(per_req)
        out["spec_request_accepted_length_mean"] = float(np.mean(per_req)) if per_req else 0.0
        out["spec_request_accepted_length_min"] = float(np.min(per_req)) if per_req else 0.0
        return out

    # ---- one turn -------------------------------------------------------------------------------
    def dispatch(self, plan: StepPlan) -> np.ndarray:
        """Run the plan's speculative step and return its host results int32 [G >= len(sample_reqs), 2k + 2]."""
        eng, k = self.eng, self.k
        rows = plan.num_rows
        t, width, nr = eng.runner.step_shapes(plan)
        row_arr = np.zeros((4, t), np.int32)
        row_arr[1, rows:] = -1  # padding rows: position -1 (write nothing), request 0
        row_arr[3, :] = -1
        row_arr[0, :rows], row_arr[1, :rows], row_arr[2, :rows] = plan.token, plan.pos, plan.req
        row_arr[3, :rows] = plan.next_token
        plan_rows, upd, resets = eng.runner.table_inputs(plan, t, nr)
        g = len(plan.sample_rows)
        vrows = np.full((nr, k + 1), -1, np.int32)
        gmeta = np.zeros((3, nr), np.int32)
        gmeta[1] = eng.max_num_seqs  # padding groups: the spare row of draft_probs
        su = np.zeros((4, nr), np.uint32)
        sf = np.zeros((2, nr), np.float32)
        sf[1] = 1.0
        for j, r in enumerate(plan.sample_reqs):
            d = int(plan.sample_drafts[j])
            vrows[j, : d + 1] = plan.sample_rows[j] + np.arange(d + 1)
            gmeta[:, j] = d, r.table_row, len(r.pages)
            su[:, j] = r.params.seed >> 32, r.params.seed & 0xFFFFFFFF, plan.sample_token_index[j], r.prompt_index
            sf[:, j] = r.params.temperature, r.params.top_p
        if g > nr:
            raise RuntimeError(f"a step samples {g} rows, more than its {nr} groups")
        arrays = (row_arr, plan_rows, upd, resets, vrows, gmeta, su, sf)
        greedy = all(r.params.greedy for r in plan.sample_reqs)
        if eng._dry is not None:  # warmup: a shape seen already is not run (its results: nothing accepted)
            shape = (t, nr, width, greedy)
            if shape in eng._dry:
                return np.zeros((nr, 2 * k + 2), np.int32)
            eng._dry.add(shape)
        return np.asarray(self.launch(arrays, width=width, greedy=greedy))

    def launch(self, arrays: tuple, *, width: int, greedy: bool):
        """Send one step's host inputs (`spec_step.spec_serve_step`'s eight arrays, packed into one transfer)
        and launch it; returns its device results int32 [G, 2k + 2] (the caches, tables and draft distributions
        are replaced in place). Benchmarks call this with inputs they build."""
        eng, run = self.eng, self.eng.runner
        packed, layout = host_buffer.pack(*arrays)
        eng.stats.h2d_bytes += packed.nbytes
        eng.stats.last_h2d_bytes = packed.nbytes
        args = (run.params, self.mtp_params, run.caches, self.caches, run.tables, self.draft_probs, packed)
        if self.keep_logits:
            out, run.caches, self.caches, run.tables, self.draft_probs, self.last_logits = self._step_logits(
                *args, width=width, greedy=greedy, layout=layout)
        else:
            out, run.caches, self.caches, run.tables, self.draft_probs = self._step(
                *args, width=width, greedy=greedy, layout=layout)
        return out

    def turn(self, plan: StepPlan | None, t0: float) -> bool:
        """One synchronous serving turn for `Engine.step` (the plan already made at `t0`): run it, emit each
        request's accepted tokens, keep its new drafts; returns whether work is left."""
        sch, st = self.eng.scheduler, self.eng.stats
        if plan is None:
            return sch.has_work
        wait = 0.0
        try:
            tw = time.perf_counter()
            out = self.dispatch(plan)
            wait = time.perf_counter() - tw
        except Exception as e:  # a step that cannot run fails its requests, not the loop
            logging.getLogger(__name__).exception("speculative step failed")
            sch.fail(plan.requests, f"{type(e).__name__}: {e}")
            return sch.has_work
        st.syncs += 1
        g, k = len(plan.sample_reqs), self.k
        accepted, tokens, drafts = out[:g, 0], out[:g, 1: k + 2], out[:g, k + 2:]
        before = sum(len(r.output) for r in plan.sample_reqs)
        for j in range(g):
            d = int(plan.sample_drafts[j])
            if d:
                a = int(accepted[j])
                self.verified += 1
                self.drafted[:d] += 1
                self.accepted[:a] += 1
                self.emitted += a + 1
        tp = time.perf_counter()
        sch.process_spec(plan, accepted, tokens, drafts, tp)
        if self.oracle is not None:
            for r in plan.sample_reqs:
                if not r.finished:
                    if not r.params.greedy:
                        raise ValueError("oracle drafts are for greedy requests only (temperature 0)")
                    r.drafts = [int(x) for x in self.oracle(r)][: self.k]
        for r in plan.sample_reqs:
            if r.finished and r.spec_steps:
                self.finished.append((r.spec_steps, r.spec_accepted))
        emitted = sum(len(r.output) for r in plan.sample_reqs) - before
        self.steps += 1
        t1 = time.perf_counter()
        st.steps += 1
        st.decode_steps += plan.prefill_rows == 0
        st.prompt_steps += plan.prompt_rows > 0
        st.generated += emitted
        st.host_s += t1 - t0 - wait
        st.process_s += t1 - tp
        st.wall_s += t1 - t0
        if plan.prefill_rows == 0:  # a synchronous turn waits for its own step only
            st.decode_timed_steps += 1
            st.decode_host_s += t1 - t0 - wait
            st.decode_wall_s += t1 - t0
        st.recent.append((t1, emitted))
        return sch.has_work
