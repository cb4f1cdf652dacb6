"""The device side of an `Engine`: the mesh, the parameters and the paged caches, the memory plan (how many pages
fit), and the compiled steps (the model step for `logits`, the fused step + sampler of the serving loop, the trace).

A `ModelRunner` knows nothing of requests: it takes rows and block tables (`run`) or a scheduler's `StepPlan`
(`execute`) and returns device logits or sampled ids. The request side (scheduling, streams, metrics) is
`glm_dsa.serving.engine.Engine`, which holds one.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels import default_impl, registry
from sharding import ParallelConfig, cache_spec, mesh_for
from sharding.dcp import local_position

from ..distributed import check_mesh_spans_processes
from ..model.config import GlmDsaConfig
from ..model.layers import StepBatch
from ..model.loading import resolve_dtype
from ..model.mtp import mtp_cache_bytes_per_token
from ..model.paged_cache import (allocate_caches, block_table_array, cache_bytes_per_token, cache_dtype,
                                 free_device_bytes, max_addressable_pages, owner_slots, pages_needed, plan_pages)
from ..model.options import StepOptions
from ..model.step import resolve_parallel, step
from . import host_buffer
from .prefix_cache import PrefixCachingAllocator
from .sampling import GREEDY_BELOW, MAX_LOGPROBS, sample, token_logprobs
from .scheduler import StepPlan


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    """`value` as an int >= minimum, or a TypeError / ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def check_invariant_rows(rows, batch_invariant: bool) -> tuple[int, int] | None:
    """The (prompt step rows, most decode step rows) of batch-invariant mode: `rows` checked (two integers >= 1),
    or by default (`kernels.registry.INVARIANT_PROMPT_ROWS`, `INVARIANT_STEP_ROWS`); None in the default mode (a
    `rows` given there is a ValueError). A decode step is padded to the bucket of its rows up to the second
    (`kernels.registry.decode_step_rows`)."""
    if not batch_invariant:
        if rows is not None:
            raise ValueError(f"invariant_step_rows={rows!r} is for batch_invariant=True")
        return None
    if rows is None:
        return registry.INVARIANT_PROMPT_ROWS, registry.INVARIANT_STEP_ROWS
    if not isinstance(rows, (tuple, list)) or len(rows) != 2:
        raise TypeError(f"invariant_step_rows must be (prompt rows, decode rows), got {rows!r}")
    prompt = check_positive_int("invariant_step_rows[0] (prompt rows)", rows[0])
    decode = check_positive_int("invariant_step_rows[1] (decode rows)", rows[1])
    if decode >= prompt:  # the kernels' rules tell the kinds apart by rows (kernels.registry.step_kind)
        raise ValueError(f"invariant_step_rows={tuple(rows)!r}: the decode rows must be fewer than the prompt rows")
    return prompt, decode


def step_options(impl: str, invariant_rows: tuple[int, int] | None) -> StepOptions:
    """The model step's options of a runner of `impl`: the default mode when `invariant_rows` is None, else
    batch-invariant mode of those (prompt step rows, most decode step rows) (`check_invariant_rows`)."""
    if invariant_rows is None:
        return StepOptions(impl=impl)
    return StepOptions(impl=impl, batch_invariant=True, invariant_prompt_rows=invariant_rows[0],
                       invariant_decode_rows=invariant_rows[1])


def _change_tables(tables, resets, updates):
    """The device block table with the rows `resets` marks (int32 [S + 1], 1: zero the row) zeroed, then the
    entries `updates` (int32 [3, U]: row, column, page) set; updates of rows past S are padding, dropped."""
    tables = jnp.where(resets[:, None] > 0, 0, tables)
    return tables.at[updates[0], updates[1]].set(updates[2], mode="drop")


def _change_tables_packed(tables, packed, *, layout: host_buffer.Layout):
    """`_change_tables` with its host inputs (resets, updates) in one uint32 buffer (`host_buffer.pack`): one
    transfer; `layout` (static) is the pack's."""
    resets, updates = host_buffer.unpack(packed, layout)
    return _change_tables(tables, resets, updates)


