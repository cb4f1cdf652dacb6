"""Launch config of the grouped-GEMM kernels (`kernels.moe.triton`): a frozen dataclass and its default per shape,
and whether FP8 stacks are read as uint16 words."""

from __future__ import annotations

import dataclasses

from ..common.triton_common import is_pow2
from .tiles import tile_rows


def block_width(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n, else 16 (the narrowest dot; the kernels mask the rest)."""
    b = cap
    while b > 16 and n % b:
        b //= 2
    return b


def word_form(n_exp: int, d: int, i: int) -> bool:
    """Whether FP8 expert stacks of n_exp x d x i are read as uint16 words (`grouped_swiglu`'s `packed` default):
    2**31 elements or more, past Pallas Triton's int32 offsets (see `_pair_block`)."""
    return n_exp * d * i >= 2 ** 31


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Launch config of the grouped-GEMM kernels: `tile` rows per expert tile; up kernel blocks (`bn_up`
    columns of I, `bk_up` hidden columns per step), down kernel blocks (`bn_down` columns of D, `bk_down`
    columns of I per step), all powers of two >= 16; warps, pipeline stages; `k_split` (a power of two)
    programs splitting the up projection's hidden size (a launch option for few tiles). `swap_ab` (K-major W8A8
    only): each dot computes the transposed product, weights [bn, bk] times the rows' [tile, bk] transposed, so
    the weight columns fill the fp8 MMA's M side (Hopper's wgmma takes M in multiples of 64, and a decode tile
    has 16 rows) and the rows its N side; the accumulators are [bn, tile] and are transposed once at the end.
    `quant_h` (W8A8 with 128-wide up column blocks and no split-K): the up kernel quantises h itself
    (`_up_kernel`), instead of XLA between the kernels; None: wherever those conditions hold (the decode default,
    so that overriding k_split or bn_up just turns it off), True: required (else a ValueError)."""
    tile: int
    bn_up: int
    bk_up: int
    bn_down: int
    bk_down: int
    num_warps: int
    num_stages: int
    k_split: int = 1
    swap_ab: bool = False
    quant_h: bool | None = False

    def __post_init__(self):
        for name in ("tile", "bn_up", "bk_up", "bn_down", "bk_down"):
            v = getattr(self, name)
            if not (is_pow2(v) and v >= 16):
                raise ValueError(f"MoEConfig: {name} {v!r} must be a power of two >= 16")
        for name in ("num_warps", "k_split"):
            if not is_pow2(getattr(self, name)):
                raise ValueError(f"MoEConfig: {name} {getattr(self, name)!r} must be a power of two")
        if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"MoEConfig: num_stages {self.num_stages!r} must be an int >= 1")
        if not isinstance(self.swap_ab, bool):
            raise ValueError(f"MoEConfig: swap_ab {self.swap_ab!r} must be a bool")
        if self.quant_h not in (True, False, None):
            raise ValueError(f"MoEConfig: quant_h {self.quant_h!r} must be a bool or None")


def default_config(t: int, k: int, n_exp: int, d: int, i: int, itemsize: int = 2, form: str | None = None,
                   w_layout: str = "kn") -> MoEConfig:
    """Tile rows and block widths: decode-sized tiles stream weights (wide K steps, deep pipelines); prefill
    tiles of 128 rows feed the tensor cores. float32 weights (`itemsize` 4: the reference models) take 64 x 32
    blocks in 2 stages, since the bf16 blocks would ask for more shared memory than a CTA has. `form` "w8a8"
    (FP8 experts, whole blocks) at decode: 128-wide column blocks, the bytes per K step of the bf16 blocks, from
    the launch-config sweeps on the GPU (BENCHMARKS.md, FP8 weights: 64-wide K steps in 3 stages from T = 16,
    128-wide steps in 3 stages over 8 warps, split-K 4, below); over K-major stacks (`w_layout` "nk") from T = 16,
    128 x 128 blocks over 4 warps: h quantised in the up kernel (`quant_h`) with swapped dots (`swap_ab`) in 3
    stages (the best variant at the TP = 8 shard), and 4 stages without either for stacks of 2**31+ elements, read
    as uint16 words (sweeps at TP = 1; `grouped_swiglu`'s `packed` rule).
    Split-K needs an even count of 128-wide hidden steps (else 1)."""
    tile = tile_rows(t, k, n_exp)
    if form == "w8a8" and itemsize < 4 and tile < 64 and i % 128 == 0 and d % 128 == 0:
        if t >= 16 and w_layout == "nk" and word_form(n_exp, d, i):  # TP = 1 stacks
            return MoEConfig(tile=tile, bn_up=128, bk_up=128, bn_down=128, bk_down=128, num_warps=4, num_stages=4)
        if t >= 16 and w_layout == "nk":
            return MoEConfig(tile=tile, bn_up=128, bk_up=128, bn_down=128, bk_down=128, num_warps=4, num_stages=3,
                             swap_ab=True, quant_h=None)
        if t < 16:
            return MoEConfig(tile=tile, bn_up=128, bk_up=128, bn_down=128, bk_down=128, num_warps=8, num_stages=3,
                             k_split=4 if (d // 128) % 4 == 0 else 1)
        return MoEConfig(tile=tile, bn_up=128, bk_up=64, bn_down=128, bk_down=64, num_warps=4, num_stages=3)
    if itemsize >= 4:
        return MoEConfig(tile=tile, bn_up=block_width(i, 64), bk_up=block_width(d, 32), bn_down=block_width(d, 64),
                         bk_down=block_width(i, 32), num_warps=8 if tile >= 64 else 4, num_stages=2)
    big = tile >= 64
    return MoEConfig(tile=tile, bn_up=block_width(i, 128 if big else 64), bk_up=block_width(d, 64 if big else 128),
                     bn_down=block_width(d, 128 if big else 64), bk_down=block_width(i, 64 if big else 128),
                     num_warps=8 if big else 4, num_stages=3 if big else 4)
