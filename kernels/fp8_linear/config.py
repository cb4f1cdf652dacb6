"""Launch config of the FP8 linear kernel (`kernels.fp8_linear.triton`): a frozen dataclass and its default per shape."""

from __future__ import annotations

import dataclasses

from ..common.triton_common import is_pow2


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints."""
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Fp8LinearConfig:
    """Launch config: `bm` x `bn` output tile, `bk` K columns per step (32, 64 or 128: a step stays in one
    scale block), `k_split` programs splitting K (a power of two), warps, pipeline stages."""
    bm: int
    bn: int
    bk: int
    k_split: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for name in ("bm", "bn"):
            v = getattr(self, name)
            if not (is_pow2(v) and v >= 16):
                raise ValueError(f"Fp8LinearConfig: {name} {v!r} must be a power of two >= 16")
        if self.bk not in (32, 64, 128):
            raise ValueError(f"Fp8LinearConfig: bk {self.bk!r} must be 32, 64 or 128 (a divisor of the 128-block)")
        for name in ("k_split", "num_warps"):
            if not is_pow2(getattr(self, name)):
                raise ValueError(f"Fp8LinearConfig: {name} {getattr(self, name)!r} must be a power of two")
        if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"Fp8LinearConfig: num_stages {self.num_stages!r} must be an int >= 1")


def default_config(t: int, n: int, k: int, form: str = "w8a16", itemsize: int = 2,
                   num_sms: int = 132) -> Fp8LinearConfig:
    """Decode-sized rows (t <= 64) stream the weight: 16..64-row tiles, 64 output columns, K split until about
    two programs per SM; larger t takes 128 x 128 tensor-core tiles. float32 rows take 32-wide K steps (shared
    memory)."""
    bk = 32 if itemsize >= 4 else (128 if form == "w8a8" else 64)
    if t <= 64:
        bm = max(16, 1 << (t - 1).bit_length())
        bn = 64 if n >= 64 else max(16, 1 << (n - 1).bit_length())
        steps = cdiv(k, bk)
        ks = 1
        while cdiv(n, bn) * ks < 2 * num_sms and ks * 2 <= 8 and steps % (ks * 2) == 0 and steps // (ks * 2) >= 2:
            ks *= 2
        return Fp8LinearConfig(bm=bm, bn=bn, bk=bk, k_split=ks, num_warps=4, num_stages=4)
    return Fp8LinearConfig(bm=128, bn=128, bk=bk, k_split=1, num_warps=8, num_stages=3 if itemsize < 4 else 2)