def serving_step(params, caches, tables, rows, plan_rows, table_updates, table_resets, samp_u32, samp_f32,
                 prev_ids, *, config, parallel, options, n_out: int, block_size: int, width: int, greedy: bool,
                 logprobs: bool = False, with_logits: bool = False):
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
    columns the step reads; `greedy` (static): every sampled row is greedy (argmax only); `logprobs` (static): some
    request of the step asks for logprobs, so the step also returns, per sampled row, the sampled id's logprob
    float32 [n_out] and the `sampling.MAX_LOGPROBS` best (ids int32, logprobs float32 [n_out, MAX_LOGPROBS]) from
    the same logits (`sampling.token_logprobs`): the ids come back as (ids, logprob, top ids, top logprobs). A
    step without it computes nothing more than before. `with_logits` (static): the sampled rows' float32 logits
    are returned too (a fourth output, for tests that compare them)."""
    tables = _change_tables(tables, table_resets, table_updates)
    block_tables = tables[plan_rows, :width]
    src, pos, req = rows[3], rows[1], rows[2]
    token_ids = jnp.where(src >= 0, prev_ids[jnp.maximum(src, 0)], rows[0])
    lp = local_position(jnp.maximum(pos, 0), parallel.dcp, parallel.interleave)  # the position on its DCP rank
    slot = block_tables[req, lp // block_size] * block_size + lp % block_size
    slot = jnp.where(pos < 0, -1, slot).astype(jnp.int32)  # padding rows write nothing
    # padding rows keep position -1 in the model too: they route to no expert and attend to no key (clamped to 0
    # they would be tokens at position 0, computed through every expert and attention split they pick)
    batch = StepBatch(token_ids.astype(jnp.int32), pos, slot, req, block_tables, samp_u32[0].astype(jnp.int32))
    logits, caches = step(params, caches, batch, config=config, parallel=parallel, options=options)

    def key(words, token_index, prompt_index):
        return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(words), token_index), prompt_index)
    keys = jax.vmap(key)(samp_u32[1:3].T, samp_u32[3], samp_u32[4])
    ids = sample(logits, keys, samp_f32[0], samp_f32[1], all_greedy=greedy)
    out = jnp.zeros(n_out, jnp.int32).at[: ids.shape[0]].set(ids)
    if logprobs:
        lp, top_ids, top_lp = token_logprobs(logits, ids)
        n = ids.shape[0]
        out = (out, jnp.zeros(n_out, jnp.float32).at[:n].set(lp),
               jnp.zeros((n_out, MAX_LOGPROBS), jnp.int32).at[:n].set(top_ids),
               jnp.zeros((n_out, MAX_LOGPROBS), jnp.float32).at[:n].set(top_lp))
    return (out, caches, tables, logits) if with_logits else (out, caches, tables)


def _serve_step_packed(params, caches, tables, packed, prev_ids, *, layout: host_buffer.Layout, **kw):
    """`serving_step` with its host inputs in one uint32 buffer (`host_buffer.pack` of the int32 `rows` [4, T],
    `plan_rows` [R], `table_updates` [3, T], `table_resets` [S + 1], `samp_u32` [5, L] and `samp_f32` [2, L]), so
    a step makes one host-to-device transfer instead of six; `layout` (static) is the pack's."""
    rows, plan_rows, updates, resets, samp_u32, samp_f32 = host_buffer.unpack(packed, layout)
    return serving_step(params, caches, tables, rows, plan_rows, updates, resets, samp_u32, samp_f32, prev_ids, **kw)


def _bucket(n: int, minimum: int, factor: int = 2) -> int:
    """Smallest minimum * factor**i >= n: a few static shapes, so steps compile once per bucket."""
    b = minimum
    while b < n:
        b *= factor
    return b


