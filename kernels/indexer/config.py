"""Launch config of the indexer's select top-k kernel (`kernels.indexer.topk_triton`) and the row count from which
the one-pass select beats `lax.top_k`, in a module of its own (no Pallas import) so the op's rules and both scores
kernels read them without importing a kernel module."""

from __future__ import annotations

import dataclasses

# rows from which the one-pass select top-k beats lax.top_k on the GPU (one program per row leaves the GPU idle
# below that); rows that split into the two-pass select's chunks take it from one row (BENCHMARKS.md, top-k)
SELECT_MIN_ROWS = 4


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
