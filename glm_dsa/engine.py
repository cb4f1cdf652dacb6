"""The paged-cache engine: `load` a checkpoint, then `logits` and `generate` over compiled, bucketed steps."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import os
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels import default_impl, registry
from sharding import ParallelConfig, cache_spec, mesh_for
from sharding.dcp import local_position

from . import host_buffer
from .config import GlmDsaConfig
from .distributed import check_mesh_spans_processes
from .model import StepBatch
from .mtp import mtp_cache_bytes_per_token
from .params import load_params, resolve_dtype
from .paged_cache import (PageAllocator, allocate_caches, block_table_array, cache_bytes_per_token, cache_dtype,
                          free_device_bytes, max_addressable_pages, owner_slots, pages_needed, plan_pages)
from .sampling import GREEDY_BELOW, SamplingParams, check_token_ids, sample
from .scheduler import Request, Scheduler, StepPlan
from .spec_engine import SpecDecoder
from .streaming import RequestStream
from .pytree import nest_params
from .step import resolve_parallel, step


def _positive_int(name: str, value, minimum: int = 1) -> int:
    """`value` as an int >= minimum, or a TypeError / ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def _serve_step(params, caches, tables, rows, plan_rows, table_updates, table_resets, samp_u32, samp_f32,
                prev_ids, *, config, parallel, impl, n_out: int, block_size: int, width: int, greedy: bool):
    """One serving step: update the device block table, run the model step, sample each logits row; returns the
    sampled ids padded to `n_out`, the caches and the table.

    tables int32 [S + 1, pages_per_seq]: the block table of every running request, one row each (row S stays
    page 0, for padding), kept on the device and changed only by `table_resets` (int32 [S + 1], 1: zero the row)
    and `table_updates` (int32 [3, U]: row, column, page; rows past S are padding, dropped). So a step sends what
    changed, never whole tables: the host work and bytes per step do not grow with the context.
    rows int32 [4, T]: each row's token, position (-1: a padding row, which writes nothing), request (index into
    `plan_rows`, the requests' table rows) and src (>= 0: the token is `prev_ids[src]`, the previous step's sampled
    id still on the device, so the host does not wait for it). samp_u32 uint32 [5, L]: logits row, seed high and
    low words, token index, prompt index; samp_f32 float32 [2, L]: temperature, top_p. Logits row i samples with
    the key fold_in(fold_in(key(seed), token_index), prompt_index): a request's draws depend on its own seed,
    prompt index and token index only, never on the batch it shares a step with. `width` (static): block-table
    columns the step reads; `greedy` (static): every sampled row is greedy (argmax only)."""
    tables = jnp.where(table_resets[:, None] > 0, 0, tables)
    tables = tables.at[table_updates[0], table_updates[1]].set(table_updates[2], mode="drop")
    block_tables = tables[plan_rows, :width]
    src, pos, req = rows[3], rows[1], rows[2]
    token_ids = jnp.where(src >= 0, prev_ids[jnp.maximum(src, 0)], rows[0])
    p = jnp.maximum(pos, 0)
    lp = local_position(p, parallel.dcp, parallel.interleave)  # the position on its owning DCP rank
    slot = block_tables[req, lp // block_size] * block_size + lp % block_size
    slot = jnp.where(pos < 0, -1, slot).astype(jnp.int32)  # padding rows write nothing
    batch = StepBatch(token_ids.astype(jnp.int32), p, slot, req, block_tables, samp_u32[0].astype(jnp.int32))
    logits, caches = step(params, caches, batch, config=config, parallel=parallel, impl=impl)

    def key(words, token_index, prompt_index):
        return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(words), token_index), prompt_index)
    keys = jax.vmap(key)(samp_u32[1:3].T, samp_u32[3], samp_u32[4])
    ids = sample(logits, keys, samp_f32[0], samp_f32[1], all_greedy=greedy)
    return jnp.zeros(n_out, jnp.int32).at[: ids.shape[0]].set(ids), caches, tables