class ModelRunner:
    """The model on its mesh: parameters, paged caches, the page allocator and the compiled steps.

    Arguments as `Engine`'s (which passes them on): the runner checks them, resolves `parallel`, makes the mesh and
    plans the cache: `num_pages` per DCP rank given, or as many as `max_num_seqs` full sequences of
    `max_model_len` need within `cache_memory_fraction` of the free device memory (fewer sequences where fewer
    fit: `max_num_seqs` is then lowered). `num_speculative_tokens` > 0 makes room in each page for the nextn
    layer's cache rows. `params` and `caches` are plain pytrees (see `glm_dsa.step`); the compiled steps donate
    the caches, so `caches` is replaced by each step.
    """

    def __init__(self, config: GlmDsaConfig, params, *, parallel: ParallelConfig | None = None, dtype="bfloat16",
                 kv_cache_dtype: str = "auto", max_model_len: int | None = None, block_size: int = 16,
                 num_pages: int | None = None, max_num_seqs: int = 8, impl: str | None = None,
                 cache_memory_fraction: float = 0.8, num_speculative_tokens: int = 0, batch_invariant: bool = False,
                 invariant_step_rows: tuple[int, int] | None = None):
        self.config = config
        if not isinstance(batch_invariant, bool):
            raise TypeError(f"batch_invariant must be a bool, got {batch_invariant!r}")
        self.batch_invariant = batch_invariant
        #: batch-invariant mode's (prompt step rows, most decode step rows), see `step_shapes`; None in the default
        #: mode
        self.invariant_rows = check_invariant_rows(invariant_step_rows, batch_invariant)
        self.parallel = resolve_parallel(parallel, config)
        self.dtype = resolve_dtype(dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.impl = impl or default_impl()
        # batch-invariant mode: a step of the prompt rows takes the rules' prompt-step choices, a decode step (fewer
        # rows: a bucket of at most the decode rows) their decode-step ones (kernels.registry.batch_invariant), its
        # XLA products at the decode rows whatever its bucket (glm_dsa.model.linear.at_decode_rows)
        self.options = step_options(self.impl, self.invariant_rows)
        self.max_model_len = (min(config.max_position_embeddings, 4096) if max_model_len is None
                              else check_positive_int("max_model_len", max_model_len))
        if self.max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's max_position_embeddings "
                             f"({config.max_position_embeddings})")
        if check_positive_int("block_size", block_size) & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.block_size = int(block_size)
        self.max_num_seqs = max_num_seqs = check_positive_int("max_num_seqs", max_num_seqs)
        if isinstance(cache_memory_fraction, bool) or not 0 < cache_memory_fraction <= 1:
            raise ValueError(f"cache_memory_fraction must be in (0, 1], got {cache_memory_fraction!r}")
        n, inter = self.parallel.dcp, self.parallel.interleave
        self.pages_per_seq = pages_needed(self.max_model_len, block_size, n, inter)
        self.mesh = mesh_for(self.parallel)
        check_mesh_spans_processes(self.mesh)
        # FP8 caches over 2 GiB per layer are misaddressed by the Triton kernels (32-bit offsets)
        int32 = registry.decide("cache_offsets", impl=self.impl) == "int32"
        max_pages = max_addressable_pages(config, block_size, kv_cache_dtype) if int32 else None
        if num_pages is not None:
            # per DCP rank; page 0 is the padding page, so one sequence needs pages_per_seq + 1
            self.num_pages = check_positive_int("num_pages", num_pages, minimum=2)
            if max_pages is not None and self.num_pages > max_pages:
                raise ValueError(f"num_pages={self.num_pages}: an FP8 cache of at most {max_pages} pages per layer "
                                 f"(block_size {block_size}) stays under the 2 GiB the Triton kernels address")
        else:  # enough for max_num_seqs full sequences, within cache_memory_fraction of the free device memory
            page_bytes = block_size * cache_bytes_per_token(config, self.dtype, kv_cache_dtype)
            if num_speculative_tokens:  # the nextn layer's cache rows share the pages
                page_bytes += block_size * mtp_cache_bytes_per_token(config, self.dtype, kv_cache_dtype)
            self.num_pages, self.max_num_seqs = plan_pages(
                max_num_seqs=max_num_seqs, pages_per_seq=self.pages_per_seq, page_bytes=page_bytes,
                free_bytes=free_device_bytes(self.mesh.local_devices[0]), memory_fraction=cache_memory_fraction,
                max_pages=max_pages)
        self.params = params
        cache_sharding = NamedSharding(self.mesh, cache_spec())
        self.caches = allocate_caches(config, self.num_pages * n, block_size,
                                      cache_dtype(kv_cache_dtype, self.dtype), cache_sharding, kv_cache_dtype)
        # reference-counted pages with the prefix cache's index (used only when the scheduler caches prefixes)
        self.allocator = PrefixCachingAllocator(self.num_pages)
        # the model step alone, for `run` (logits of every asked row; no sampling)
        self.model_step = jax.jit(functools.partial(step, config=config, parallel=self.parallel, options=self.options),
                                  donate_argnums=(1,))
        self.n_out = _bucket(self.max_num_seqs, 8)  # a serving step samples at most one row per running request
        # the block table of the running requests (scheduler table rows 0..max_num_seqs-1; the last row stays
        # page 0 for padding), on the device: steps send only its changes (see `serving_step`)
        self.replicated = NamedSharding(self.mesh, P())
        self.tables = jax.device_put(np.zeros((self.max_num_seqs + 1, self.pages_per_seq), np.int32),
                                     self.replicated)
        # outputs placed exactly as the inputs they replace: a step fed the caches (or ids) of the previous one
        # hits the compiled step the first call made, instead of compiling again for an equal-but-new sharding
        out_shardings = (self.replicated, jax.tree.map(lambda c: c.sharding, self.caches), self.replicated)
        # block-table changes a step's updates array cannot hold (see `table_inputs`): written before the step, in
        # chunks of one fixed shape, compiled here (a no-op write of padding) so a serving loop never compiles it
        self.table_chunk = self.pages_per_seq  # an admitted request's cached pages fit one chunk
        self._change_tables = jax.jit(_change_tables_packed, static_argnames=("layout",), donate_argnums=(0,),
                                      out_shardings=self.replicated)
        self.write_tables(np.zeros(self.max_num_seqs + 1, np.int32), np.zeros((3, 0), np.int32))
        # the serving loop's step: block-table changes, the model step and the sampler in one executable
        self.serve_step = jax.jit(functools.partial(_serve_step_packed, config=config, parallel=self.parallel,
                                                    options=self.options, n_out=self.n_out, block_size=self.block_size),
                                  static_argnames=("width", "greedy", "layout", "logprobs"), donate_argnums=(1, 2),
                                  out_shardings=out_shardings)
        # tests: with keep_logits set, each executed serving step keeps its sampled rows' float32 logits
        # [rows >= len(plan.sample_rows), vocab] (device) in last_logits, from a second compiled step
        self.keep_logits = False
        self.last_logits = None
        self._serve_step_logits = None
        self.prev_ids = None  # device ids sampled by the last executed serving step
        self.launch_s = 0.0  # seconds the last `execute`'s jitted call took (transfers, dispatch)
        self.last_h2d_bytes = 0  # bytes of the host buffer the last `execute` built
        self._trace = None

    def _logits_step(self):
        """The serving step that also returns its sampled rows' logits (compiled on first use; see keep_logits)."""
        if self._serve_step_logits is None:
            shardings = (self.replicated, jax.tree.map(lambda c: c.sharding, self.caches), self.replicated,
                         self.replicated)
            self._serve_step_logits = jax.jit(
                functools.partial(_serve_step_packed, config=self.config, parallel=self.parallel,
                                  options=self.options, n_out=self.n_out, block_size=self.block_size,
                                  with_logits=True),
                static_argnames=("width", "greedy", "layout", "logprobs"), donate_argnums=(1, 2),
                out_shardings=shardings)
        return self._serve_step_logits

    def run(self, seq_idx: np.ndarray, pos: np.ndarray, tok: np.ndarray, pages: list[list[int]],
            logits_rows: np.ndarray) -> jax.Array:
        """One compiled model step over rows (sequence index, position, token id), all int arrays, of sequences
        holding `pages` (one page list per sequence); returns the device float32 logits
        [bucket >= len(logits_rows), vocab] of `logits_rows` (padding rows after them)."""
        bs, n, inter = self.block_size, self.parallel.dcp, self.parallel.interleave
        t = _bucket(len(pos), 8)
        # capped at a full sequence's pages: a power-of-two bucket past it would double the indexer's top-k width
        width = min(_bucket(max(len(p) for p in pages), 1), self.pages_per_seq)
        if self.batch_invariant:  # one width whatever the sequences' lengths: the indexer reads as many keys
            width = self.pages_per_seq
        tables = block_table_array(pages, width, _bucket(len(pages), 1))
        ids, p, slot, req = (np.zeros(t, np.int32) for _ in range(4))
        p[:], slot[:] = -1, -1  # padding rows: no position (no expert, no key), and they write nothing
        ids[: len(pos)], p[: len(pos)], req[: len(pos)] = tok, pos, seq_idx
        slot[: len(pos)] = owner_slots(tables, seq_idx, pos, bs, n, inter)
        li = np.zeros(_bucket(len(logits_rows), 8), np.int32)
        li[: len(logits_rows)] = logits_rows
        batch = StepBatch(*(jnp.asarray(x) for x in (ids, p, slot, req, tables, li)))
        logits, self.caches = self.model_step(self.params, self.caches, batch)
        return logits

    def trace(self, ids: np.ndarray, layers=None) -> dict[str, np.ndarray]:
        """Per-layer intermediates of one checked sequence (int32 [T]) by name (see `glm_dsa.debug.trace`), as
        numpy arrays; `layers` (an iterable of layer indices) keeps only those layers."""
        from ..debug.trace import select_layers, trace
        if self._trace is None:
            self._trace = jax.jit(functools.partial(trace, config=self.config, parallel=self.parallel, impl=self.impl,
                                                    block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype))
        taps = self._trace(self.params, jnp.asarray(ids, jnp.int32))
        return {k: np.asarray(v) for k, v in select_layers(taps, layers).items()}

    def width_for(self, pages: int) -> int:
        """The block-table columns a step reads when its longest request holds `pages` pages: a power-of-two bucket
        from 8, capped at a full sequence's pages (a bucket past it would double the indexer's top-k width); a
        bucket over half of it takes the cap at once (at most twice the pages, as any bucket): one shape less."""
        width = _bucket(pages, 8)
        return self.pages_per_seq if 2 * width > self.pages_per_seq else width

    def serving_shapes(self, max_rows: int, widths=None) -> list[tuple[int, int, int]]:
        """Every static shape (rows T, block-table columns, requests R) of `step_shapes` that a serving step of at
        most `max_rows` rows can take (a scheduler's steps hold at most its max_num_batched_tokens), at the
        block-table `widths` given (values of `width_for`; default: all of them). Default mode: each rows bucket
        with each requests bucket up to the most requests its rows and max_num_seqs allow; batch-invariant mode:
        the prompt rows and every decode bucket a decode step of at most `max_rows` rows pads to (the scheduler's
        decode steps hold a row per running request, or a preempted request's recompute; `decode_step_rows`), at
        the fixed width and requests."""
        if self.batch_invariant:
            prompt, decode = self.invariant_rows
            top = registry.decode_step_rows(min(max_rows, decode), decode)
            rows = [b for b in registry.decode_buckets(decode) if b <= top] + [prompt]
            return [(t, self.pages_per_seq, self.n_out) for t in rows]
        if widths is None:
            widths = {self.width_for(p) for p in range(1, self.pages_per_seq + 1)}
        shapes = []
        for t in sorted({_bucket(n, 16) for n in range(1, max_rows + 1)}):  # step_shapes' buckets, as it takes them
            requests = {min(_bucket(r, 8, 4), self.n_out) for r in range(1, min(t, self.max_num_seqs) + 1)}
            shapes.extend((t, w, nr) for nr in sorted(requests) for w in sorted(set(widths)))
        return shapes

    def compile_step(self, t: int, width: int, nr: int, greedy: bool = True, logprobs: bool = False) -> None:
        """Compile (and run) the serving step of static shape (rows `t`, block-table columns `width`, requests
        `nr`: see `step_shapes`) with every row padding: position -1 writes nothing and routes nowhere, the table
        changes are padding and the sampled ids are dropped, so the caches, the block table and `prev_ids` are
        left as they were. Its host inputs are laid out as `execute`'s, so a later step of that shape runs this
        executable."""
        rows, su, sf = self._padding_rows(t, nr)
        packed, layout = host_buffer.pack(rows, *self._padding_tables(t, nr), su, sf)
        self._launch(packed, layout, width=width, greedy=greedy, logprobs=logprobs)

    def _padding_rows(self, t: int, nr: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`serving_step`'s row and sampling host arrays (rows, samp_u32, samp_f32) of a step of `t` rows and `nr`
        requests, all padding: rows at position -1 (write nothing, route nowhere) with src -1 and request 0,
        greedy sampling rows. `execute` fills a plan's part in."""
        rows = np.zeros((4, t), np.int32)
        rows[1], rows[3] = -1, -1
        su = np.zeros((5, nr), np.uint32)  # logits row, seed words, token index, prompt index
        sf = np.zeros((2, nr), np.float32)  # temperature, top_p
        sf[1] = 1.0
        return rows, su, sf

    def _padding_tables(self, t: int, nr: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`serving_step`'s block-table host arrays (plan_rows, table_updates, table_resets) of a step of `t` rows
        and `nr` requests, all padding: requests reading the all-zero last table row, table updates outside the
        table, no resets. `table_inputs` fills a plan's part in."""
        plan_rows = np.full(nr, self.max_num_seqs, np.int32)
        upd = np.full((3, t), self.max_num_seqs + 1, np.int32)
        resets = np.zeros(self.max_num_seqs + 1, np.int32)
        return plan_rows, upd, resets

    def step_function(self):
        """The jitted serving step `execute` runs: the one that also returns logits while keep_logits is set."""
        return self._logits_step() if self.keep_logits else self.serve_step

    def step_shapes_compiled(self) -> int:
        """How many shapes of `step_function` are compiled (its jit cache's entries)."""
        return self.step_function()._cache_size()

    def _launch(self, packed, layout, *, width: int, greedy: bool, logprobs: bool):
        """Run `step_function` on packed host inputs after the previous step's ids; returns its ids output (the
        caches, the table and, with keep_logits, last_logits updated)."""
        prev = self.prev_ids
        if prev is None:
            prev = jax.device_put(np.zeros(self.n_out, np.int32), self.replicated)
        out = self.step_function()(self.params, self.caches, self.tables, packed, prev, width=width, greedy=greedy,
                                   layout=layout, logprobs=logprobs)
        if self.keep_logits:
            out, self.caches, self.tables, self.last_logits = out
        else:
            out, self.caches, self.tables = out
        return out

    def step_shapes(self, plan: StepPlan) -> tuple[int, int, int]:
        """The bucketed static shapes of a plan's step: (rows T, block-table columns read, requests R)."""
        t = _bucket(plan.num_rows, 16)
        width = self.width_for(max(len(r.pages) for r in plan.requests))
        # requests (and logits rows, at most one each) in buckets growing 4x, capped at max_num_seqs' bucket
        nr = min(_bucket(len(plan.requests), 8, 4), self.n_out)
        if self.batch_invariant:
            # the block-table width sets how many keys the indexer scores and selects from, so it must not follow
            # the longest neighbour; the width and requests are fixed for both kinds. A prompt step (prompt tokens
            # only) has the prompt rows; a decode step (no prompt token) the power-of-two bucket of its rows, from 8
            # up to the decode rows (kernels.registry.decode_step_rows): its kernels' choices and launch configs are
            # the decode kind's at every bucket, and its XLA products run at the decode rows (kernels.registry doc).
            # Each token is computed in a step of its kind (scheduler docstring)
            width, nr = self.pages_per_seq, self.n_out
            if 0 < plan.prompt_rows < plan.num_rows:
                raise RuntimeError(f"a batch-invariant step of {plan.prompt_rows} prompt tokens and "
                                   f"{plan.num_rows - plan.prompt_rows} others: the kinds never share a step (the "
                                   "scheduler should keep them apart)")
            most = self.invariant_rows[0 if plan.prompt_rows else 1]
            if plan.num_rows > most:
                raise RuntimeError(f"a batch-invariant {'prompt' if plan.prompt_rows else 'decode'} step of "
                                   f"{plan.num_rows} rows, over its {most} (the scheduler's budget should cap it)")
            t = most if plan.prompt_rows else registry.decode_step_rows(plan.num_rows, most)
        return t, width, nr

    def table_inputs(self, plan: StepPlan, t: int, nr: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The block-table inputs of a plan's step (see `serving_step`): the requests' table rows int32 [nr], the
        entries it changes int32 [3, t] and the rows it clears int32 [max_num_seqs + 1].

        A step adds at most one page per row it computes, except that a request admitted on cached prefix pages
        gains them all in the step of its first rows: the plan may change more than t entries. Then the resets and
        all but the last t entries are written to the device table here, before the step (`write_tables`), and
        the step gets the last t and no resets: the table it reads is the same (resets first, then the entries in
        order), and its input shapes do not depend on how many cached pages its admissions bring."""
        plan_rows, upd, resets = self._padding_tables(t, nr)  # padding requests read the all-zero last row
        plan_rows[: len(plan.requests)] = [r.table_row for r in plan.requests]
        resets[plan.table_resets] = 1
        updates = plan.table_updates
        if updates.shape[1] > t:
            self.write_tables(resets, updates[:, :-t])
            updates = updates[:, -t:]
            resets = np.zeros_like(resets)  # applied: a second reset would clear the entries just written
        upd[:, : updates.shape[1]] = updates  # the rest: padding updates, outside the table
        return plan_rows, upd, resets

    def write_tables(self, resets: np.ndarray, updates: np.ndarray) -> None:
        """Zero the device table rows `resets` marks (int32 [max_num_seqs + 1]), then set the entries `updates`
        (int [3, U], any U): in chunks of `table_chunk` entries padded with entries outside the table, so every
        call runs the one executable compiled at construction. Launched without waiting (it precedes the step
        that reads the table on the same device stream)."""
        c = self.table_chunk
        for start in range(0, max(updates.shape[1], 1), c):
            chunk = np.full((3, c), self.max_num_seqs + 1, np.int32)
            part = updates[:, start: start + c]
            chunk[:, : part.shape[1]] = part
            packed, layout = host_buffer.pack(resets if start == 0 else np.zeros_like(resets), chunk)
            self.tables = self._change_tables(self.tables, packed, layout=layout)

    def execute(self, plan: StepPlan, dry: set | None = None):
        """Build a scheduler plan's step inputs on the host and launch the fused serving step; returns the device
        ids (without waiting for them). What is built does not depend on the requests' lengths: rows, logits
        rows and block-table changes only. When a sampled request asks for logprobs the result is the tuple (ids,
        logprob, top ids, top logprobs) of device arrays (see `serving_step`). `dry` (warmup): the static shapes
        already compiled; a step of one of them is not launched (zeros stand for its ids), a new one is run and
        added. Sets `last_h2d_bytes` and `launch_s`."""
        self.launch_s = 0.0
        rows = plan.num_rows
        t, width, nr = self.step_shapes(plan)
        # logits rows bucketed with the requests (at most one each): one shape dimension less to compile
        row_arr, su, sf = self._padding_rows(t, nr)
        row_arr[0, :rows], row_arr[1, :rows], row_arr[2, :rows], row_arr[3, :rows] = (plan.token, plan.pos, plan.req,
                                                                                       plan.src)
        plan_rows, upd, resets = self.table_inputs(plan, t, nr)
        k = len(plan.sample_rows)
        su[0, :k] = plan.sample_rows
        su[3, :k] = plan.sample_token_index
        for j, r in enumerate(plan.sample_reqs):
            su[1, j], su[2, j], su[4, j] = r.params.seed >> 32, r.params.seed & 0xFFFFFFFF, r.prompt_index
            sf[0, j], sf[1, j] = r.params.temperature, r.params.top_p
        packed, layout = host_buffer.pack(row_arr, plan_rows, upd, resets, su, sf)
        self.last_h2d_bytes = packed.nbytes
        want_lp = any(r.params.logprobs is not None for r in plan.sample_reqs)
        if dry is not None:
            shape = (t, nr, width)
            if shape in dry:
                ids = np.zeros(self.n_out, np.int32)
                if want_lp:
                    return (ids, np.zeros(self.n_out, np.float32), np.zeros((self.n_out, MAX_LOGPROBS), np.int32),
                            np.zeros((self.n_out, MAX_LOGPROBS), np.float32))
                return ids
            dry.add(shape)
        t_launch = time.perf_counter()
        greedy = bool(np.all(sf[0, :k] < GREEDY_BELOW))  # static: no device-side branch (see sampling.sample)
        out = self._launch(packed, layout, width=width, greedy=greedy, logprobs=want_lp)
        self.launch_s = time.perf_counter() - t_launch
        self.prev_ids = out[0] if want_lp else out
        return out
