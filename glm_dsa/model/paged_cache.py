"""Paged KV caches (docs/math.md §3): a pool of pages of `block_size` tokens; slot = page * block_size + offset."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import GlmDsaConfig

from kernels import fp8_formats

KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8_ds_mla")


def pages_needed(length: int, block_size: int, n: int = 1, interleave: int = 1) -> int:
    """Pages per rank for a sequence of `length` tokens (rank 0 holds the most under DCP)."""
    from sharding.dcp import local_length
    return -(-int(local_length(length, 0, n, interleave)) // block_size)


def owner_slots(tables, req, positions, block_size: int, n: int = 1, interleave: int = 1):
    """Host-side slot mapping: the slot of each row's position on its owning DCP rank (numpy int32), given the
    per-rank page table [R, pages] shared by the ranks, each row's request and position."""
    from sharding.dcp import local_position
    lp = local_position(np.asarray(positions), n, interleave)
    return (np.asarray(tables)[np.asarray(req), lp // block_size] * block_size + lp % block_size).astype(np.int32)


def positions_to_slots(positions, token_req, block_tables, block_size: int):
    """Physical slots of `positions` [T, K] of each row's request (-1 stays -1)."""
    page = block_tables[token_req[:, None], jnp.maximum(positions, 0) // block_size]
    return jnp.where(positions < 0, -1, page * block_size + positions % block_size).astype(jnp.int32)


def cache_dtype(kv_cache_dtype: str, dtype) -> jnp.dtype:
    """The storage dtype of the MLA and indexer caches for `kv_cache_dtype` and compute `dtype`."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(dtype)
    if kv_cache_dtype in ("bfloat16", "float32"):
        return jnp.dtype(kv_cache_dtype)
    if kv_cache_dtype == "fp8_ds_mla":
        return jnp.dtype(jnp.uint8)  # byte rows: see kernels.common.fp8_formats
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def row_widths(cfg: GlmDsaConfig, kv_cache_dtype: str = "auto") -> tuple[int, int]:
    """(MLA row, indexer row) widths in elements of the cache dtype: 576 / 128 values, or 656 / 132 bytes."""
    if kv_cache_dtype == "fp8_ds_mla":
        return (fp8_formats.mla_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim),
                fp8_formats.index_row_bytes(cfg.index_head_dim))
    return cfg.mla_row_dim, cfg.index_head_dim


def cache_shapes(cfg: GlmDsaConfig, num_pages: int, block_size: int, kv_cache_dtype: str = "auto") -> dict:
    """Global shapes: one MLA cache per layer, one indexer key cache per full layer."""
    mla_w, idx_w = row_widths(cfg, kv_cache_dtype)
    mla = tuple((num_pages, block_size, mla_w) for _ in range(cfg.num_hidden_layers))
    index = tuple((num_pages, block_size, idx_w) for _ in cfg.full_layers)
    return {"mla": mla, "indexer": index}


def allocate_caches(cfg: GlmDsaConfig, num_pages: int, block_size: int, dtype, sharding=None,
                    kv_cache_dtype: str = "auto"):
    """Zeroed caches (created on the devices of `sharding` directly, never on the host)."""
    shapes = cache_shapes(cfg, num_pages, block_size, kv_cache_dtype)
    make = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s, dtype), shapes,
                                        is_leaf=lambda s: isinstance(s, tuple) and bool(s) and isinstance(s[0], int)),
                   out_shardings=sharding)
    return make()


def cache_bytes_per_token(cfg: GlmDsaConfig, dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of cache one token occupies across all layers."""
    item = cache_dtype(kv_cache_dtype, dtype).itemsize
    mla_w, idx_w = row_widths(cfg, kv_cache_dtype)
    return item * (cfg.num_hidden_layers * mla_w + len(cfg.full_layers) * idx_w)


def max_addressable_pages(cfg: GlmDsaConfig, block_size: int, kv_cache_dtype: str = "auto") -> int | None:
    """The most pages per device whose per-layer uint8 (FP8) caches stay under 2**31 bytes, the limit of the
    Pallas Triton kernels' 32-bit offsets (`kernels.common.triton_common.check_addressable`); None for caches of
    wider types, which have no such limit."""
    if kv_cache_dtype != "fp8_ds_mla":
        return None
    return (2**31 - 1) // (block_size * max(row_widths(cfg, kv_cache_dtype)))


def free_device_bytes(device) -> int | None:
    """Bytes the allocator of `device` can still hand out, or None where the backend does not say (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def plan_pages(*, max_num_seqs: int, pages_per_seq: int, page_bytes: int, free_bytes: int | None,
               memory_fraction: float, max_pages: int | None = None) -> tuple[int, int]:
    """(pages per DCP rank, sequences that fit): enough for `max_num_seqs` sequences of max_model_len, capped by
    `memory_fraction` of the free device memory when it is known (the rest is left for weights' temporaries
    and activations) and by `max_pages` (see `max_addressable_pages`). Raises if not even one sequence fits."""
    want = max_num_seqs * pages_per_seq + 1  # + the padding page
    if max_pages is not None:
        if max_pages < pages_per_seq + 1:
            raise ValueError(f"KV cache: one sequence of max_model_len needs {pages_per_seq + 1} pages per layer, more "
                             f"than the {max_pages} an FP8 cache of under 2 GiB per layer holds (the kernels' 32-bit "
                             "offsets); lower max_model_len")
        if want > max_pages:
            want = max_pages
            max_num_seqs = (max_pages - 1) // pages_per_seq
    if free_bytes is None:
        return want, max_num_seqs
    fit = int(free_bytes * memory_fraction) // page_bytes
    if fit < pages_per_seq + 1:
        raise ValueError("KV cache: one sequence of max_model_len needs "
                         f"{(pages_per_seq + 1) * page_bytes / 2**30:.2f} GiB per device, but {memory_fraction:.0%} "
                         f"of the free {free_bytes / 2**30:.2f} GiB is "
                         f"{fit * page_bytes / 2**30:.2f} GiB; lower max_model_len or use kv_cache_dtype='fp8_ds_mla'")
    pages = min(want, fit)
    return pages, min(max_num_seqs, (pages - 1) // pages_per_seq)


class PageAllocator:
    """Host-side free list of cache pages. Page 0 is never handed out: padding rows point at it."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"need at least 2 cache pages, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV cache pages: need {n}, {len(self._free)} free of {self.num_pages}")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages) -> None:
        self._free.extend(reversed(list(pages)))


def block_table_array(tables: list[list[int]], width: int, rows: int) -> np.ndarray:
    """Pad per-request page lists into an int32 [rows, width] table (unused entries -> page 0)."""
    out = np.zeros((rows, width), np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out