def _serve_step_packed(params, caches, tables, packed, prev_ids, *, layout: host_buffer.Layout, **kw):
    """`_serve_step` with its host inputs in one uint32 buffer (`host_buffer.pack` of the int32 `rows` [4, T],
    `plan_rows` [R], `table_updates` [3, T], `table_resets` [S + 1], `samp_u32` [5, L] and `samp_f32` [2, L]), so
    a step makes one host-to-device transfer instead of six; `layout` (static) is the pack's."""
    rows, plan_rows, updates, resets, samp_u32, samp_f32 = host_buffer.unpack(packed, layout)
    return _serve_step(params, caches, tables, rows, plan_rows, updates, resets, samp_u32, samp_f32, prev_ids, **kw)


def _bucket(n: int, minimum: int, factor: int = 2) -> int:
    """Smallest minimum * factor**i >= n: a few static shapes, so steps compile once per bucket."""
    b = minimum
    while b < n:
        b *= factor
    return b


@dataclasses.dataclass
class _LoopStats:
    """Counters of the serving loop since the engine was made (read by `Engine.metrics`)."""

    steps: int = 0
    decode_steps: int = 0  # steps with decode rows only
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


@dataclasses.dataclass
class _Seq:
    tokens: list[int]
    pages: list[int]
    done: bool = False


