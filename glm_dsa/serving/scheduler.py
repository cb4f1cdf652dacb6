"""Continuous batching on the host: a request queue, per-step plans that mix decode rows with prefill chunks,
page admission and preemption. No device code: `Engine` turns a `StepPlan` into one ragged step.

Every request is a list of known tokens (its prompt, then the tokens it generated) plus at most one token "in
flight": sampled by the step the device is running, not yet copied to the host. A plan's row may take its token
from the previous step's sampled ids on the device (`StepPlan.src`), so the host never waits for a step's ids
before building the next one (one step of lag). A request finishes on a stop id (seen one step late: the step
already planned computes one more row for it, which is dropped), at `max_tokens`, or at `max_model_len`.

Pages are taken as a request grows (per DCP rank: every rank holds the same page table, `pages_needed` counts
rank 0's share, the largest). When a running request needs a page and none is free, the newest running request
(by arrival) is preempted: its pages are freed and it waits again, keeping its generated tokens, which are
recomputed as prompt when it is admitted again (its draws depend on its own seed, prompt index and token index
only, so it continues as if never interrupted).

Prefix caching (`prefix_caching=True`, over a `prefix_cache.PrefixCachingAllocator`): a page holds
`block_size * dcp` consecutive tokens (each DCP rank its own share of them, at the same page id), so a request's
page j covers positions [j * G, (j + 1) * G), G = block_size * dcp. As soon as a page's rows are final (every
position scheduled, its tokens known, and with MTP the token after it known too: the nextn layer's row at the
page's last position reads it) the page is indexed under its chain key. Rows are final once scheduled because a
request never schedules a position twice, except speculative draft rows, which lie past its known tokens (and
rejected ones are rolled back); the device runs steps in order and each layer writes the step's rows before it
reads the cache, so a request admitted in the same step may already read them. At admission a request's known
tokens are matched page by page against the index, up to the last full page before its last known token (that
token is always computed, so its logits sample the next one): prefill starts after the matched pages, which the
request holds shared and never writes (its own rows go to fresh pages, the last prompt page included, even when
the whole prompt was cached). Preemption and abort release a request's hold; cached pages stay indexed until
`allocate` evicts them.

Batch-invariant mode (`invariant_rows=(prompt rows, decode rows)`, from `Engine(batch_invariant=True)`): a step
is of one of two kinds and never mixes them. A prompt step computes prompt tokens only (positions below
`len(prompt)`: chunks of prompts being prefilled, admissions), a decode step everything else (decode rows, and
after a preemption the recompute of the request's generated tokens); the runner pads a prompt step to the prompt
rows and a decode step to the power-of-two bucket of its rows up to the decode rows, whose kernels compute a row
alike at every bucket (glm_dsa.serving.runner.ModelRunner.step_shapes). So every token is computed in a step of the
kind it was first computed in, also when it is recomputed after a preemption: a recompute runs the prompt part in
prompt steps and the generated part in decode steps. When both kinds have work the kinds alternate step by step (neither
starves: a decode request waits at most one prompt step, as it waits for a mixed step in the default mode); otherwise
the kind that has work runs. Prefix caching there indexes and matches only pages that lie wholly within a request's
prompt (computed in prompt steps, as a miss would compute them: a page of generated tokens, such as an earlier answer
that a later chat turn repeats in its prompt, was computed in decode steps), and a match leaves at least the prompt's
last token to compute, so an admission always has prompt rows.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import enum
import itertools
from collections.abc import Callable

import numpy as np

from ..model.paged_cache import PageAllocator, pages_needed
from .prefix_cache import PrefixCachingAllocator, chain_key
from .sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence being served. `prompt_index` enters its sampling keys (see `Engine.generate`); `on_token`
    and `on_finish` are called on the thread that runs the engine loop."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    stop: frozenset
    prompt_index: int = 0
    arrival: int = 0
    output: list[int] = dataclasses.field(default_factory=list)
    # with params.logprobs set: per output token, its logprob and the params.logprobs best {token id: logprob}
    # (appended before `on_token` sees the token; kept over a preemption with the output)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # positions whose rows have been scheduled (their KV is or will be in the cache)
    in_flight: int = 0  # sampled tokens not yet on the host (1, or 2 between planning a step and processing the last)
    flight_row: int = -1  # the newest in-flight token's index in the last planned step's sampled ids
    table_row: int = -1  # its row of the engine's device block table while it holds pages
    table_sent: int = 0  # how many of `pages` the device block table holds (the rest go with the next plan)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    aborted: bool = False
    first_token_time: float | None = None
    drafts: list[int] = dataclasses.field(default_factory=list)  # MTP: the next tokens the nextn layer proposed
    spec_steps: int = 0  # MTP: steps that verified drafts of this request, the drafts, how many were accepted
    spec_drafted: int = 0
    spec_accepted: int = 0
    # prefix caching: the chain keys of the request's first full pages (tokens never change, so kept across
    # preemptions), and how many of `pages` were offered to the index
    page_keys: list[bytes] = dataclasses.field(default_factory=list)
    pages_indexed: int = 0
    cached_tokens: int = 0  # prompt tokens its last admission found cached (not computed)
    on_token: Callable[[Request, int], None] | None = None
    on_finish: Callable[[Request], None] | None = None

    @property
    def total(self) -> int:
        """Tokens of the sequence, the in-flight one included."""
        return len(self.prompt) + len(self.output) + self.in_flight

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclasses.dataclass
class StepPlan:
    """One step's rows, in order: each row's request (index into `requests`), position and token (`src` >= 0:
    the token is the previous step's sampled id at that index, else `token`), and the rows whose logits are
    sampled (`sample_rows`, with the request and token index each sample becomes)."""

    requests: list[Request]
    req: np.ndarray
    pos: np.ndarray
    token: np.ndarray
    src: np.ndarray
    sample_rows: np.ndarray
    sample_reqs: list[Request]
    sample_token_index: np.ndarray
    prefill_rows: int  # rows that are not single decode rows
    table_updates: np.ndarray  # int [3, U]: (table row, column, page) entries the device block table gains
    table_resets: list[int]  # table rows given to a new request: zeroed before the updates apply
    # speculative decoding (Scheduler.lookahead > 0): per sample row, the draft rows after it; per row, the token
    # after it (-1: the step emits it)
    sample_drafts: np.ndarray | None = None
    next_token: np.ndarray | None = None
    prompt_rows: int = 0  # rows whose token is a prompt token (position < len(prompt)): batch-invariant step kinds

    @property
    def num_rows(self) -> int:
        return len(self.pos)


class Scheduler:
    """The host side of continuous batching (see the module docstring). Not thread-safe: one thread (the engine
    loop) calls `add`, `abort`, `schedule` and `process`.

    max_num_seqs: requests running at once. max_num_batched_tokens: rows per step (each running request's
    decode row first, in arrival order, then prefill chunks). max_model_len: a sequence's longest length.
    lookahead: MTP speculative decoding's drafts per step (0: none). With drafts, a decode request's rows are its
    last token and up to `lookahead` drafts (`Request.drafts`), its pages cover `lookahead` positions more for the
    nextn layer's chained rows, and the engine reports each step with `process_spec` (no token in flight).
    prefix_caching: reuse cached full pages (see the module docstring); needs a `PrefixCachingAllocator` and
    `block_size` divisible by `interleave` (so that a page's tokens are consecutive positions).
    invariant_rows: None, or (prompt rows, decode rows) of batch-invariant mode's two step kinds (see the module
    docstring): a step of each kind holds at most that many rows and at most `max_num_batched_tokens`. Not with
    `lookahead`.
    """

    def __init__(self, allocator: PageAllocator, *, block_size: int, dcp: int, interleave: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, lookahead: int = 0,
                 prefix_caching: bool = False, invariant_rows: tuple[int, int] | None = None):
        if invariant_rows is not None and lookahead:
            raise ValueError("batch-invariant step kinds (invariant_rows) with speculative drafts (lookahead)")
        self.invariant_rows = invariant_rows
        self._last_kind = "decode"  # batch-invariant mode: the kind of the last step (a prompt step goes first)
        if prefix_caching and not isinstance(allocator, PrefixCachingAllocator):
            raise TypeError("prefix_caching needs a PrefixCachingAllocator, got " + type(allocator).__name__)
        if prefix_caching and block_size % interleave:
            raise ValueError(f"prefix caching needs block_size ({block_size}) divisible by the DCP interleave "
                             f"({interleave})")
        self.allocator = allocator
        self.prefix_caching = prefix_caching
        self.page_tokens = block_size * dcp  # tokens of a page across the DCP ranks (G)
        self.prefix_queries = 0  # tokens of admitted sequences looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found cached (not computed)
        self.block_size, self.dcp, self.interleave = block_size, dcp, interleave
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.lookahead = lookahead
        self.waiting: list[Request] = []  # by arrival
        self.running: list[Request] = []  # by arrival
        self.preemptions = 0
        self.finished: collections.Counter = collections.Counter()  # finished requests by finish reason
        self._arrivals = itertools.count()
        # rows of the engine's device block table, one per running request (see `StepPlan.table_updates`)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    # ---- queue -----------------------------------------------------------------------------
    def pages_for(self, length: int) -> int:
        """Pages (per DCP rank) a sequence of `length` tokens holds."""
        return pages_needed(length, self.block_size, self.dcp, self.interleave)

    def check_fits(self, req: Request) -> None:
        """ValueError when `req` could never run alone (its longest length needs more pages than the cache has):
        such a request is refused before it is queued, so that preemption always ends."""
        longest = min(len(req.prompt) + req.params.max_tokens, self.max_model_len)
        need, have = self.pages_for(longest), self.allocator.num_pages - 1
        if need > have:
            raise ValueError(f"request {req.request_id}: {longest} tokens need {need} KV cache pages per rank, more "
                             f"than the cache's {have}; lower max_tokens or raise num_pages")

    def add(self, req: Request) -> None:
        """Queue a request (checked by `check_fits`)."""
        self.check_fits(req)
        req.arrival = next(self._arrivals)
        req.status = Status.WAITING
        if self._length_done(req):  # max_tokens=0: nothing to compute
            self._finish(req, "length")
            return
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """Mark a request aborted; the next `schedule` frees its pages. Its in-flight ids are dropped."""
        req.aborted = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_used(self) -> int:
        return self.allocator.num_pages - 1 - self.allocator.free

    # ---- planning --------------------------------------------------------------------------
    def _length_done(self, r: Request) -> bool:
        """Whether no more tokens will be sampled for `r` (max_tokens or max_model_len reached, counting the
        in-flight token)."""
        return len(r.output) + r.in_flight >= r.params.max_tokens or r.total >= self.max_model_len

    def _release(self, r: Request) -> None:
        self.allocator.release(r.pages)
        r.pages = []
        r.pages_indexed = 0
        r.num_computed = 0
        r.drafts = []  # drafts are proposed again after a recompute
        if r.table_row >= 0:
            self._free_rows.append(r.table_row)
            r.table_row, r.table_sent = -1, 0

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        if r.status is Status.RUNNING:
            self.running.remove(r)
        elif r.status is Status.WAITING and r in self.waiting:
            self.waiting.remove(r)
        self._release(r)
        r.status, r.finish_reason, r.error = Status.FINISHED, reason, error
        self.finished[reason] += 1
        finish, r.on_token, r.on_finish = r.on_finish, None, None
        # a finished request calls nothing more: dropping its callbacks breaks the request <-> stream cycle, so an
        # engine whose streams are dropped goes (its device caches with it) at once, not at the next gc pass
        if finish is not None:
            finish(r)

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self._release(r)
        r.status = Status.WAITING
        bisect.insort(self.waiting, r, key=lambda q: q.arrival)
        self.preemptions += 1

    def _span(self, r: Request, end: int) -> int:
        """Positions whose pages `r` holds while rows up to `end` run: `end`, plus the nextn layer's chained draft
        rows with speculative decoding (never past the request's longest length: `check_fits` holds)."""
        if not self.lookahead:
            return end
        longest = min(len(r.prompt) + r.params.max_tokens, self.max_model_len)
        return max(end, min(end + self.lookahead, longest))

    def _draft_rows(self, r: Request, budget: int) -> int:
        """Draft rows a decoding `r` brings to the step: its drafts, as many as its length, max_tokens and the
        step's row budget leave room for (each accepted draft is one more token)."""
        if not self.lookahead:
            return 0
        room = min(r.params.max_tokens - len(r.output), self.max_model_len - r.total) - 1
        return max(0, min(self.lookahead, len(r.drafts), room, budget - 1))

    def _promised(self) -> int:
        """Pages the running requests still need to finish the prompts (and recomputed outputs) they hold."""
        return sum(max(0, self.pages_for(self._span(q, q.total)) - len(q.pages)) for q in self.running)

    def _grow(self, r: Request, end: int) -> bool:
        """Give `r` the pages positions [0, end) need, preempting newer running requests (or `r` itself, when it
        is the newest) while pages are short. False when `r` was preempted."""
        end = self._span(r, end)
        need = self.pages_for(end) - len(r.pages)
        while need > self.allocator.free:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is r:
                return False
        if need > 0:
            r.pages.extend(self.allocator.allocate(need))
        return True

    # ---- prefix caching ----------------------------------------------------------------------
    @staticmethod
    def _tokens(r: Request, a: int, b: int) -> list[int]:
        """The known tokens [a, b) of `r` (prompt, then output)."""
        n = len(r.prompt)
        out = r.prompt[a: min(b, n)] if a < n else []
        return out + r.output[max(a - n, 0): max(b - n, 0)] if b > n else out

    def _keys(self, r: Request, n: int) -> list[bytes]:
        """The chain keys of `r`'s first `n` pages (their tokens, and with MTP the token after each, known)."""
        g, extra, keys = self.page_tokens, 1 if self.lookahead else 0, r.page_keys
        while len(keys) < n:
            j = len(keys)
            keys.append(chain_key(keys[-1] if keys else b"", self._tokens(r, j * g, (j + 1) * g + extra)))
        return keys[:n]

    def _index(self, r: Request) -> None:
        """Offer `r`'s pages whose rows became final to the index: every position of the page scheduled and known
        (not a draft, not the in-flight token), and with MTP the token after the page known too."""
        if not self.prefix_caching:
            return
        known = len(r.prompt) + len(r.output)
        final = min(r.num_computed, known - (1 if self.lookahead else 0))
        if self.invariant_rows is not None:  # pages of prompt tokens only: computed in prompt steps
            final = min(final, len(r.prompt))
        n = min(final // self.page_tokens, len(r.pages))
        if n <= r.pages_indexed:
            return
        for j, key in enumerate(self._keys(r, n)[r.pages_indexed:], start=r.pages_indexed):
            self.allocator.insert(key, r.pages[j])
        r.pages_indexed = n

    def _match(self, r: Request) -> list[int]:
        """The cached pages `r` (waiting, nothing in flight) can start from: its longest indexed prefix of full
        pages that ends before its last known token (always computed: its logits sample the next token); in
        batch-invariant mode before its last prompt token (the pages a miss computes in prompt steps)."""
        if not self.prefix_caching:
            return []
        known = len(r.prompt) if self.invariant_rows is not None else len(r.prompt) + len(r.output)
        return self.allocator.match(self._keys(r, (known - 1) // self.page_tokens))

    def reset_prefix_cache(self) -> None:
        """Forget every cached page (running requests keep the pages they hold)."""
        if self.prefix_caching:
            self.allocator.reset()

    @property
    def cached_pages(self) -> int:
        """Pages in the prefix cache's index (per DCP rank)."""
        return self.allocator.cached_pages if self.prefix_caching else 0

    def schedule(self) -> StepPlan | None:
        """The next step's rows, or None when there is nothing to compute. Finishes aborted requests first. In
        batch-invariant mode the step is a prompt step or a decode step (see the module docstring): the kind
        other than the last step's when it has work, else the other."""
        for r in [q for q in self.running + self.waiting if q.aborted]:
            self._finish(r, "abort")
        for r in self.running:  # tokens that arrived since the last step may complete pages
            self._index(r)
        if self.invariant_rows is None:
            chunks = self._chunks(None, self.max_num_batched_tokens)
        else:
            kinds = ("prompt", "decode") if self._last_kind == "decode" else ("decode", "prompt")
            for kind in kinds:
                rows = self.invariant_rows[0 if kind == "prompt" else 1]
                chunks = self._chunks(kind, min(self.max_num_batched_tokens, rows))
                if chunks:
                    self._last_kind = kind
                    break
        if not chunks:
            return None
        return self._plan(chunks)

    @staticmethod
    def _of_kind(r: Request, kind: str, todo: int) -> int:
        """Of the `todo` rows running `r` has left, those of a batch-invariant step of `kind`: "prompt" its prompt
        tokens, "decode" the tokens after them (once its prompt is computed)."""
        if kind == "prompt":
            return max(0, len(r.prompt) - r.num_computed)
        return todo if r.num_computed >= len(r.prompt) else 0

    def _chunks(self, kind: str | None, budget: int) -> list[tuple[Request, int, int]]:
        """The (request, start, end) chunks of one step within `budget` rows, of `kind` ("prompt" or "decode":
        batch-invariant mode, see `_of_kind`; None: the default mode's mixed step): each running request's rows
        in arrival order (a decode request's row, a prefill chunk that leaves one row for each later decoding
        request), then admissions (not in a decode step). Takes the pages (preempting newer requests where they
        are short) and advances `num_computed`."""
        chunks: list[tuple[Request, int, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            if r.num_computed >= r.total - (1 if self._length_done(r) else 0):
                i += 1  # its last token is in flight and no more are wanted: it finishes when that arrives
                continue
            todo = r.total - r.num_computed
            if kind is not None:
                todo = self._of_kind(r, kind, todo)
                if not todo:
                    i += 1
                    continue
            if todo > 1:  # a prefill chunk: leave one row for each later decoding request
                later = 0 if kind == "prompt" else sum(
                    1 for q in self.running[i + 1:]
                    if q.total - q.num_computed == 1 and (kind is None or q.num_computed >= len(q.prompt)))
                n = min(todo, max(budget - later, 1))
            else:
                n = 1 + self._draft_rows(r, budget)
            end = r.num_computed + n
            if not self._grow(r, end):
                continue  # r was preempted (and was the last running request)
            chunks.append((r, r.num_computed, end))
            r.num_computed = end
            self._index(r)  # pages this chunk completes: readable by requests admitted in this very step
            budget -= n
            i += 1
        # admission: waiting requests in arrival order while there are sequence slots, rows and pages
        while kind != "decode" and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if r.in_flight:  # preempted with a token in flight: admitted once it is on the host
                break
            hit = self._match(r)  # cached pages: prefill starts after them
            start = len(hit) * self.page_tokens
            # a prompt step takes the prompt only (`_match` leaves at least its last token): a recompute's
            # generated tokens follow in decode steps
            n = min((len(r.prompt) if kind == "prompt" else r.total) - start, budget)
            need = self.pages_for(self._span(r, start + n)) - len(hit)
            # admitted only when its whole prompt (and output so far) fits beside what the running requests' own
            # prefills still need: admitting on the first chunk's pages alone let a long prompt in that its next
            # chunk then preempted, recomputed and preempted again (measured: 78 preemptions in 16 requests).
            # Cached pages of the match that nobody holds count as free until this request takes them.
            free = self.allocator.free - (self.allocator.unheld(hit) if hit else 0)
            if self.pages_for(self._span(r, r.total)) - len(hit) + self._promised() > free:
                break
            self.waiting.pop(0)
            if hit:
                self.allocator.acquire(hit)  # before allocating: `allocate` may evict only unheld pages
            r.pages = hit + self.allocator.allocate(need)
            r.pages_indexed = len(hit)
            r.cached_tokens = start
            if self.prefix_caching:
                self.prefix_queries += r.total
                self.prefix_hits += start
            r.drafts = []
            r.status = Status.RUNNING
            self.running.append(r)  # arrival order is kept: every running request arrived before any waiting
            self.running.sort(key=lambda q: q.arrival)
            chunks.append((r, start, start + n))
            r.num_computed = start + n
            self._index(r)
            budget -= n
        return chunks

    def _plan(self, chunks) -> StepPlan:
        # rows built as Python lists, one numpy conversion each at the end: a decode row is one element, and
        # per-request numpy slice writes cost more (B = 32 on CPU, step stubbed: 0.14 -> 0.11 ms of host build
        # per decode step)
        reqs = [c[0] for c in chunks]
        req: list[int] = []
        pos: list[int] = []
        tok: list[int] = []
        src: list[int] = []
        sample_rows, sample_reqs, sample_idx, sample_drafts = [], [], [], []
        nxt: list[int] | None = [] if self.lookahead else None
        upd_row, upd_col, upd_page, resets = [], [], [], []
        prefill_rows = prompt_rows = 0
        for j, (r, s, e) in enumerate(chunks):
            n_prompt = len(r.prompt)
            n_known = n_prompt + len(r.output)
            n = e - s
            k = len(pos)
            if n == 1:
                req.append(j)
                pos.append(s)
                src.append(-1)
            else:
                req.extend([j] * n)
                pos.extend(range(s, e))
                src.extend([-1] * n)
            # tokens [s, m) from the prompt and output slices (no copy of the whole sequence per step)
            m = min(e, n_known)
            if s < min(m, n_prompt):
                tok.extend(r.prompt[s: min(m, n_prompt)])
            if m > max(s, n_prompt):
                tok.extend(r.output[max(s, n_prompt) - n_prompt: m - n_prompt])
            drafted = max(e - r.total, 0)  # speculative decoding: rows of drafts after the last known token
            if drafted:
                tok.extend(r.drafts[:drafted])
            elif e > n_known:  # the last row's token is the in-flight one: gathered on the device
                tok.append(0)
                src[-1] = r.flight_row
            if len(tok) != len(pos):
                raise RuntimeError(f"request {r.request_id}: rows [{s}, {e}) got {len(tok) - k} tokens ({n_known} "
                                   f"known, {r.in_flight} in flight, {drafted} drafts)")
            if r.table_row < 0:  # newly admitted: a fresh table row
                r.table_row, r.table_sent = self._free_rows.pop(), 0
                resets.append(r.table_row)
            if len(r.pages) > r.table_sent:  # only the pages the device table does not hold yet
                upd_page.extend(r.pages[r.table_sent:])
                upd_col.extend(range(r.table_sent, len(r.pages)))
                upd_row.extend([r.table_row] * (len(r.pages) - r.table_sent))
                r.table_sent = len(r.pages)
            if nxt is not None:  # the token after each row: the next row's, the known one after the chunk, or -1
                nxt.extend(tok[k + 1: k + n])
                nxt.append((r.prompt[e] if e < n_prompt else r.output[e - n_prompt]) if e < n_known else -1)
            if s < n_prompt:  # prompt tokens: prefill
                prefill_rows += n
                prompt_rows += min(e, n_prompt) - s
            elif n - drafted > 1:  # a decode row with its drafts is not prefill
                prefill_rows += n
            if e >= r.total and not self._length_done(r):
                # the step samples the next token: in flight until the step after next is dispatched
                r.flight_row = len(sample_rows)
                sample_rows.append(k + n - 1 - drafted)
                sample_drafts.append(drafted)
                sample_reqs.append(r)
                sample_idx.append(len(r.output) + r.in_flight)
                r.in_flight += 1

        def arr(x):
            return np.asarray(x, np.int64)
        return StepPlan(reqs, arr(req), arr(pos), arr(tok), arr(src), arr(sample_rows), sample_reqs, arr(sample_idx),
                        prefill_rows, arr([upd_row, upd_col, upd_page]).reshape(3, -1), resets, arr(sample_drafts),
                        None if nxt is None else arr(nxt), prompt_rows)

    # ---- results ---------------------------------------------------------------------------
    def process(self, plan: StepPlan, ids: np.ndarray, now: float | None = None, logprobs=None) -> None:
        """Take a finished step's sampled ids (one per `plan.sample_rows`): append them, emit them and finish the
        requests they end. `logprobs`: None, or the step's (logprob [n], top ids [n, k], top logprobs [n, k])
        host arrays, recorded for the requests that asked (their `logprobs` / `top_logprobs`)."""
        for j, (r, tok) in enumerate(zip(plan.sample_reqs, ids[: len(plan.sample_reqs)].tolist())):
            if self._arrived(r):
                n = r.params.logprobs
                if n is not None:
                    if logprobs is None:
                        raise RuntimeError(f"request {r.request_id} asked for logprobs, and its step computed none")
                    lp, top_ids, top_lp = logprobs
                    r.logprobs.append(float(lp[j]))
                    r.top_logprobs.append({int(t): float(v) for t, v in zip(top_ids[j, :n], top_lp[j, :n])})
                self._emit(r, tok, now)

    def _arrived(self, r: Request) -> bool:
        """A step's result for `r` is on the host: whether to hand it tokens (not when it already finished, or was
        aborted, which finishes it now)."""
        r.in_flight -= 1
        if r.finished:
            return False
        if r.aborted:
            self._finish(r, "abort")
            return False
        return True

    def _emit(self, r: Request, tok: int, now: float | None) -> None:
        """Append one token to `r`'s output and hand it on; a stop id or the length limit finishes `r`."""
        r.output.append(tok)
        if r.first_token_time is None:
            r.first_token_time = now
        if r.on_token is not None:
            r.on_token(r, tok)
        if tok in r.stop:
            self._finish(r, "stop")
        elif len(r.output) >= r.params.max_tokens or len(r.prompt) + len(r.output) >= self.max_model_len:
            self._finish(r, "length")

    def process_spec(self, plan: StepPlan, accepted: np.ndarray, tokens: np.ndarray, drafts: np.ndarray,
                     now: float | None = None) -> None:
        """Take a speculative step's results (per sample row: accepted drafts, the tokens it emits, the first
        accepted + 1 of `tokens`, and the next drafts): emit them in order (a stop id or the length ends a request
        there), keep the drafts, and roll `num_computed` back past the rejected drafts (their KV rows are dead)."""
        for j, r in enumerate(plan.sample_reqs):
            if not self._arrived(r):
                continue
            drafted, a = int(plan.sample_drafts[j]), int(accepted[j])
            r.spec_steps += drafted > 0
            r.spec_drafted += drafted
            r.spec_accepted += a
            r.num_computed -= drafted - a
            r.drafts = [int(x) for x in drafts[j]]
            for tok in tokens[j, : a + 1].tolist():
                self._emit(r, tok, now)
                if r.finished:
                    break

    def fail(self, reqs, error: str) -> None:
        """Finish `reqs` with an error (a step that raised): their pages come back (out of the prefix cache's
        index: the failed step may not have written them), the others go on."""
        for r in reqs:
            if not r.finished:
                if self.prefix_caching:
                    self.allocator.forget(r.pages)
                r.in_flight = 0
                self._finish(r, "error", error)
