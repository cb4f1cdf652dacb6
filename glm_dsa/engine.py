"""The paged-cache engine: `load` a checkpoint, then `logits` and `generate` over compiled, bucketed steps."""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kernels import default_impl
from sharding import ParallelConfig, cache_spec, mesh_for

from .config import GlmDsaConfig
from .model import StepBatch
from .params import load_params, resolve_dtype
from .paged_cache import (PageAllocator, allocate_caches, block_table_array, cache_bytes_per_token, cache_dtype,
                          free_device_bytes, max_addressable_pages, owner_slots, pages_needed, plan_pages)
from .sampling import SamplingParams, check_token_ids, sample
from .pytree import nest_params
from .step import resolve_parallel, step


def _positive_int(name: str, value, minimum: int = 1) -> int:
    """`value` as an int >= minimum, or a TypeError / ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


@jax.jit
def _row_keys(seed_words, steps, rows):
    """PRNG key of each sampled row: the request's seed (two uint32 words), then the step, then the row id
    (so a row's draw depends on neither the other rows nor the batch it shares a step with)."""
    def one(w, s, r):
        return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(w), s), r)
    return jax.vmap(one)(seed_words, steps, rows)


def _bucket(n: int, minimum: int) -> int:
    """Smallest power of two >= max(n, minimum): a few static shapes, so steps compile once per bucket."""
    b = minimum
    while b < n:
        b *= 2
    return b


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
                 cache_memory_fraction: float = 0.8):
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
        n, inter = self.parallel.dcp, self.parallel.interleave
        self.pages_per_seq = pages_needed(self.max_model_len, block_size, n, inter)
        self.mesh = mesh_for(self.parallel)
        # FP8 caches over 2 GiB per layer are misaddressed by the Triton kernels (32-bit offsets)
        max_pages = max_addressable_pages(config, block_size, kv_cache_dtype) if self.impl == "triton" else None
        if num_pages is not None:
            # per DCP rank; page 0 is the padding page, so one sequence needs pages_per_seq + 1
            self.num_pages = _positive_int("num_pages", num_pages, minimum=2)
            if max_pages is not None and self.num_pages > max_pages:
                raise ValueError(f"num_pages={self.num_pages}: an FP8 cache of at most {max_pages} pages per layer "
                                 f"(block_size {block_size}) stays under the 2 GiB the Triton kernels address")
        else:  # enough for max_num_seqs full sequences, within cache_memory_fraction of the free device memory
            page_bytes = block_size * cache_bytes_per_token(config, self.dtype, kv_cache_dtype)
            self.num_pages, self.max_num_seqs = plan_pages(
                max_num_seqs=max_num_seqs, pages_per_seq=self.pages_per_seq, page_bytes=page_bytes,
                free_bytes=free_device_bytes(self.mesh.devices.flat[0]), memory_fraction=cache_memory_fraction,
                max_pages=max_pages)
        self.params = params
        cache_sharding = NamedSharding(self.mesh, cache_spec())
        self.caches = allocate_caches(config, self.num_pages * n, block_size,
                                      cache_dtype(kv_cache_dtype, self.dtype), cache_sharding, kv_cache_dtype)
        self.allocator = PageAllocator(self.num_pages)
        self.last_timings: dict = {}  # of the last generate (see there)
        self._step = jax.jit(functools.partial(step, config=config, parallel=self.parallel, impl=self.impl),
                             donate_argnums=(1,))

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
        """Compile what a `generate` of `batch` prompts of `prompt_len` tokens will use (each distinct prefill
        chunk shape and the decode shape, with sampling), one step per shape on scratch pages: the whole
        prefill is not run."""
        batch = min(batch, self.max_num_seqs)
        seqs = self._new_seqs([[0] * prompt_len] * batch, [max_new_tokens] * batch)

        params = SamplingParams(temperature=temperature, top_p=top_p)

        def compile_sample(logits):
            jax.block_until_ready(self._sample(logits, np.zeros(logits.shape[0], np.int64), 0, params))
        try:
            total, step = batch * prompt_len, self.max_num_batched_tokens
            seq_idx = np.repeat(np.arange(batch), prompt_len)
            pos = np.tile(np.arange(prompt_len), batch)
            shapes = {}
            for c in range(0, total, step):  # (rows, logits rows) of each chunk, as _prefill will make them
                size = min(step, total - c)
                n_last = int(np.sum(pos[c: c + size] == prompt_len - 1))
                shapes.setdefault((_bucket(size, 16), _bucket(n_last, 8)), (size, n_last))
            for size, n_last in shapes.values():
                logits = self._run(seq_idx[:size], pos[:size], np.zeros(size, np.int64), seqs, np.arange(n_last))
                compile_sample(logits)
            if max_new_tokens > 1:
                for s in seqs:
                    s.tokens.append(0)
                live = np.arange(batch)
                compile_sample(self._run(live, np.full(batch, prompt_len), np.zeros(batch, np.int64), seqs, live))
        finally:
            self._release(seqs)

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
        `top_p`, reproducible for a given `seed` (any integer in [0, 2**64)). Arguments are checked first:
        TypeError / ValueError naming the argument (token ids must be integers in the vocabulary). A sequence
        stops after emitting a token of `stop_token_ids` (default: the model's EOS ids; pass [] to never stop
        early), or on reaching max_model_len. Returns the new tokens per prompt.
        Afterwards `self.last_timings` holds host-clock seconds of this call: "prefill_s" (to the first token
        of every prompt), "decode_s" and "decode_steps" (summed over groups of max_num_seqs prompts).
        """
        _positive_int("max_new_tokens", max_new_tokens, minimum=0)  # named as the caller named it
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_new_tokens,
                                stop_token_ids=stop_token_ids)
        prompts = self._check_tokens(prompts, "prompt")
        stop = set(self.config.eos_token_id if params.stop_token_ids is None else params.stop_token_ids)
        results: list[list[int]] = []
        self.last_timings = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
        for g in range(0, len(prompts), self.max_num_seqs):
            group = prompts[g: g + self.max_num_seqs]
            results.extend(self._generate_group(group, params, stop, g))
        return results

    def _sample(self, logits, rows: np.ndarray, step: int, params: SamplingParams) -> jax.Array:
        """Device ids [logits rows] sampled for request rows `rows` (padding rows after them) at `step`."""
        n = logits.shape[0]
        row_ids = np.zeros(n, np.uint32)
        row_ids[: len(rows)] = rows
        words = np.tile(np.asarray([params.seed >> 32, params.seed & 0xFFFFFFFF], np.uint32), (n, 1))
        keys = _row_keys(words, np.full(n, step, np.uint32), row_ids)
        return sample(logits, keys, np.full(n, params.temperature, np.float32), np.full(n, params.top_p, np.float32))

    def _generate_group(self, prompts, params: SamplingParams, stop, offset):
        max_new = params.max_tokens
        seqs = self._new_seqs(prompts, [max_new] * len(prompts))
        new: list[list[int]] = [[] for _ in prompts]

        def take(logits, seq_idx, step):
            """Sample the rows' next tokens on the device; only the ids come back to the host."""
            ids = np.asarray(self._sample(logits, offset + np.asarray(seq_idx), step, params))
            for k, s in enumerate(seq_idx):
                tok = int(ids[k])
                seqs[s].tokens.append(tok)
                new[s].append(tok)
                if tok in stop or len(seqs[s].tokens) >= self.max_model_len or len(new[s]) >= max_new:
                    seqs[s].done = True

        try:
            if max_new == 0:
                return new
            t0 = time.perf_counter()
            self._prefill(seqs, lambda logits, seq_idx, pos: take(logits, seq_idx, 0))  # take() waits for the ids
            t1 = time.perf_counter()
            steps = 0
            for i in range(1, max_new):
                live = np.asarray([s for s in range(len(seqs)) if not seqs[s].done], np.int64)
                if not len(live):
                    break
                pos = np.asarray([len(seqs[s].tokens) - 1 for s in live])
                tok = np.asarray([seqs[s].tokens[-1] for s in live])
                take(self._run(live, pos, tok, seqs, np.arange(len(live))), live, i)
                steps += 1
            timings = self.last_timings
            timings["prefill_s"] += t1 - t0
            timings["decode_s"] += time.perf_counter() - t1
            timings["decode_steps"] += steps
        finally:
            self._release(seqs)
        return new


def load(path: str | os.PathLike, *, parallel: ParallelConfig | None = None, dtype="bfloat16",
         kv_cache_dtype: str = "auto", max_model_len: int | None = None, progress: bool = True, **engine_kw) -> Engine:
    """Load a checkpoint directory onto the mesh of `parallel` and return an `Engine`.

    `path` is an HF safetensors directory (bf16/fp32, or an FP8 block-scaled release, dequantised on the device)
    or an orbax directory written by `python -m glm_dsa convert` / `checkpoints.save_orbax_params` (its newest
    committed version; an interrupted save is never read). Parameters go onto the devices with their target
    sharding, whatever mesh they were saved from. Extra keyword arguments (block_size, num_pages, max_num_seqs,
    max_num_batched_tokens, impl) go to `Engine`.
    """
    config, parallel, flat = load_params(path, parallel=parallel, dtype=dtype, progress=progress)
    return Engine(config, nest_params(flat), parallel=parallel, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                  max_model_len=max_model_len, **engine_kw)