class Engine:
    """A loaded model with its paged caches and compiled step.

    `params` and `caches` are plain pytrees (see `glm_dsa.step`); the Engine owns the page allocator and the
    host-side scheduling: prefill in chunks of at most `max_num_batched_tokens` rows, then one decode row per
    live sequence per step. Shapes are bucketed to powers of two, so a new call reuses compiled steps.
    """

    def __init__(self, config: GlmDsaConfig, params, *, parallel: ParallelConfig | None = None,
                 dtype="bfloat16", kv_cache_dtype: str = "auto", max_model_len: int | None = None,
                 block_size: int = 16, num_pages: int | None = None, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 2048, impl: str | None = None,
                 cache_memory_fraction: float = 0.8, num_speculative_tokens: int = 0, mtp_params=None):
        self.config = config
        self.parallel = resolve_parallel(parallel, config)
        self.dtype = resolve_dtype(dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.impl = impl or default_impl()
        self.max_model_len = (min(config.max_position_embeddings, 4096) if max_model_len is None
                              else _positive_int("max_model_len", max_model_len))
        if self.max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's max_position_embeddings "
                             f"({config.max_position_embeddings})")
        if _positive_int("block_size", block_size) & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.block_size = int(block_size)
        self.max_num_seqs = max_num_seqs = _positive_int("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if isinstance(cache_memory_fraction, bool) or not 0 < cache_memory_fraction <= 1:
            raise ValueError(f"cache_memory_fraction must be in (0, 1], got {cache_memory_fraction!r}")
        # MTP speculative decoding (glm_dsa.spec_engine): k drafts per step from the nextn layer `mtp_params`
        self.num_speculative_tokens = _positive_int("num_speculative_tokens", num_speculative_tokens, minimum=0)
        if self.num_speculative_tokens and mtp_params is None:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} needs the MTP (nextn) layer's "
                             "parameters (mtp_params; glm_dsa.load reads them from the checkpoint)")
        n, inter = self.parallel.dcp, self.parallel.interleave
        self.pages_per_seq = pages_needed(self.max_model_len, block_size, n, inter)
        self.mesh = mesh_for(self.parallel)
        check_mesh_spans_processes(self.mesh)
        # FP8 caches over 2 GiB per layer are misaddressed by the Triton kernels (32-bit offsets)
        int32 = registry.decide("cache_offsets", impl=self.impl) == "int32"
        max_pages = max_addressable_pages(config, block_size, kv_cache_dtype) if int32 else None
        if num_pages is not None:
            # per DCP rank; page 0 is the padding page, so one sequence needs pages_per_seq + 1
            self.num_pages = _positive_int("num_pages", num_pages, minimum=2)
            if max_pages is not None and self.num_pages > max_pages:
                raise ValueError(f"num_pages={self.num_pages}: an FP8 cache of at most {max_pages} pages per layer "
                                 f"(block_size {block_size}) stays under the 2 GiB the Triton kernels address")
        else:  # enough for max_num_seqs full sequences, within cache_memory_fraction of the free device memory
            page_bytes = block_size * cache_bytes_per_token(config, self.dtype, kv_cache_dtype)
            if self.num_speculative_tokens:  # the nextn layer's cache rows share the pages
                page_bytes += block_size * mtp_cache_bytes_per_token(config, self.dtype, kv_cache_dtype)
            self.num_pages, self.max_num_seqs = plan_pages(
                max_num_seqs=max_num_seqs, pages_per_seq=self.pages_per_seq, page_bytes=page_bytes,
                free_bytes=free_device_bytes(self.mesh.local_devices[0]), memory_fraction=cache_memory_fraction,
                max_pages=max_pages)
        self.params = params
        cache_sharding = NamedSharding(self.mesh, cache_spec())
        self.caches = allocate_caches(config, self.num_pages * n, block_size,
                                      cache_dtype(kv_cache_dtype, self.dtype), cache_sharding, kv_cache_dtype)
        self.allocator = PageAllocator(self.num_pages)
        self.last_timings: dict = {}  # of the last generate (see there)
        self._step = jax.jit(functools.partial(step, config=config, parallel=self.parallel, impl=self.impl),
                             donate_argnums=(1,))
        # serving: the host scheduler, the fused step + sampler, and the loop's state (see `step`)
        self.scheduler = Scheduler(self.allocator, block_size=self.block_size, dcp=n, interleave=inter,
                                   max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                   max_model_len=self.max_model_len, lookahead=self.num_speculative_tokens)
        self._n_out = _bucket(self.max_num_seqs, 8)  # a step samples at most one row per running request
        # the block table of the running requests (scheduler table rows 0..max_num_seqs-1; the last row stays
        # page 0 for padding), on the device: steps send only its changes (see `_serve_step`)
        replicated = NamedSharding(self.mesh, P())
        self._tables = jax.device_put(np.zeros((self.max_num_seqs + 1, self.pages_per_seq), np.int32), replicated)
        # outputs placed exactly as the inputs they replace: a step fed the caches (or ids) of the previous one
        # hits the compiled step the first call made, instead of compiling again for an equal-but-new sharding
        out_shardings = (replicated, jax.tree.map(lambda c: c.sharding, self.caches), replicated)
        self._serve_step = jax.jit(functools.partial(_serve_step_packed, config=config, parallel=self.parallel,
                                                     impl=self.impl, n_out=self._n_out, block_size=self.block_size),
                                   static_argnames=("width", "greedy", "layout"), donate_argnums=(1, 2),
                                   out_shardings=out_shardings)
        self._prev_ids = None  # device ids sampled by the last dispatched step
        self._pending = None  # (plan, device ids) of the dispatched step whose ids are not processed yet
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # submits and aborts from other threads
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._background = None
        self.wake_event = threading.Event()
        self._dry: set | None = None  # warmup: shapes already compiled (their steps are skipped)
        self._launch_s = 0.0  # seconds the last step's jitted call took (see `_LoopStats.launch_s`)
        self.stats = _LoopStats()
        # serving across processes (glm_dsa.lockstep): called by each step with the submits and aborts this
        # process received, returns those every process applies at this step (process 0's), so all plan alike
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

    # ---- one compiled step -----------------------------------------------------------------
    def _run(self, seq_idx: np.ndarray, pos: np.ndarray, tok: np.ndarray, seqs: list[_Seq],
             logits_rows: np.ndarray) -> jax.Array:
        """One compiled step over rows (sequence index, position, token id), all int arrays; returns the device
        float32 logits [bucket >= len(logits_rows), vocab] of `logits_rows` (padding rows after them)."""
        bs, n, inter = self.block_size, self.parallel.dcp, self.parallel.interleave
        t = _bucket(len(pos), 8)
        # capped at a full sequence's pages: a power-of-two bucket past it would double the indexer's top-k width
        width = min(_bucket(max(len(s.pages) for s in seqs), 1), self.pages_per_seq)
        tables = block_table_array([s.pages for s in seqs], width, _bucket(len(seqs), 1))
        ids, p, slot, req = (np.zeros(t, np.int32) for _ in range(4))
        slot[:] = -1  # padding rows write nothing
        ids[: len(pos)], p[: len(pos)], req[: len(pos)] = tok, pos, seq_idx
        slot[: len(pos)] = owner_slots(tables, seq_idx, pos, bs, n, inter)
        li = np.zeros(_bucket(len(logits_rows), 8), np.int32)
        li[: len(logits_rows)] = logits_rows
        batch = StepBatch(*(jnp.asarray(x) for x in (ids, p, slot, req, tables, li)))
        logits, self.caches = self._step(self.params, self.caches, batch)
        return logits

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
            logits = self._run(seq_idx[sl], pos[sl], tok[sl], seqs, want)
            if len(want):
                on_logits(logits, seq_idx[sl][want], pos[sl][want])

    def warmup(self, batch: int, prompt_len: int, max_new_tokens: int = 2, temperature: float = 0.0,
               top_p: float = 1.0) -> None:
        """Compile what a `generate` of `batch` prompts of `prompt_len` tokens and `max_new_tokens` will use: the
        scheduler plans that call step by step, but only a step of a shape not seen yet runs (on the pages the
        plan holds, released afterwards); the others are skipped, with token 0 standing for their samples."""
        _positive_int("max_new_tokens", max_new_tokens, minimum=0)
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, stop_token_ids=[])
        self._check_idle("warmup")
        self._dry = set()
        try:
            reqs = [self._request([0] * prompt_len, params, i) for i in range(batch)]
            self._drive(reqs)
        finally:
            self._dry = None

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
        """Per-layer intermediates of one sequence (int [T]) by name (see glm_dsa.trace), as numpy arrays;
        `layers` (an iterable of layer indices) keeps only those layers."""
        from .trace import select_layers, trace
        ids = np.asarray(token_ids)
        if ids.ndim != 1 and not (ids.ndim == 2 and ids.shape[0] == 1):
            raise ValueError(f"token_ids must be one sequence [T] (or [1, T]), got shape {ids.shape}")
        ids = np.asarray(self._check_tokens([ids.reshape(-1).tolist()], "sequence")[0], np.int32)
        if not hasattr(self, "_trace"):
            self._trace = jax.jit(functools.partial(trace, config=self.config, parallel=self.parallel, impl=self.impl,
                                                    block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype))
        taps = self._trace(self.params, jnp.asarray(ids, jnp.int32))
        return {k: np.asarray(v) for k, v in select_layers(taps, layers).items()}

    def generate(self, prompts, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 stop_token_ids=None) -> list[list[int]]:
        """Continue each prompt (a list of token ids) by up to `max_new_tokens` tokens.

        Greedy at temperature 0 (and below `sampling.GREEDY_BELOW`); otherwise temperature sampling with nucleus
        `top_p`, reproducible for a given `seed` (any integer in [0, 2**64)): the n-th new token of prompt i is
        drawn with the key fold_in(fold_in(key(seed), n), i), whatever else shares its steps. Arguments are
        checked first: TypeError / ValueError naming the argument (token ids must be integers in the vocabulary).
        A sequence stops after emitting a token of `stop_token_ids` (default: the model's EOS ids; pass [] to
        never stop early), or on reaching max_model_len. Returns the new tokens per prompt.

        The prompts go through the continuous-batching scheduler (at most max_num_seqs at once, admitted as
        others finish). Afterwards `self.last_timings` holds host-clock seconds of this call: "prefill_s" (to
        the first token of every prompt), "decode_s" (the rest), "decode_steps" (steps of decode rows only),
        "steps", "host_ms_per_step" (loop time per step not spent waiting for the device), "step_ms" (loop time
        per step), the same two over the "decode_timed_steps" loop turns that waited for a decode-only step's ids
        ("decode_host_ms_per_step", "decode_step_ms": the loop's wall time per decode step, from the host
        receiving the last prefill step's ids to its receiving the last decode step's, as
        benchmarks/bench_serving.py's step_ms; the turn that launches the first decode step waits for the last
        prefill step and is not counted) and "preemptions".
        """
        _positive_int("max_new_tokens", max_new_tokens, minimum=0)  # named as the caller named it
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_new_tokens,
                                stop_token_ids=stop_token_ids)
        prompts = self._check_tokens(prompts, "prompt")
        self._check_idle("generate")
        reqs = [self._request(p, params, i) for i, p in enumerate(prompts)]
        self.last_timings = self._drive(reqs)
        failed = [r for r in reqs if r.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"generate: prompt {failed[0].prompt_index} failed: {failed[0].error}")
        return [list(r.output) for r in reqs]

    def stream(self, prompts, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
               stop_token_ids=None):
        """`generate`'s work as an iterator of (prompt index, token id) in the order tokens are sampled (the same
        tokens `generate` returns). Closing the iterator early aborts what is left and frees its pages."""
        _positive_int("max_new_tokens", max_new_tokens, minimum=0)
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
        r = self._request(prompt, params, _positive_int("prompt_index", prompt_index, minimum=0), request_id)
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

    def metrics(self) -> dict:
        """Serving counters: requests running and waiting, KV pages used and free (per DCP rank), preemptions,
        finished and aborted requests, steps, generated tokens, tokens/s over the recent steps, host time per
        step."""
        st, sch = self.stats, self.scheduler
        recent = list(st.recent)
        span = recent[-1][0] - recent[0][0] if len(recent) > 1 else 0.0
        rate = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
        return {"running": len(sch.running), "waiting": len(sch.waiting), "kv_pages_used": sch.pages_used(),
                "kv_pages_free": self.allocator.free, "kv_pages_total": self.num_pages - 1,
                "preemptions": sch.preemptions, "requests_finished": sum(sch.finished.values()),
                "requests_aborted": sch.finished["abort"], "steps": st.steps, "generated_tokens": st.generated,
                "tokens_per_s": rate, "host_ms_per_step": 1e3 * st.host_s / max(st.steps, 1),
                "step_ms": 1e3 * st.wall_s / max(st.steps, 1), **(self.spec.metrics() if self.spec else {})}

    # ---- the serving loop ------------------------------------------------------------------
    def _check_idle(self, what: str) -> None:
        if self._background is not None:
            raise RuntimeError(f"{what}: the engine is serving in the background; use submit()")
        if self.scheduler.has_work or self._pending is not None:
            raise RuntimeError(f"{what}: the engine still has requests in flight (a stream not yet finished)")

    def _request(self, prompt, params: SamplingParams, prompt_index: int, request_id: str | None = None) -> Request:
        stop = frozenset(self.config.eos_token_id if params.stop_token_ids is None else params.stop_token_ids)
        r = Request(request_id or f"req-{next(self._ids)}", list(prompt), params, stop, prompt_index)
        self.scheduler.check_fits(r)
        return r

    def _drive(self, reqs: list[Request]) -> dict:
        """Run the loop in this thread until `reqs` finish; returns the call's timings (see `generate`)."""
        st = self.stats
        steps0, decode0, host0, wall0 = st.steps, st.decode_steps, st.host_s, st.wall_s
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
        if self.spec is not None:  # speculative decoding: one synchronous turn (glm_dsa.spec_engine)
            return self.spec.turn(plan, t0)
        new = None
        self._launch_s = 0.0
        if plan is not None:
            try:
                new = (plan, self._dispatch(plan))
            except Exception as e:  # a step that cannot run fails its requests, not the loop
                logging.getLogger(__name__).exception("step failed")
                self.scheduler.fail(plan.requests, f"{type(e).__name__}: {e}")
        blocked = 0.0
        tb = time.perf_counter()
        old_plan = None
        if self._pending is not None:
            old_plan, ids = self._pending
            host_ids = np.asarray(ids)  # waits for the previous step only: the new one is queued behind it
            self.stats.syncs += not isinstance(ids, np.ndarray)
            tp = time.perf_counter()
            blocked = tp - tb
            self.scheduler.process(old_plan, host_ids, tp)
            self.stats.generated += len(old_plan.sample_reqs)
        self._pending = new
        t1 = time.perf_counter()
        st = self.stats
        if new is not None:
            st.build_s += tb - t0 - self._launch_s
            st.launch_s += self._launch_s
            st.process_s += t1 - tb - blocked
            st.steps += 1
            st.decode_steps += plan.prefill_rows == 0
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

    def step_shapes(self, plan: StepPlan) -> tuple[int, int, int]:
        """The bucketed static shapes of a plan's step: (rows T, block-table columns read, requests R)."""
        t = _bucket(plan.num_rows, 16)
        # capped at a full sequence's pages: a power-of-two bucket past it would double the indexer's top-k width;
        # a bucket over half of it takes the cap at once (at most twice the pages, as any bucket): one shape less
        width = _bucket(max(len(r.pages) for r in plan.requests), 8)
        width = self.pages_per_seq if 2 * width > self.pages_per_seq else width
        # requests (and logits rows, at most one each) in buckets growing 4x, capped at max_num_seqs' bucket
        nr = min(_bucket(len(plan.requests), 8, 4), self._n_out)
        return t, width, nr

    def table_inputs(self, plan: StepPlan, t: int, nr: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The block-table inputs of a plan's step (see `_serve_step`): the requests' table rows int32 [nr], the
        entries it changes int32 [3, t] and the rows it clears int32 [max_num_seqs + 1]."""
        plan_rows = np.full(nr, self.max_num_seqs, np.int32)  # padding requests read the all-zero last row
        plan_rows[: len(plan.requests)] = [r.table_row for r in plan.requests]
        # a step adds at most one page per row it computes, so the rows bucket bounds the updates
        upd = np.full((3, t), self.max_num_seqs + 1, np.int32)  # padding updates fall outside the table: dropped
        nu = plan.table_updates.shape[1]
        if nu > t:
            raise RuntimeError(f"a step of {plan.num_rows} rows changes {nu} block-table entries, more than its {t} "
                               "slots")
        upd[:, :nu] = plan.table_updates
        resets = np.zeros(self.max_num_seqs + 1, np.int32)
        resets[plan.table_resets] = 1
        return plan_rows, upd, resets

    def _dispatch(self, plan: StepPlan):
        """Build the plan's step inputs on the host and launch the fused step; returns the device ids. What is
        built does not depend on the requests' lengths: rows, logits rows and block-table changes only."""
        rows = plan.num_rows
        t, width, nr = self.step_shapes(plan)
        row_arr = np.zeros((4, t), np.int32)
        row_arr[1:, rows:] = -1  # padding rows: position -1 (write nothing), src -1; request 0
        row_arr[2, rows:] = 0
        row_arr[0, :rows], row_arr[1, :rows], row_arr[2, :rows], row_arr[3, :rows] = (plan.token, plan.pos, plan.req,
                                                                                       plan.src)
        plan_rows, upd, resets = self.table_inputs(plan, t, nr)
        k = len(plan.sample_rows)
        nl = nr  # logits rows bucketed with the requests (at most one each): one shape dimension less to compile
        su = np.zeros((5, nl), np.uint32)  # logits row, seed words, token index, prompt index
        sf = np.zeros((2, nl), np.float32)  # temperature, top_p: padding rows greedy
        sf[1] = 1.0
        su[0, :k] = plan.sample_rows
        su[3, :k] = plan.sample_token_index
        for j, r in enumerate(plan.sample_reqs):
            su[1, j], su[2, j], su[4, j] = r.params.seed >> 32, r.params.seed & 0xFFFFFFFF, r.prompt_index
            sf[0, j], sf[1, j] = r.params.temperature, r.params.top_p
        packed, layout = host_buffer.pack(row_arr, plan_rows, upd, resets, su, sf)
        self.stats.h2d_bytes += packed.nbytes
        self.stats.last_h2d_bytes = packed.nbytes
        if self._dry is not None:
            shape = (t, nr, width)
            if shape in self._dry:
                return np.zeros(self._n_out, np.int32)
            self._dry.add(shape)
        prev = self._prev_ids
        if prev is None:
            prev = jax.device_put(np.zeros(self._n_out, np.int32), NamedSharding(self.mesh, P()))
        t_launch = time.perf_counter()
        greedy = bool(np.all(sf[0, :k] < GREEDY_BELOW))  # static: no device-side branch (see sampling.sample)
        out, self.caches, self._tables = self._serve_step(self.params, self.caches, self._tables, packed, prev,
                                                          width=width, greedy=greedy, layout=layout)
        self._launch_s = time.perf_counter() - t_launch
        self._prev_ids = out
        return out


def load(path: str | os.PathLike, *, parallel: ParallelConfig | None = None, dtype="bfloat16",
         kv_cache_dtype: str = "auto", max_model_len: int | None = None, progress: bool = True,
         num_speculative_tokens: int = 0, quantization=None, device_memory: int | None = None,
         **engine_kw) -> Engine:
    """Load a checkpoint directory onto the mesh of `parallel` and return an `Engine`.

    `path` is an HF safetensors directory (bf16/fp32, or an FP8 block-scaled release) or an orbax directory
    written by `python -m glm_dsa convert` / `checkpoints.save_orbax_params` (its newest committed version; an
    interrupted save is never read). Parameters go onto the devices with their target
    sharding, whatever mesh they were saved from. Extra keyword arguments (block_size, num_pages, max_num_seqs,
    max_num_batched_tokens, impl) go to `Engine`. `num_speculative_tokens` k > 0: MTP speculative decoding, k drafts
    per step from the checkpoint's nextn layer (loaded only then; a checkpoint without one is a CheckpointError).
    `quantization`: None keeps the checkpoint's form (an FP8 release's block-scaled weights stay float8_e4m3fn on
    the devices, with their scales, and the model computes from them), "fp8" quantises a bf16/fp32 checkpoint's
    linear weights at load (128 x 128 blocks), "none" dequantises everything to `dtype` (reference runs); see
    `checkpoints.quantization`. A layout whose weights cannot fit a device (`device_memory` bytes, default the
    device's free memory where it reports it) is refused before anything is allocated.
    """
    k = _positive_int("num_speculative_tokens", num_speculative_tokens, minimum=0)
    config, parallel, flat = load_params(path, parallel=parallel, dtype=dtype, progress=progress, mtp=k > 0,
                                         quantization=quantization, device_memory=device_memory)
    params = nest_params(flat)
    mtp = params.pop("mtp", None)
    return Engine(config, params, parallel=parallel, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                  max_model_len=max_model_len, num_speculative_tokens=k, mtp_params=mtp, **engine_kw)
