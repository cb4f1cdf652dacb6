"""The request side of serving: `load` a checkpoint into an `Engine`, then `logits`, `generate`, `stream`, `submit`
and `abort` over its `ModelRunner` (glm_dsa.serving.runner: the mesh, caches and compiled steps)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time

import numpy as np

from sharding import ParallelConfig

from ..model.config import GlmDsaConfig
from ..model.loading import load_params
from ..model.param_tree import nest_params
from ..model.paged_cache import pages_needed
from .runner import ModelRunner, check_positive_int
from .sampling import SamplingParams, check_token_ids
from .scheduler import Request, Scheduler
from .spec_decoder import SpecDecoder
from .streaming import RequestStream


def _runner_attribute(name: str, doc: str, writable: bool = False) -> property:
    """An Engine attribute that is its runner's (`eng.params` is `eng.runner.params`)."""
    setter = (lambda self, value: setattr(self.runner, name, value)) if writable else None
    return property(lambda self: getattr(self.runner, name), setter, doc=doc)


@dataclasses.dataclass
class _LoopStats:
    """Counters of the serving loop since the engine was made (read by `Engine.metrics`)."""

    steps: int = 0
    decode_steps: int = 0  # steps with decode rows only
    prompt_steps: int = 0  # steps with prompt tokens (batch-invariant mode: its prompt steps)
    host_s: float = 0.0  # loop time not spent waiting for the device's ids (build + launch + process)
    build_s: float = 0.0  # of host_s: planning the step and building its numpy inputs
    launch_s: float = 0.0  # of host_s: the jitted call (transfers, dispatch; a launch that blocks shows here)
    process_s: float = 0.0  # of host_s: handing the previous step's ids to their requests (callbacks)
    syncs: int = 0  # device-to-host reads (one per step: the previous step's ids)
    h2d_bytes: int = 0  # bytes of the host arrays sent to the device
    last_h2d_bytes: int = 0  # the same, of the last step
    wall_s: float = 0.0  # loop time of steps that dispatched work
    # the same two over the loop turns that waited for a decode-only step's ids, and those turns: a turn's wall
    # time is the wait for the step it reads, so the turn that reads the last prefill step's ids (and launches
    # the first decode step) counts as prefill, and the turn that reads the last decode step's ids (and launches
    # nothing) counts as decode; decode_wall_s / decode_timed_steps is then the decode step's wall time in the loop
    decode_host_s: float = 0.0
    decode_wall_s: float = 0.0
    decode_timed_steps: int = 0
    generated: int = 0
    recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=256))


