"""Launch configs of the indexer's kernels (`kernels.indexer.triton`, `kernels.indexer.mosaic`, the select top-k
`kernels.indexer.topk_triton`), the row counts the op's rules read, and their defaults per shape: no Pallas import,
so the op's rules and every kernel read them without importing a kernel module."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

# rows from which the one-pass select top-k beats lax.top_k on the GPU (one program per row leaves the GPU idle
# below that); rows that split into the two-pass select's chunks take it from one row (BENCHMARKS.md, top-k)
SELECT_MIN_ROWS = 4
ROW_BLOCK_MIN_T = 64  # rows from which indexer_scores_triton takes the row-block form
ROW_BLOCK = 16  # its query rows per program: block_t unrolled [H, Di] x [Di, block_s] dots


@dataclasses.dataclass(frozen=True)
class TopkConfig:
    """Launch config of the select kernel. `num_warps` None: S_pad / 1024 clamped to [1, 32] (32 keys a thread),
    in one pass and in each pass of a chunked select (8 warps over 32K keys in 4 chunks measured faster than 32
    warps at B = 1-128); `sort`: the output order, "xla" (score desc, position asc, as `lax.top_k`, by one
    `lax.sort` of the [T, k] selection after the kernel), "kernel" (the same order by a bitonic network in the same
    program: a long Triton compile per shape) or "none" (position order: the same set, the same scores); `chunks`
    C: the two-pass select (`kernels.indexer.topk_triton._chunked_select`) where a row splits into C chunks of at
    least k scores, one pass elsewhere (C = 1: always one pass). The default 4 was the fastest at 32 rows of 32K
    scores, k = 2048 (2 and 8 chunks slower; BENCHMARKS.md, top-k)."""
    num_warps: int | None = None
    sort: str = "xla"
    chunks: int = 4

    def __post_init__(self):
        warps = self.num_warps
        if warps is not None and not (isinstance(warps, int) and 1 <= warps <= 32 and warps & (warps - 1) == 0):
            raise ValueError(f"TopkConfig: num_warps {self.num_warps!r} must be a power of two <= 32 (or None)")
        if self.sort not in ("kernel", "xla", "none"):
            raise ValueError(f"TopkConfig: sort {self.sort!r} must be 'kernel', 'xla' or 'none'")
        if not (isinstance(self.chunks, int) and not isinstance(self.chunks, bool) and self.chunks >= 1):
            raise ValueError(f"TopkConfig: chunks {self.chunks!r} must be an int >= 1")

    def two_pass(self, s: int, topk: int) -> bool:
        """Whether rows of `s` scores take the two-pass select for a top `topk`: C > 1 chunks of at least k =
        min(topk, s) scores each."""
        return self.chunks > 1 and -(-s // self.chunks) >= min(topk, s)


SM_COUNT = 132  # the H200's SMs


@dataclasses.dataclass(frozen=True)
class MosaicIndexerConfig:
    """Launch config. stages: key tiles buffered in shared memory for the consumers ((8 KiB + 256 B) each);
    in_flight: tiles in flight from memory (copy "tma": its staging buffers); consumers: consumer warpgroups (1 or
    2, taking tiles in turn; stages must be a multiple of it); ctas: CTAs the launch aims for (a row's tiles are
    split over about ceil(ctas / T) CTAs, `splits`); n_split: CTAs per row, overriding `ctas` when given; copy: how
    the producer's copies go: "tma" (the default): one bulk (TMA) copy a tile into a staging buffer, which the
    producer then rearranges into the swizzled key tile and the scales with shared-memory loads and stores; "rows":
    4-byte cp.async copies straight into place, a warp a row's keys, 64 threads the scales, `in_flight` tiles of
    them outstanding a thread (<= stages; slower in the op, BENCHMARKS.md, indexer)."""
    stages: int = 2
    in_flight: int = 4
    consumers: int = 1
    ctas: int = 2 * SM_COUNT
    n_split: int | None = None
    copy: str = "tma"

    def __post_init__(self):
        for name in ("stages", "in_flight", "consumers", "ctas"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MosaicIndexerConfig.{name} must be an int >= 1, got {v!r}")
        if self.copy not in ("tma", "rows"):
            raise ValueError(f"MosaicIndexerConfig.copy must be 'tma' or 'rows', got {self.copy!r}")
        if self.copy != "tma" and self.in_flight > self.stages:
            raise ValueError(f"MosaicIndexerConfig.in_flight {self.in_flight} must be <= stages {self.stages} "
                             "(a tile in flight holds a buffer)")
        if self.consumers not in (1, 2):
            raise ValueError(f"MosaicIndexerConfig.consumers must be 1 or 2, got {self.consumers}")
        if self.stages % self.consumers:
            raise ValueError(f"MosaicIndexerConfig.stages {self.stages} must be a multiple of consumers "
                             f"{self.consumers} (each buffer belongs to one consumer)")
        if self.n_split is not None and (not isinstance(self.n_split, int) or isinstance(self.n_split, bool)
                                         or self.n_split < 1):
            raise ValueError(f"MosaicIndexerConfig.n_split must be None or an int >= 1, got {self.n_split!r}")

    def splits(self, t: int, tiles: int) -> int:
        """CTAs per row for T rows of `tiles` key tiles: n_split, or ceil(ctas / T) lowered to a divisor of `tiles`
        when one lies within a factor 2 (equal splits: the scores are then exactly S wide, and no XLA slice copies
        them before the top-k), never more than `tiles`."""
        target = max(1, min(self.n_split if self.n_split is not None else -(-self.ctas // max(t, 1)), tiles))
        if self.n_split is not None:
            return target
        even = max(d for d in range(1, target + 1) if tiles % d == 0)
        return even if 2 * even >= target else target


LOOP_PROGRAMS = 1024  # programs the looped decode kernel aims for (about 8 per SM of an H200)


# float32 keys (the reference dtype): Triton runs an IEEE float32 dot on the FMA units, unrolled per thread
# ([64, 128] x [128, 128] is 8K FMAs a thread, x16 rows x2 branches in the row-block form), which ptxas took
# minutes to compile at GLM shapes. So float32 takes 32-key tiles and the per-row kernel only.
FLOAT32_BLOCK_S = 32


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """Launch config of the scores kernels: `block_s` keys per tile (a power of two >= 16); `block_t` query rows per
    program: 1 the per-row kernels (decode), a power of two > 1 the row-block kernel (prefill: one key gather per
    block of rows of one request), None picked from the shapes (the row-block kernel of ROW_BLOCK rows when the
    step's R requests leave runs of ROW_BLOCK rows on average: (R - 1) * ROW_BLOCK <= T); warps; pipeline stages.
    Per-row, bf16 and FP8 caches: `block_n` keys per program (a multiple of block_s looped over in tiles; None:
    `loop_block_n` of the shapes; 0: the one-tile kernel without a loop), `fp8_dot` e4m3 tensor-core dots for an
    FP8 cache (False: keys decoded to bf16)."""
    block_s: int
    block_t: int | None
    num_warps: int = 4
    num_stages: int = 1
    block_n: int | None = None
    fp8_dot: bool = True

    def __post_init__(self):
        if not (_is_pow2(self.block_s) and self.block_s >= 16):
            raise ValueError(f"IndexerConfig: block_s {self.block_s!r} must be a power of two >= 16")
        if self.block_t is not None and not _is_pow2(self.block_t):
            raise ValueError(f"IndexerConfig: block_t {self.block_t!r} must be a power of two (or None)")
        if not _is_pow2(self.num_warps):
            raise ValueError(f"IndexerConfig: num_warps {self.num_warps!r} must be a power of two")
        if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"IndexerConfig: num_stages {self.num_stages!r} must be an int >= 1")
        if self.block_n is not None and not (isinstance(self.block_n, int) and self.block_n >= 0
                                             and self.block_n % self.block_s == 0):
            raise ValueError(f"IndexerConfig: block_n {self.block_n!r} must be 0, None or a multiple of block_s")


def default_config(t: int, s: int, cache_dtype) -> IndexerConfig:
    """Decode (the per-row kernels, below ROW_BLOCK_MIN_T rows): the looped kernel over 128-key tiles, 4 warps,
    2 stages, `block_n` from `loop_block_n`. Prefill and float32 caches as before: 128-key tiles (FLOAT32_BLOCK_S
    for float32), never wider than S; the row-block kernel picked from the request count (`indexer_scores_triton`)."""
    f32 = jnp.dtype(cache_dtype) == jnp.float32
    block_s = min(FLOAT32_BLOCK_S if f32 else 128, max(16, _next_pow2(s)))
    if f32:
        return IndexerConfig(block_s=block_s, block_t=1, block_n=0)
    if t < ROW_BLOCK_MIN_T:
        return IndexerConfig(block_s=block_s, block_t=1, num_stages=2)
    return IndexerConfig(block_s=block_s, block_t=None)


def loop_block_n(t: int, s: int, block_s: int, programs: int = LOOP_PROGRAMS) -> int:
    """Keys per program of the looped kernel: the most (a power-of-two number of tiles, at most S) that still
    gives `programs` programs over the T rows, so a small batch keeps every SM busy and a large one amortises the
    queries over long runs of keys."""
    tiles = max(1, -(-s // block_s))
    per = 1
    while per * 2 <= tiles and t * -(-tiles // (per * 2)) >= programs:
        per *= 2
    return per * block_s


def _is_pow2(v) -> bool:
    return isinstance(v, int) and v >= 1 and v & (v - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
