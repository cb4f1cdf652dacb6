"""Launch config of the fused norm/RoPE kernel (`kernels.fused_norm_rope.triton`): a frozen dataclass and its default
per shape."""

from __future__ import annotations

import dataclasses

from ..common.triton_common import is_pow2


LAYOUTS = ("split", "interleave", "fused", "two_launch")


@dataclasses.dataclass(frozen=True)
class FusedNormRopeConfig:
    """Launch config.

    q_rows / cache_rows: token rows per block of the q / cache part (powers of two: Triton's tiles are).
    num_warps, num_stages: of the launch (num_stages pipelines the loads of persistent programs' loops).
    layout: how programs map to the parts (module docstring): "split", "interleave", "fused", "two_launch".
    q_programs / cache_programs: 0 = one program per block; n > 0 = n persistent programs looping over the
        blocks (weights loaded once per program).
    q_warps: "two_launch" only: warps of the q launch (0 = num_warps).
    """
    q_rows: int
    cache_rows: int
    num_warps: int
    num_stages: int = 1
    layout: str = "split"
    q_programs: int = 0
    cache_programs: int = 0
    q_warps: int = 0

    def __post_init__(self):
        for name in ("q_rows", "cache_rows", "num_warps"):
            if not is_pow2(getattr(self, name)):
                raise ValueError(f"FusedNormRopeConfig: {name} {getattr(self, name)!r} must be a power of two")
        if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"FusedNormRopeConfig: num_stages {self.num_stages!r} must be an int >= 1")
        if self.layout not in LAYOUTS:
            raise ValueError(f"FusedNormRopeConfig: layout {self.layout!r} must be one of {LAYOUTS}")
        for name in ("q_programs", "cache_programs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"FusedNormRopeConfig: {name} {v!r} must be an int >= 0 (0: one program per block)")
        if not (self.q_warps == 0 or is_pow2(self.q_warps)):
            raise ValueError(f"FusedNormRopeConfig: q_warps {self.q_warps!r} must be 0 or a power of two")
        if self.q_warps and self.layout != "two_launch":
            raise ValueError(f"FusedNormRopeConfig: q_warps is the q launch's warps of layout 'two_launch', not "
                             f"of {self.layout!r}")

    def label(self) -> str:
        """A short name for tables: the fields that differ from the dataclass defaults, then rows and warps."""
        s = f"{self.layout} q{self.q_rows} c{self.cache_rows} w{self.num_warps}"
        if self.q_warps:
            s += f" qw{self.q_warps}"
        if self.num_stages != 1:
            s += f" s{self.num_stages}"
        if self.q_programs:
            s += f" qp{self.q_programs}"
        if self.cache_programs:
            s += f" cp{self.cache_programs}"
        return s


# Cache rows per block an FP8 (MLA or indexer) cache needs: every 1-row launch with FP8 caches (split, fused,
# two_launch; T = 1 to 65536) killed the process with a segfault on the H200 (jax 0.11.2), while the same layouts
# with 2-row cache blocks ran and matched the xla op. The crash is not isolated further.
FP8_MIN_CACHE_ROWS = 2


def default_config(T: int, fp8: bool = False) -> FusedNormRopeConfig:
    """The launch config for T token rows (`fp8`: an FP8 MLA or indexer cache), the fastest layouts measured on
    the GPU (BENCHMARKS.md, fused norm/RoPE): below 256 rows one row per program, each program doing both parts
    ("fused", faster than "split" there); up to 16K rows split 2-row blocks, 4 warps; above, "fused" with 1-row
    blocks and 4 warps for bf16 (the best of a sweep of 13 layouts at T = 65536) and 2-row blocks for fp8 (that
    sweep did not reach the others). benchmarks/bench_fused_norm_rope.py times the other layouts."""
    if T < 256:  # an FP8 cache takes 2-row cache blocks: its 1-row launches crash Triton (FP8_MIN_CACHE_ROWS)
        return FusedNormRopeConfig(q_rows=1, cache_rows=FP8_MIN_CACHE_ROWS if fp8 else 1, num_warps=4,
                                   layout="fused")
    if T < 16384:
        return FusedNormRopeConfig(q_rows=2, cache_rows=2, num_warps=4)
    rows = 2 if fp8 else 1
    return FusedNormRopeConfig(q_rows=rows, cache_rows=rows, num_warps=4, layout="fused")