@dataclasses.dataclass(frozen=True)
class Completion:
    """One prompt's result of `Engine.generate(..., logprobs=N)`.

    token_ids: the new tokens. logprobs: float32 logprob of each of them; top_logprobs: per token, the N most
    likely tokens as {token_id: logprob} (N = 0: empty dicts). Logprobs are the model's distribution
    (log_softmax of the logits, before temperature and top_p: see `sampling.token_logprobs`). finish_reason:
    "stop" (a stop id), "length" (max_new_tokens or max_model_len)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str


@dataclasses.dataclass
class _Seq:
    tokens: list[int]
    pages: list[int]
    done: bool = False


class Engine:
    """A loaded model serving requests: the request front over a `ModelRunner`.

    The runner (`eng.runner`, glm_dsa.serving.runner) holds the mesh, the parameters, the paged caches, the page
    allocator and the compiled steps; `params` and `caches` (plain pytrees, see `glm_dsa.step`), `config`,
    `parallel`, `mesh`, `num_pages` and the other sizes read through to it. The Engine owns the host-side
    scheduling: the continuous-batching `Scheduler` (prefill in chunks of at most `max_num_batched_tokens` rows,
    then one decode row per live sequence per step), requests submitted from other threads, speculative decoding
    and the loop's counters. Shapes are bucketed, so a new call reuses compiled steps.

    `enable_prefix_caching` (default on): requests whose tokens begin with full pages already computed (by a
    running or finished request) reuse those pages of both caches instead of computing them (see
    glm_dsa.serving.scheduler and prefix_cache); `metrics()` counts the reuse, `reset_prefix_cache()` forgets it.
    It needs block_size divisible by the DCP interleave; otherwise it is turned off, with a warning.
    `batch_invariant=True`: a request's tokens and logprobs are bitwise the same whether it runs alone or beside
    other requests, at any row position, with any `max_num_batched_tokens`, after a preemption and its recompute,
    and whether its prompt's pages were found in the prefix cache or computed (for one mesh, device, jax version
    and engine: max_model_len, max_num_seqs, block_size and invariant_step_rows). Every kernel rule takes its
    fixed per-row choice for the step's kind (`kernels.registry.batch_invariant`: prompt steps the default mode's
    prefill forms for their shape, decode steps fixed decode forms), and every serving step is of one of two kinds
    (each with the block-table width of max_model_len and the request count of max_num_seqs): a prompt step
    computes prompt tokens only (prefill chunks), padded to `invariant_step_rows[0]` rows (default
    `kernels.registry.INVARIANT_PROMPT_ROWS` = 8192); a decode step computes every other token (decode rows, and a
    preempted request's generated tokens when it is recomputed), padded to the power-of-two bucket of its rows from 8
    up to `invariant_step_rows[1]` rows (default `INVARIANT_STEP_ROWS` = 256; `kernels.registry.decode_step_rows`),
    whose kernel choices and launch configs are the decode kind's at every bucket and whose XLA products run at
    `invariant_step_rows[1]` rows (`glm_dsa.model.linear.at_decode_rows`). The kinds never share a step (they
    alternate while both have work; see glm_dsa.serving.scheduler), so a token is always computed in a step of its
    kind; a step holds at most min(max_num_batched_tokens, its kind's rows). `warmup` compiles the decode buckets the
    planned `generate` reaches, `warmup_steps` every one; another bucket compiles at its first step. The prefix
    cache keeps only pages of prompt tokens there. Memory: every prompt step has the activations of
    `invariant_step_rows[0]` rows whatever max_num_batched_tokens (as the default mode at max_num_batched_tokens =
    8192), within the device memory the cache plan leaves (1 - cache_memory_fraction); where that does not fit, pass
    smaller prompt rows (results are then the same among engines of those rows) or a smaller cache_memory_fraction.
    `invariant_step_rows` is for that and for tests; None keeps the defaults (a value without batch_invariant is a
    ValueError). Not with speculative decoding. It covers the serving loop (`generate`, `stream`, `submit`, the
    server), not `logits` and `trace` (steps of their own shapes).
    """

    config = _runner_attribute("config", "The model's `GlmDsaConfig`.")
    parallel = _runner_attribute("parallel", "The resolved `ParallelConfig`.")
    mesh = _runner_attribute("mesh", "The device mesh ('tp', 'dcp').")
    dtype = _runner_attribute("dtype", "The compute dtype.")
    kv_cache_dtype = _runner_attribute("kv_cache_dtype", "The cache form: 'auto', 'bfloat16' or 'fp8_ds_mla'.")
    impl = _runner_attribute("impl", "The op implementation the steps use.")
    batch_invariant = _runner_attribute("batch_invariant", "Whether the steps are batch-invariant (see the class).")
    max_model_len = _runner_attribute("max_model_len", "Longest sequence (prompt and output) in tokens.")
    block_size = _runner_attribute("block_size", "Tokens per cache page.")
    pages_per_seq = _runner_attribute("pages_per_seq", "Pages (per DCP rank) a sequence of max_model_len holds.")
    num_pages = _runner_attribute("num_pages", "Cache pages per DCP rank (page 0 is padding).")
    max_num_seqs = _runner_attribute("max_num_seqs", "Most sequences running at once (the memory plan's).")
    allocator = _runner_attribute("allocator", "The runner's `PageAllocator`.")
    params = _runner_attribute("params", "The parameters: a plain pytree.", writable=True)
    caches = _runner_attribute("caches", "The paged caches: a plain pytree, replaced by each step.", writable=True)

    def __init__(self, config: GlmDsaConfig, params, *, parallel: ParallelConfig | None = None,
                 dtype="bfloat16", kv_cache_dtype: str = "auto", max_model_len: int | None = None,
                 block_size: int = 16, num_pages: int | None = None, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 2048, impl: str | None = None,
                 cache_memory_fraction: float = 0.8, num_speculative_tokens: int = 0, mtp_params=None,
                 enable_prefix_caching: bool = True, batch_invariant: bool = False,
                 invariant_step_rows: tuple[int, int] | None = None):
        # MTP speculative decoding (glm_dsa.serving.spec_decoder): k drafts per step from the nextn layer
        # `mtp_params`; checked first, before the runner allocates anything
        self.num_speculative_tokens = check_positive_int("num_speculative_tokens", num_speculative_tokens, minimum=0)
        if self.num_speculative_tokens and mtp_params is None:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} needs the MTP (nextn) layer's "
                             "parameters (mtp_params; glm_dsa.load reads them from the checkpoint)")
        self.max_num_batched_tokens = check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if batch_invariant is True and self.num_speculative_tokens:
            raise ValueError("batch_invariant=True with num_speculative_tokens > 0: the speculative step is not "
                             "batch-invariant; turn one of them off")
        self.runner = ModelRunner(config, params, parallel=parallel, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                  max_model_len=max_model_len, block_size=block_size, num_pages=num_pages,
                                  max_num_seqs=max_num_seqs, impl=impl, cache_memory_fraction=cache_memory_fraction,
                                  num_speculative_tokens=self.num_speculative_tokens,
                                  batch_invariant=batch_invariant, invariant_step_rows=invariant_step_rows)
        self.last_timings: dict = {}  # of the last generate (see there)
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        if enable_prefix_caching and self.block_size % self.parallel.interleave:
            logging.getLogger(__name__).warning(
                "prefix caching is off: block_size %d is not a multiple of the DCP interleave %d (a page's tokens "
                "would not be consecutive positions)", self.block_size, self.parallel.interleave)
            enable_prefix_caching = False
        self.enable_prefix_caching = enable_prefix_caching
        # serving: the host scheduler over the runner's pages, and the loop's state (see `step`)
        self.scheduler = Scheduler(self.allocator, block_size=self.block_size, dcp=self.parallel.dcp,
                                   interleave=self.parallel.interleave, max_num_seqs=self.max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens,
                                   max_model_len=self.max_model_len, lookahead=self.num_speculative_tokens,
                                   prefix_caching=enable_prefix_caching, invariant_rows=self.runner.invariant_rows)
        self._pending = None  # (plan, device ids) of the dispatched step whose ids are not processed yet
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # submits and aborts from other threads
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._background = None
        self.wake_event = threading.Event()
        self._dry: set | None = None  # warmup: shapes already compiled (their steps are skipped)
        self.stats = _LoopStats()
        # serving across processes (glm_dsa.serving.lockstep): called by each step with the submits and aborts
        # this process received, returns those every process applies at this step (process 0's), so all plan alike
        self.step_sync = None
        self.spec = SpecDecoder(self, mtp_params, self.num_speculative_tokens) if self.num_speculative_tokens else None

    # ---- input checks ----------------------------------------------------------------------
    def _check_tokens(self, seqs, what: str) -> list[list[int]]:
        """`seqs` as lists of ints, each non-empty, within max_model_len and the vocabulary (TypeError for
        anything that is not a list of integer token ids)."""
        if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__iter__"):
            raise TypeError(f"{what}s must be a list of token-id lists, got {seqs!r}")
        out = []
        for i, s in enumerate(seqs):
            if isinstance(s, (int, np.integer)):
                raise TypeError(f"{what}s must be a list of token-id lists; {what} {i} is the integer {s!r} "
                                f"(wrap a single {what} in a list: [[...]])")
            s = check_token_ids(f"{what} {i}", s, self.config.vocab_size)
            if len(s) == 0:
                raise ValueError(f"{what} {i} is empty")
            if len(s) > self.max_model_len:
                raise ValueError(f"{what} {i} has {len(s)} tokens, longer than max_model_len={self.max_model_len}")
            out.append(s)
        return out

    # ---- prefill for `logits` -----------------------------------------------------------------
    def _prefill(self, seqs: list[_Seq], on_logits, all_rows: bool = False) -> None:
        """Feed every token of every sequence in chunks of at most `max_num_batched_tokens` rows, calling
        `on_logits(logits, seq_idx, pos)` with each chunk's device logits for its rows (seq_idx, pos): all of
        them with `all_rows`, else only the sequences' last tokens (chunks with none are not asked for any)."""
        lens = np.asarray([len(s.tokens) for s in seqs])
        seq_idx = np.repeat(np.arange(len(seqs)), lens)
        pos = np.concatenate([np.arange(n) for n in lens])
        tok = np.concatenate([np.asarray(s.tokens, np.int64) for s in seqs])
        for c in range(0, len(pos), self.max_num_batched_tokens):
            sl = slice(c, c + self.max_num_batched_tokens)
            want = np.arange(len(pos[sl])) if all_rows else np.nonzero(pos[sl] == lens[seq_idx[sl]] - 1)[0]
            logits = self.runner.run(seq_idx[sl], pos[sl], tok[sl], [s.pages for s in seqs], want)
            if len(want):
                on_logits(logits, seq_idx[sl][want], pos[sl][want])

    def warmup(self, batch: int, prompt_len: int, max_new_tokens: int = 2, temperature: float = 0.0,
               top_p: float = 1.0) -> None:
        """Compile what a `generate` of `batch` prompts of `prompt_len` tokens and `max_new_tokens` will use: the
        scheduler plans that call step by step, but only a step of a shape not seen yet runs (on the pages the
        plan holds, released afterwards); the others are skipped, with token 0 standing for their samples."""
        check_positive_int("max_new_tokens", max_new_tokens, minimum=0)
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, stop_token_ids=[])
        self._check_idle("warmup")
        self._dry = set()
        # the skipped steps write nothing, so their pages must not be cached (nor its equal prompts hit each other:
        # the shapes compiled are those of prompts that do not share pages)
        caching, self.scheduler.prefix_caching = self.scheduler.prefix_caching, False
        try:
            reqs = [self._request([0] * prompt_len, params, i) for i in range(batch)]
            self._drive(reqs)
        finally:
            self._dry = None
            self.scheduler.prefix_caching = caching

    def warmup_steps(self, pages=None, max_rows: int | None = None, greedy=(True,), logprobs=(False,),
                     progress=None) -> int:
        """Compile every serving-step shape the loop can reach (`ModelRunner.serving_shapes`: each rows bucket up
        to `max_rows`, default max_num_batched_tokens, with each requests bucket, at the block-table widths of
        `pages`, the page counts (per DCP rank) a step's longest request may hold, default any; in batch-invariant
        mode the prompt rows and each decode bucket up to `max_rows`), for each of `greedy` (True: steps that
        sample greedily, or nothing) and `logprobs`; returns how many were compiled (the others already were).

        Which of those shapes a serving loop meets depends on how requests arrive: how many are running and how
        many rows their admissions bring to a step (with prefix caching, the uncached tails of varied lengths).
        A shape met for the first time compiles inside the loop, which stalls every request for the compile (on a
        GPU, seconds per shape at full model size), so warming by serving sample traffic leaves shapes that
        arrive with other timings; this compiles them all ahead. Each compile runs one step of padding rows
        only: the caches, block table and requests are untouched. Not with speculative decoding (its turn
        compiles its own steps). `progress`: called as progress(done, total) after each shape (compiled or not),
        for a caller that reports on a long warm-up."""
        if self.spec is not None:
            raise ValueError("warmup_steps: not with speculative decoding (num_speculative_tokens > 0)")
        self._check_idle("warmup_steps")
        if max_rows is None:
            max_rows = self.max_num_batched_tokens
        widths = None if pages is None else {self.runner.width_for(check_positive_int("pages", p)) for p in pages}
        before = self.runner.step_shapes_compiled()
        shapes = [(t, width, nr, bool(g), bool(lp))
                  for t, width, nr in self.runner.serving_shapes(check_positive_int("max_rows", max_rows), widths)
                  for g in greedy for lp in logprobs]
        for i, (t, width, nr, g, lp) in enumerate(shapes):
            self.runner.compile_step(t, width, nr, greedy=g, logprobs=lp)
            if progress is not None:
                progress(i + 1, len(shapes))
        return self.runner.step_shapes_compiled() - before

    def _release(self, seqs: list[_Seq]) -> None:
        for s in seqs:
            self.allocator.release(s.pages)
            s.pages = []

    def _new_seqs(self, prompts: list[list[int]], extra: list[int]) -> list[_Seq]:
        seqs = []
        try:
            for p, e in zip(prompts, extra):
                n = pages_needed(min(len(p) + e, self.max_model_len), self.block_size, self.parallel.dcp,
                                 self.parallel.interleave)
                seqs.append(_Seq(tokens=[int(t) for t in p], pages=self.allocator.allocate(n)))
        except RuntimeError:
            self._release(seqs)
            raise
        return seqs

    # ---- public API ------------------------------------------------------------------------
    def logits(self, token_ids) -> np.ndarray:
        """Full-prefill logits: int [B, T] -> float32 numpy [B, T, vocab]."""
        ids = np.asarray(token_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token_ids must be an integer array [B, T], got shape {ids.shape} dtype {ids.dtype}")
        rows = self._check_tokens(ids.tolist(), "row")
        out = np.zeros(ids.shape + (self.config.vocab_size,), np.float32)
        for g in range(0, len(rows), self.max_num_seqs):
            group = rows[g: g + self.max_num_seqs]
            seqs = self._new_seqs(group, [0] * len(group))

            def keep(logits, seq_idx, pos, g=g):
                out[g + seq_idx, pos] = np.asarray(logits[: len(pos)])
            try:
                self._prefill(seqs, keep, all_rows=True)
            finally:
                self._release(seqs)
        return out

    def trace(self, token_ids, layers=None) -> dict[str, np.ndarray]:
        """Per-layer intermediates of one sequence (int [T]) by name (see glm_dsa.debug.trace), as numpy arrays;
        `layers` (an iterable of layer indices) keeps only those layers."""
        ids = np.asarray(token_ids)
        if ids.ndim != 1 and not (ids.ndim == 2 and ids.shape[0] == 1):
            raise ValueError(f"token_ids must be one sequence [T] (or [1, T]), got shape {ids.shape}")
        ids = np.asarray(self._check_tokens([ids.reshape(-1).tolist()], "sequence")[0], np.int32)
        return self.runner.trace(ids, layers)

    def generate(self, prompts, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 stop_token_ids=None, logprobs: int | None = None) -> list[list[int]] | list[Completion]:
        """Continue each prompt (a list of token ids) by up to `max_new_tokens` tokens.

        Greedy at temperature 0 (and below `sampling.GREEDY_BELOW`); otherwise temperature sampling with nucleus
        `top_p`, reproducible for a given `seed` (any integer in [0, 2**64)): the n-th new token of prompt i is
        drawn with the key fold_in(fold_in(key(seed), n), i), whatever else shares its steps. Arguments are
        checked first: TypeError / ValueError naming the argument (token ids must be integers in the vocabulary).
        A sequence stops after emitting a token of `stop_token_ids` (default: the model's EOS ids; pass [] to
        never stop early), or on reaching max_model_len. Returns the new tokens per prompt; with `logprobs` N
        (0-20) given, a `Completion` per prompt instead: the tokens, each one's logprob and the N best
        alternatives' (the model's distribution before temperature and top_p), and the finish reason.

        The prompts go through the continuous-batching scheduler (at most max_num_seqs at once, admitted as
        others finish). Afterwards `self.last_timings` holds host-clock seconds of this call: "prefill_s" (to
        the first token of every prompt), "decode_s" (the rest), "decode_steps" (steps of decode rows only),
        "prompt_steps" (steps with prompt tokens: in batch-invariant mode its prompt steps),
        "steps", "host_ms_per_step" (loop time per step not spent waiting for the device), "step_ms" (loop time
        per step), the same two over the "decode_timed_steps" loop turns that waited for a decode-only step's ids
        ("decode_host_ms_per_step", "decode_step_ms": the loop's wall time per decode step, from the host
        receiving the last prefill step's ids to its receiving the last decode step's, as
        benchmarks/bench_serving.py's step_ms; the turn that launches the first decode step waits for the last
        prefill step and is not counted) and "preemptions".
        """
        check_positive_int("max_new_tokens", max_new_tokens, minimum=0)  # named as the caller named it
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_new_tokens,
                                stop_token_ids=stop_token_ids, logprobs=logprobs)
        prompts = self._check_tokens(prompts, "prompt")
        self._check_idle("generate")
        reqs = [self._request(p, params, i) for i, p in enumerate(prompts)]
        self.last_timings = self._drive(reqs)
        failed = [r for r in reqs if r.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"generate: prompt {failed[0].prompt_index} failed: {failed[0].error}")
        if logprobs is None:
            return [list(r.output) for r in reqs]
        return [Completion(list(r.output), list(r.logprobs), list(r.top_logprobs), r.finish_reason) for r in reqs]

    def stream(self, prompts, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
               stop_token_ids=None):
        """`generate`'s work as an iterator of (prompt index, token id) in the order tokens are sampled (the same
        tokens `generate` returns). Closing the iterator early aborts what is left and frees its pages."""
        check_positive_int("max_new_tokens", max_new_tokens, minimum=0)
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_new_tokens,
                                stop_token_ids=stop_token_ids)
        prompts = self._check_tokens(prompts, "prompt")
        self._check_idle("stream")
        return self._stream(prompts, params)

    def _stream(self, prompts, params):
        out: collections.deque = collections.deque()
        reqs = [self._request(p, params, i) for i, p in enumerate(prompts)]
        for r in reqs:
            r.on_token = lambda r, tok: out.append((r.prompt_index, tok))
            self.scheduler.add(r)
        try:
            while True:
                while out:
                    yield out.popleft()
                if not self.step():
                    break
            yield from out
        finally:
            for r in reqs:
                if not r.finished:
                    self.scheduler.abort(r)
            while self.step():
                pass
        failed = [r for r in reqs if r.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"stream: prompt {failed[0].prompt_index} failed: {failed[0].error}")

    def submit(self, prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
               prompt_index: int = 0) -> RequestStream:
        """Queue one prompt (a list of token ids) and return its `RequestStream` (iterate it, or `async for` it
        under a `BackgroundLoop`). Thread-safe; checks the prompt and that the request fits in the cache at
        once (ValueError / TypeError). `prompt_index` enters the sampling keys (see `generate`); `request_id`
        (default: a fresh one) is what `abort` takes."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt = self._check_tokens([prompt], "prompt")[0]
        r = self._request(prompt, params, check_positive_int("prompt_index", prompt_index, minimum=0), request_id)
        stream = RequestStream(self, r)
        self._inbox.put(("add", r))
        self.wake_event.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a submitted request (thread-safe): it finishes with reason "abort" and its pages are freed at
        the loop's next step. Unknown or finished ids are ignored."""
        self._inbox.put(("abort", request_id))
        self.wake_event.set()

    @property
    def serving_in_background(self) -> bool:
        """Whether a `BackgroundLoop` runs this engine's steps."""
        return self._background is not None

    def attach_background(self, loop) -> None:
        """Called by `BackgroundLoop.start` / `stop`: while attached, only that loop calls `step`."""
        if loop is not None and self._background is not None:
            raise RuntimeError("the engine already has a background loop")
        self._background = loop

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix page (pages held by running requests stay theirs). Thread-safe: while a
        background loop serves (or processes run in lockstep) it takes effect at the loop's next step, in every
        process alike."""
        if self._background is not None or self.step_sync is not None:
            self._inbox.put(("reset_prefix_cache", None))
            self.wake_event.set()
        else:
            self.scheduler.reset_prefix_cache()

    def metrics(self) -> dict:
        """Serving counters: requests running and waiting, KV pages used (held by requests) and free (free or
        cached but unheld; per DCP rank), preemptions, finished and aborted requests, steps, generated tokens,
        tokens/s over the recent steps, host time per step, and the prefix cache's: `prefix_cache_queries`
        (tokens of admitted sequences looked up, recomputed ones again), `prefix_cache_hits` (of those, tokens
        found cached and not computed) and `prefix_cache_pages` (pages in its index, per DCP rank);
        `step_shapes_compiled`: the serving-step shapes compiled so far (`warmup_steps` compiles them ahead; a
        count that grows while serving is a step that stalled the loop for its compile; speculative decoding's
        draft and verify steps are not among them)."""
        st, sch = self.stats, self.scheduler
        recent = list(st.recent)
        span = recent[-1][0] - recent[0][0] if len(recent) > 1 else 0.0
        rate = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
        return {"running": len(sch.running), "waiting": len(sch.waiting), "kv_pages_used": sch.pages_used(),
                "kv_pages_free": self.allocator.free, "kv_pages_total": self.num_pages - 1,
                "preemptions": sch.preemptions, "requests_finished": sum(sch.finished.values()),
                "requests_aborted": sch.finished["abort"], "steps": st.steps, "generated_tokens": st.generated,
                "tokens_per_s": rate, "host_ms_per_step": 1e3 * st.host_s / max(st.steps, 1),
                "step_ms": 1e3 * st.wall_s / max(st.steps, 1), "prefix_cache_queries": sch.prefix_queries,
                "prefix_cache_hits": sch.prefix_hits, "prefix_cache_pages": sch.cached_pages,
                "step_shapes_compiled": self.runner.step_shapes_compiled(),
                **(self.spec.metrics() if self.spec else {})}

    # ---- the serving loop ------------------------------------------------------------------
    def _check_idle(self, what: str) -> None:
        if self._background is not None:
            raise RuntimeError(f"{what}: the engine is serving in the background; use submit()")
        if self.scheduler.has_work or self._pending is not None:
            raise RuntimeError(f"{what}: the engine still has requests in flight (a stream not yet finished)")

    def _request(self, prompt, params: SamplingParams, prompt_index: int, request_id: str | None = None) -> Request:
        if params.logprobs is not None and self.spec is not None:
            raise ValueError("logprobs are not reported with speculative decoding (num_speculative_tokens > 0)")
        stop = frozenset(self.config.eos_token_id if params.stop_token_ids is None else params.stop_token_ids)
        r = Request(request_id or f"req-{next(self._ids)}", list(prompt), params, stop, prompt_index)
        self.scheduler.check_fits(r)
        return r

    def _drive(self, reqs: list[Request]) -> dict:
        """Run the loop in this thread until `reqs` finish; returns the call's timings (see `generate`)."""
        st = self.stats
        steps0, decode0, host0, wall0 = st.steps, st.decode_steps, st.host_s, st.wall_s
        prompt0 = st.prompt_steps
        dhost0, dwall0, timed0 = st.decode_host_s, st.decode_wall_s, st.decode_timed_steps
        pre0 = self.scheduler.preemptions
        spec0 = self.spec.snapshot() if self.spec else None
        t0 = time.perf_counter()
        for r in reqs:
            self.scheduler.add(r)
        while self.step():
            pass
        t1 = time.perf_counter()
        firsts = [r.first_token_time for r in reqs if r.first_token_time is not None]
        prefill = (max(firsts) - t0) if len(firsts) == len(reqs) else (t1 - t0)
        steps, timed = st.steps - steps0, st.decode_timed_steps - timed0
        return {"prefill_s": prefill, "decode_s": t1 - t0 - prefill, "decode_steps": st.decode_steps - decode0,
                "prompt_steps": st.prompt_steps - prompt0,
                "steps": steps, "host_ms_per_step": 1e3 * (st.host_s - host0) / max(steps, 1),
                "step_ms": 1e3 * (st.wall_s - wall0) / max(steps, 1), "decode_timed_steps": timed,
                "decode_host_ms_per_step": 1e3 * (st.decode_host_s - dhost0) / max(timed, 1),
                "decode_step_ms": 1e3 * (st.decode_wall_s - dwall0) / max(timed, 1),
                "preemptions": self.scheduler.preemptions - pre0,
                **(self.spec.summary(spec0) if self.spec else {})}

    def _drain_inbox(self) -> None:
        events = []
        while True:
            try:
                events.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        if self.step_sync is not None:
            events = self.step_sync(events)
        for kind, x in events:
            if kind == "add":
                self._requests[x.request_id] = x
                finish = x.on_finish

                def forget(r, finish=finish):
                    self._requests.pop(r.request_id, None)
                    if finish is not None:
                        finish(r)
                x.on_finish = forget
                try:
                    self.scheduler.add(x)
                except Exception as e:  # checked in submit; a request that still cannot queue fails alone
                    self.scheduler.fail([x], f"{type(e).__name__}: {e}")
            elif kind == "reset_prefix_cache":
                self.scheduler.reset_prefix_cache()
            elif x in self._requests:
                self.scheduler.abort(self._requests[x])

    def step(self) -> bool:
        """One turn of the serving loop: plan and dispatch the next step, then take the previous step's sampled
        ids (the device runs the new step meanwhile) and hand them to their requests. Returns whether work is
        left. Called by `generate` / `stream` / a `RequestStream` in the caller's thread, or by a
        `BackgroundLoop`. A step that fails finishes its requests with an error; the others go on."""
        self._drain_inbox()
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if self.spec is not None:  # speculative decoding: one synchronous turn (glm_dsa.serving.spec_decoder)
            return self.spec.turn(plan, t0)
        new = None
        launch_s = 0.0
        if plan is not None:
            try:
                new = (plan, self.runner.execute(plan, self._dry))
                launch_s = self.runner.launch_s
                self.stats.h2d_bytes += self.runner.last_h2d_bytes
                self.stats.last_h2d_bytes = self.runner.last_h2d_bytes
            except Exception as e:  # a step that cannot run fails its requests, not the loop
                logging.getLogger(__name__).exception("step failed")
                self.scheduler.fail(plan.requests, f"{type(e).__name__}: {e}")
        blocked = 0.0
        tb = time.perf_counter()
        old_plan = None
        if self._pending is not None:
            old_plan, ids = self._pending
            lp = None
            if isinstance(ids, tuple):  # some request asked for logprobs: (ids, logprob, top ids, top logprobs)
                ids, *lp = ids
            host_ids = np.asarray(ids)  # waits for the previous step only: the new one is queued behind it
            self.stats.syncs += not isinstance(ids, np.ndarray)
            if lp is not None:
                lp = [np.asarray(x) for x in lp]  # computed by the same step: already there
            tp = time.perf_counter()
            blocked = tp - tb
            if lp is None:  # the plain call, as wrappers of `process` (benchmarks' step recorders) take it
                self.scheduler.process(old_plan, host_ids, tp)
            else:
                self.scheduler.process(old_plan, host_ids, tp, logprobs=lp)
            self.stats.generated += len(old_plan.sample_reqs)
        self._pending = new
        t1 = time.perf_counter()
        st = self.stats
        if new is not None:
            st.build_s += tb - t0 - launch_s
            st.launch_s += launch_s
            st.process_s += t1 - tb - blocked
            st.steps += 1
            st.decode_steps += plan.prefill_rows == 0
            st.prompt_steps += plan.prompt_rows > 0
            st.host_s += t1 - t0 - blocked
            st.wall_s += t1 - t0
            st.recent.append((t1, len(plan.sample_reqs)))
        # decode time by the step this turn waited for, not the one it launched: the turn launching the first
        # decode step waits for the last prefill step (see `_LoopStats.decode_wall_s`)
        if old_plan is not None and old_plan.prefill_rows == 0:
            st.decode_timed_steps += 1
            st.decode_host_s += t1 - t0 - blocked
            st.decode_wall_s += t1 - t0
        return self.scheduler.has_work or self._pending is not None


