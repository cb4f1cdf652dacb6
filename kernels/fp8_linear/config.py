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


#: The widest row count that takes the 128 x 128 split-K tiles of `default_config` (made for batch-invariant decode
#: steps when they all had `registry.INVARIANT_STEP_ROWS` rows; those now choose for `registry.config_rows`, 64, at
#: every row bucket, and the default mode's linears of 64+ rows dequantise: no model step takes this branch now).
STEP_ROWS = 256


def default_config(t: int, n: int, k: int, form: str = "w8a16", itemsize: int = 2,
                   num_sms: int = 132) -> Fp8LinearConfig:
    """The launch config for `t` rows of x [T, K] against a weight of N x K.

    Decode-sized rows (t <= 64) stream the weight: 16..64-row tiles, 64 output columns, K split until about two
    programs per SM.

    Up to `STEP_ROWS` rows (where most rows may be padding but every row costs the same in a GEMM): 128 x 128 tiles, K
    split until about one program per SM. The bytes that decide this shape (W = K x N weight bytes, e4m3; x bf16): every
    program reads its weight tile and all the rows' x tile for its K range, so the weight is read cdiv(T, bm) times and
    x N / bn times, together (T / bm + 2T / bn) W from L2 to the SMs (HBM sees W about once: the row blocks of one
    weight tile are adjacent programs, grid axis 0 fastest), and split-K adds k_split x T x N float32 partials written
    and summed (8 k_split T N bytes). At T = 256: 64 x 64 tiles (the t <= 64 shape) read 4 W + 8 W = 12 W, 128 x 128
    tiles 2 W + 4 W = 6 W (at B = 32 the default mode's 32 x 64 tiles read W + W), and one program per SM instead of two
    halves the partials (o_proj, N 6144 K 16384: 2 splits, 12.6 MB; q_b, 16384 outputs: none). 128 x 128 is the prefill
    tile (float32 accumulator of 64 registers a thread at 8 warps); wider tiles (128 x 256: 4 W) would hold twice that.

    Larger t takes 128 x 128 tensor-core tiles without a K split. float32 rows take 32-wide K steps (shared
    memory)."""
    bk = 32 if itemsize >= 4 else (128 if form == "w8a8" else 64)
    steps = cdiv(k, bk)

    def split(programs: int, target: int) -> int:  # K split (a power of two) until `target` programs
        ks = 1
        while programs * ks < target and ks * 2 <= 8 and steps % (ks * 2) == 0 and steps // (ks * 2) >= 2:
            ks *= 2
        return ks

    if t <= 64:
        bm = max(16, 1 << (t - 1).bit_length())
        bn = 64 if n >= 64 else max(16, 1 << (n - 1).bit_length())
        return Fp8LinearConfig(bm=bm, bn=bn, bk=bk, k_split=split(cdiv(n, bn), 2 * num_sms), num_warps=4,
                               num_stages=4)
    stages = 3 if itemsize < 4 else 2
    if t <= STEP_ROWS:
        return Fp8LinearConfig(bm=128, bn=128, bk=bk, k_split=split(cdiv(t, 128) * cdiv(n, 128), num_sms),
                               num_warps=8, num_stages=stages)
    return Fp8LinearConfig(bm=128, bn=128, bk=bk, k_split=1, num_warps=8, num_stages=stages)
