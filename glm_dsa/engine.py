"""The paged-cache engine: `load` a checkpoint, then `logits` and `generate` over compiled, bucketed steps."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import checkpoints
from sharding import ParallelConfig, cache_spec, param_spec

from .config import GlmDsaConfig
from .model import StepBatch
from .paged_cache import PageAllocator, allocate_caches, block_table_array, cache_dtype, owner_slot, pages_needed
from .sampling import sample
from .step import mesh_for, nest_params, resolve_parallel, step

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


def resolve_dtype(dtype) -> jnp.dtype:
    """'bfloat16' | 'float32' | 'float16' or a jnp dtype -> jnp.dtype."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return jnp.dtype(DTYPES[dtype])
    d = jnp.dtype(dtype)
    if d not in (jnp.dtype(v) for v in DTYPES.values()):
        raise ValueError(f"dtype must be a floating dtype among {sorted(DTYPES)}, got {d}")
    return d


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
                 max_num_batched_tokens: int = 2048, impl: str = "xla"):
        self.config = config
        self.parallel = resolve_parallel(parallel, config)
        self.dtype = resolve_dtype(dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.impl = impl
        self.max_model_len = int(max_model_len or min(config.max_position_embeddings, 4096))
        if self.max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's max_position_embeddings "
                             f"({config.max_position_embeddings})")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        n, inter = self.parallel.dcp, self.parallel.interleave
        self.pages_per_seq = pages_needed(self.max_model_len, block_size, n, inter)
        self.num_pages = int(num_pages or max_num_seqs * self.pages_per_seq + 1)  # per DCP rank
        self.mesh = mesh_for(self.parallel)
        self.params = params
        cache_sharding = NamedSharding(self.mesh, cache_spec())
        self.caches = allocate_caches(config, self.num_pages * n, block_size,
                                      cache_dtype(kv_cache_dtype, self.dtype), cache_sharding)
        self.allocator = PageAllocator(self.num_pages)
        self._step = jax.jit(functools.partial(step, config=config, parallel=self.parallel, impl=impl),
                             donate_argnums=(1,))

    # ---- input checks ----------------------------------------------------------------------
    def _check_tokens(self, seqs: list[list[int]], what: str) -> None:
        v = self.config.vocab_size
        for i, s in enumerate(seqs):
            if len(s) == 0:
                raise ValueError(f"{what} {i} is empty")
            if len(s) > self.max_model_len:
                raise ValueError(f"{what} {i} has {len(s)} tokens, longer than max_model_len={self.max_model_len}")
            for j, tok in enumerate(s):
                if not 0 <= int(tok) < v:
                    raise ValueError(f"{what} {i}, position {j}: token id {int(tok)} is outside the vocabulary "
                                     f"[0, {v})")

    # ---- one compiled step -----------------------------------------------------------------
    def _run(self, rows: list[tuple[int, int, int]], seqs: list[_Seq], logits_rows: list[int]) -> np.ndarray:
        """rows: (seq index, position, token). Returns float32 logits [len(logits_rows), vocab]."""
        bs, n, inter = self.block_size, self.parallel.dcp, self.parallel.interleave
        t = _bucket(len(rows), 16)
        ids, pos, slot, req = (np.zeros(t, np.int32) for _ in range(4))
        slot[:] = -1  # padding rows write nothing
        for r, (s, p, tok) in enumerate(rows):
            ids[r], pos[r], req[r] = tok, p, s
            slot[r] = owner_slot(seqs[s].pages, p, bs, n, inter)
        width = _bucket(max(len(s.pages) for s in seqs), 1)
        tables = block_table_array([s.pages for s in seqs], width, _bucket(len(seqs), 1))
        li = np.zeros(_bucket(len(logits_rows), 8), np.int32)
        li[: len(logits_rows)] = logits_rows
        batch = StepBatch(*(jnp.asarray(a) for a in (ids, pos, slot, req, tables, li)))
        logits, self.caches = self._step(self.params, self.caches, batch)
        return logits[: len(logits_rows)]

    def _prefill(self, seqs: list[_Seq], starts: list[int], all_logits: bool):
        """Feed tokens [start, len) of every sequence in chunks; returns per-sequence logits (device arrays):
        [len - start, vocab] each if `all_logits`, else the last row [vocab]."""
        pending = [(s, p) for s, seq in enumerate(seqs) for p in range(starts[s], len(seq.tokens))]
        out: list[list] = [[] for _ in seqs]
        for c in range(0, len(pending), self.max_num_batched_tokens):
            chunk = pending[c: c + self.max_num_batched_tokens]
            rows = [(s, p, seqs[s].tokens[p]) for s, p in chunk]
            want = [r for r, (s, p) in enumerate(chunk) if all_logits or p == len(seqs[s].tokens) - 1]
            logits = self._run(rows, seqs, want)
            for k, r in enumerate(want):
                out[chunk[r][0]].append(logits[k])
        return [jnp.stack(o) if all_logits else o[-1] for o in out]

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
        rows = ids.tolist()
        self._check_tokens(rows, "row")
        out = []
        for g in range(0, len(rows), self.max_num_seqs):
            seqs = self._new_seqs(rows[g: g + self.max_num_seqs], [0] * len(rows[g: g + self.max_num_seqs]))
            try:
                out.extend(np.asarray(x) for x in self._prefill(seqs, [0] * len(seqs), all_logits=True))
            finally:
                self._release(seqs)
        return np.stack(out).astype(np.float32)

    def trace(self, token_ids, layers=None) -> dict[str, np.ndarray]:
        """Per-layer intermediates of one sequence (int [T]) by name (see glm_dsa.trace), as numpy arrays;
        `layers` (an iterable of layer indices) keeps only those layers."""
        from .trace import select_layers, trace
        ids = np.asarray(token_ids).reshape(-1)
        self._check_tokens([ids.tolist()], "sequence")
        if not hasattr(self, "_trace"):
            self._trace = jax.jit(functools.partial(trace, config=self.config, parallel=self.parallel, impl=self.impl,
                                                    block_size=self.block_size))
        taps = self._trace(self.params, jnp.asarray(ids, jnp.int32))
        return {k: np.asarray(v) for k, v in select_layers(taps, layers).items()}

    def generate(self, prompts, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 stop_token_ids=None) -> list[list[int]]:
        """Continue each prompt (a list of token ids) by up to `max_new_tokens` tokens.

        Greedy at temperature 0; otherwise temperature sampling with nucleus `top_p`, reproducible for a
        given `seed`. A sequence stops after emitting a token of `stop_token_ids` (default: the model's EOS
        ids; pass [] to never stop early), or on reaching max_model_len. Returns the new tokens per prompt.
        """
        prompts = [list(p) for p in prompts]
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        self._check_tokens(prompts, "prompt")
        stop = set(self.config.eos_token_id if stop_token_ids is None else stop_token_ids)
        results: list[list[int]] = []
        for g in range(0, len(prompts), self.max_num_seqs):
            group = prompts[g: g + self.max_num_seqs]
            results.extend(self._generate_group(group, max_new_tokens, temperature, top_p, seed, stop, g))
        return results

    def _generate_group(self, prompts, max_new, temperature, top_p, seed, stop, offset):
        seqs = self._new_seqs(prompts, [max_new] * len(prompts))
        new: list[list[int]] = [[] for _ in prompts]
        try:
            if max_new == 0:
                return new
            last = jnp.stack(self._prefill(seqs, [0] * len(seqs), all_logits=False))
            live = list(range(len(seqs)))
            key = jax.random.key(seed)
            for i in range(max_new):
                ids = np.asarray(sample(last, jax.random.fold_in(key, i), temperature, top_p,
                                        jnp.asarray([offset + s for s in live], jnp.int32)))
                for k, s in enumerate(live):
                    tok = int(ids[k])
                    seqs[s].tokens.append(tok)
                    new[s].append(tok)
                    if tok in stop or len(seqs[s].tokens) >= self.max_model_len:
                        seqs[s].done = True
                live = [s for s in live if not seqs[s].done]
                if not live or i == max_new - 1:
                    break
                rows = [(s, len(seqs[s].tokens) - 1, seqs[s].tokens[-1]) for s in live]
                last = self._run(rows, seqs, list(range(len(rows))))
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
    orbax = checkpoints.is_orbax_checkpoint(path)
    source = checkpoints.committed_checkpoint(path) if orbax else path
    config = GlmDsaConfig.from_pretrained(source)
    parallel = resolve_parallel(parallel, config)
    dt = resolve_dtype(dtype)
    mesh = mesh_for(parallel)
    flat = (checkpoints.load_orbax_params if orbax else checkpoints.load_hf_params)(
        source, config, dtype=dt, progress=progress,
        sharding_for=lambda p, shape: NamedSharding(mesh, param_spec(p, parallel.q_replicate)))
    return Engine(config, nest_params(flat), parallel=parallel, dtype=dt, kv_cache_dtype=kv_cache_dtype,
                  max_model_len=max_model_len, **engine_kw)