def load(path: str | os.PathLike, *, parallel: ParallelConfig | None = None, dtype="bfloat16",
         kv_cache_dtype: str = "auto", max_model_len: int | None = None, progress: bool = True,
         num_speculative_tokens: int = 0, quantization=None, device_memory: int | None = None,
         **engine_kw) -> Engine:
    """Load a checkpoint directory onto the mesh of `parallel` and return an `Engine`.

    `path` is an HF safetensors directory (bf16/fp32, or an FP8 block-scaled release) or an orbax directory
    written by `python -m glm_dsa convert` / `checkpoints.save_orbax_params` (its newest committed version; an
    interrupted save is never read). Parameters go onto the devices with their target
    sharding, whatever mesh they were saved from. Extra keyword arguments (block_size, num_pages, max_num_seqs,
    max_num_batched_tokens, impl, enable_prefix_caching, batch_invariant: bitwise reproducible requests, see `Engine`) go to `Engine`. `num_speculative_tokens` k > 0: MTP speculative decoding, k drafts
    per step from the checkpoint's nextn layer (loaded only then; a checkpoint without one is a CheckpointError).
    `quantization`: None keeps the checkpoint's form (an FP8 release's block-scaled weights stay float8_e4m3fn on
    the devices, with their scales, and the model computes from them), "fp8" quantises a bf16/fp32 checkpoint's
    linear weights at load (128 x 128 blocks), "none" dequantises everything to `dtype` (reference runs); see
    `checkpoints.quantization`. A layout whose weights cannot fit a device (`device_memory` bytes, default the
    device's free memory where it reports it) is refused before anything is allocated.
    """
    k = check_positive_int("num_speculative_tokens", num_speculative_tokens, minimum=0)
    config, parallel, flat = load_params(path, parallel=parallel, dtype=dtype, progress=progress, mtp=k > 0,
                                         quantization=quantization, device_memory=device_memory)
    params = nest_params(flat)
    mtp = params.pop("mtp", None)
    return Engine(config, params, parallel=parallel, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                  max_model_len=max_model_len, num_speculative_tokens=k, mtp_params=mtp, **engine_kw)
