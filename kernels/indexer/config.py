"""Launch config of the indexer's select top-k kernel (`kernels.indexer.topk_triton`), in a module of its own so the
triton indexer (`kernels.indexer.triton`), which picks the top-k per shape, reads it without importing a sibling
kernel module."""

from __future__ import annotations

import dataclasses

from ..common.triton_common import is_pow2


@dataclasses.dataclass(frozen=True)
class TopkConfig:
    """Launch config of the select kernel. `num_warps` None: S_pad / 1024 clamped to [1, 32] (32 keys a thread),
    in one pass and in each pass of a chunked select (8 warps over 32K keys in 4 chunks: 2-3 us faster than 32
    warps at B = 1-128 on the H200, BENCHMARKS.md, session 16); `sort`: the output order, "xla" (score desc,
    position asc, as `lax.top_k`, by one `lax.sort` of the [T, k] selection after the kernel), "kernel" (the same
    order by a bitonic network in the same program: ~20 s of Triton compile per shape on the H200) or "none"
    (position order: the same set, the same scores); `chunks` C: the two-pass select
    (`kernels.indexer.topk_triton._chunked_select`) where a row splits into C chunks of at least k scores, one pass
    elsewhere (C = 1: always one pass). The default 4 is the H200's best at 32 rows of 32K, k = 2048
    (BENCHMARKS.md, session 14: the select 26.6 us in two passes against 55.8 in one; 2 and 8 chunks slower)."""
    num_warps: int | None = None
    sort: str = "xla"
    chunks: int = 4

    def __post_init__(self):
        if self.num_warps is not None and not (is_pow2(self.num_warps) and self.num_warps <= 32):
            raise ValueError(f"TopkConfig: num_warps {self.num_warps!r} must be a power of two <= 32 (or None)")
        if self.sort not in ("kernel", "xla", "none"):
            raise ValueError(f"TopkConfig: sort {self.sort!r} must be 'kernel', 'xla' or 'none'")
        if not (isinstance(self.chunks, int) and not isinstance(self.chunks, bool) and self.chunks >= 1):
            raise ValueError(f"TopkConfig: chunks {self.chunks!r} must be an int >= 1")

    def two_pass(self, s: int, topk: int) -> bool:
        """Whether rows of `s` scores take the two-pass select for a top `topk`: C > 1 chunks of at least k =
        min(topk, s) scores each."""
        return self.chunks > 1 and -(-s // self.chunks) >= min(topk, s)
