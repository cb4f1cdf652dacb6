"""Launch config of the Pallas Triton merge (`kernels.lse_merge.triton`): a frozen dataclass and its default per shape."""

from __future__ import annotations

import dataclasses

from ..common.triton_common import is_pow2


@dataclasses.dataclass(frozen=True)
class MergeConfig:
    """Launch config of the merge kernel: `block_h` heads x `block_r` columns per program (powers of two; block_h
    is clipped to the largest power of two dividing H, block_r to R's), `num_warps`."""
    block_h: int = 16
    block_r: int = 128
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_h", "block_r", "num_warps"):
            if not is_pow2(getattr(self, name)):
                raise ValueError(f"MergeConfig: {name} {getattr(self, name)!r} must be a power of two")


def default_config(t: int, h: int, r: int) -> MergeConfig:
    """Few rows take 4-head blocks, so a B = 1 merge still spreads over 64 programs (H = 64, R = 512); from 8 rows
    16-head blocks."""
    return MergeConfig(block_h=4 if t < 8 else 16, block_r=128, num_warps=4)
