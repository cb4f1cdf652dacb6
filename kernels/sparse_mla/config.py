"""Launch configs of the sparse MLA kernels (`kernels.sparse_mla.triton`, `kernels.sparse_mla.mosaic`): frozen
dataclasses and their defaults per shape."""

from __future__ import annotations

import dataclasses

from ..common.triton_common import is_pow2


@dataclasses.dataclass(frozen=True)
class SparseMLAConfig:
    """Launch config of the sparse MLA kernel: `block_h` heads x `block_k` keys per step (powers of two >= 16),
    `n_split` programs per (row, head block) over the indices (split-K, merged by LSE), warps, pipeline stages.

    `merge` (with n_split > 1): "launch" (the default) writes the partials as outputs and merges them in a second
    Pallas Triton launch (`kernels.lse_merge.triton`: one kernel where XLA's merge is five passes); "xla" merges
    them after the kernel with `lse_merge.merge_partials` (XLA); "kernel" merges inside the same launch: each
    program writes its partial to a workspace and counts itself in with an atomic, and the last program of a
    (row, head block) merges them (n_split must then be a power of two: the merge loads [n_split, block_h, cols] tiles).
    `partial_dtype` ("float32" or "bfloat16"): the dtype of the stored partial o (lse stays float32); bfloat16
    halves the bytes the merge reads, at one more bf16 rounding of o (p is already rounded to bf16)."""
    block_h: int
    block_k: int
    n_split: int
    num_warps: int
    num_stages: int
    merge: str = "launch"
    partial_dtype: str = "float32"

    def __post_init__(self):
        for name in ("block_h", "block_k"):
            v = getattr(self, name)
            if not (is_pow2(v) and v >= 16):
                raise ValueError(f"SparseMLAConfig: {name} {v!r} must be a power of two >= 16")
        if not is_pow2(self.num_warps):
            raise ValueError(f"SparseMLAConfig: num_warps {self.num_warps!r} must be a power of two")
        for name in ("n_split", "num_stages"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"SparseMLAConfig: {name} {v!r} must be an int >= 1")
        if self.merge not in ("launch", "xla", "kernel"):
            raise ValueError(f"SparseMLAConfig: merge {self.merge!r} must be 'launch', 'xla' or 'kernel'")
        if self.merge == "kernel" and not is_pow2(self.n_split):
            raise ValueError(f"SparseMLAConfig: n_split {self.n_split!r} must be a power of two with merge='kernel'")
        if self.partial_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"SparseMLAConfig: partial_dtype {self.partial_dtype!r} must be 'float32' or 'bfloat16'")


def default_config(t: int, h: int, k: int, fp8: bool, itemsize: int = 2) -> SparseMLAConfig:
    """The launch config from the H200 sweep (BENCHMARKS.md): with enough rows, 64 heads x 64 keys per step,
    8 warps, 3 stages, and just enough splits for ~one CTA per SM (each CTA holds ~220 KB of shared memory);
    for a few rows, 32 x 32 tiles and more splits. fp8_ds_mla always steps 32 keys: its dequantised
    [block_k, R] bf16 tile is staged in shared memory beside the raw bytes, and at 64 keys the kernel asks for
    242 KB (the H200 has 227 KB per CTA). A float32 cache (`itemsize` 4: the reference models) takes 16 x 16
    tiles in 2 stages: its rows are twice as wide in shared memory, and the bf16 tiles would ask for up to
    440 KB."""
    many = t * max(1, h // 64) >= 32
    if itemsize >= 4:
        block_h, block_k, num_warps, num_stages = 16, 16, 4, 2
    else:
        block_h = 64 if (many and h % 64 == 0) else (32 if h % 32 == 0 else 16)
        block_k = 64 if (many and not fp8) else 32
        num_warps, num_stages = 8, 3 if many else 2
    n_hb = max(1, h // block_h)
    target = 128 if many else 64
    max_split = max(1, k // block_k)
    n_split = 1
    while t * n_hb * n_split < target and n_split * 2 <= max_split:
        n_split *= 2
    return SparseMLAConfig(block_h=block_h, block_k=block_k, n_split=n_split, num_warps=num_warps,
                           num_stages=num_stages)


def one_launch_config(t: int, h: int, k: int, fp8: bool) -> SparseMLAConfig:
    """A one-launch (`merge="kernel"`) config for few rows: 16-head blocks, 32 keys a step, 4 warps, 2 stages, and
    splits (a power of two, at most 16) until ~128 programs. Measured faster than the two-launch default for a
    bf16 cache at B = 8 and 16 only, not at B = 1-4, and slower for fp8_ds_mla (BENCHMARKS.md, sparse MLA). Not
    wired into `default_config`: the dispatch per shape is the caller's, from measurements. Fewer heads per block
    mean the merging program reads n_split x 16 heads x R partial floats (<= 512 KB at R = 512)."""
    n_hb = max(1, -(-h // 16))
    n_split = 1
    while t * n_hb * n_split < 128 and n_split < 16 and n_split * 2 * 32 <= k:
        n_split *= 2
    return SparseMLAConfig(block_h=16, block_k=32, n_split=n_split, num_warps=4, num_stages=2, merge="kernel")


BLOCK_K = 64  # cache rows per tile


# registers a thread at launch: the SM's 65536 over the CTA's three warpgroups (384 threads), rounded down to 8
LAUNCH_REGISTERS = 65536 // (3 * 128) // 8 * 8


@dataclasses.dataclass(frozen=True)
class MosaicSparseMLAConfig:
    """Launch config. n_split: CTAs per query row (each a contiguous share of the row's 64-slot tiles; their
    partials are merged after the launch). consumer_registers / producer_registers: `set_max_registers` of the
    two consumer warpgroups and the producer (their sum over three warpgroups must stay <= 504);
    follower_registers: consumer 1's under share_p, which holds its half of the output and reads P from shared
    memory (None: consumer_registers), so that registers can go to the fp8 producer's loads. merge (n_split >
    1): "launch" merges the partials in one Pallas Triton launch (`kernels.lse_merge.triton`), "xla" with
    `lse_merge.merge_partials` (five XLA passes). share_p: one QK^T per tile, shared through shared memory (the
    default: measured faster, BENCHMARKS.md, sparse MLA); False: both consumers
    compute it. l2_prefetch: how many tiles ahead the producer asks L2 for the cache rows of (one bulk prefetch
    per row, issued before it waits for a free buffer; 0: none; the bf16 cp.async producer only). slot_source:
    where the TMA and fp8 producers read the slot ids from: "gmem" (the index array, each thread its rows' ids)
    or "smem" (one TMA copy of the next tile's 64 ids into shared memory while the current tile is gathered; the
    bf16 cp.async producer reads gmem either way). producer: "cp_async" or "tma", the bf16 cache's gatherer (an
    fp8_ds_mla cache always takes its own)."""
    n_split: int = 1
    consumer_registers: int = 232
    producer_registers: int = 40
    slot_source: str = "gmem"
    producer: str = "cp_async"
    share_p: bool = True
    merge: str = "launch"
    l2_prefetch: int = 0
    follower_registers: int | None = None

    def __post_init__(self):
        if self.merge not in ("launch", "xla"):
            raise ValueError(f"MosaicSparseMLAConfig.merge must be 'launch' or 'xla', got {self.merge!r}")
        if self.producer not in ("cp_async", "tma"):
            raise ValueError(f"MosaicSparseMLAConfig.producer must be 'cp_async' or 'tma', got {self.producer!r}")
        if self.slot_source not in ("gmem", "smem"):
            raise ValueError(f"MosaicSparseMLAConfig.slot_source must be 'gmem' or 'smem', got {self.slot_source!r}")
        if not isinstance(self.l2_prefetch, int) or isinstance(self.l2_prefetch, bool) or self.l2_prefetch < 0:
            raise ValueError(f"MosaicSparseMLAConfig.l2_prefetch must be an int >= 0, got {self.l2_prefetch!r}")
        if self.n_split < 1:
            raise ValueError(f"MosaicSparseMLAConfig.n_split must be >= 1, got {self.n_split}")
        for name in ("consumer_registers", "producer_registers", "follower_registers"):
            v = getattr(self, name)
            if v is None and name == "follower_registers":
                continue
            # setmaxnreg takes multiples of 8 in [24, 256]
            if not isinstance(v, int) or isinstance(v, bool) or v % 8 or not 24 <= v <= 256:
                raise ValueError(f"MosaicSparseMLAConfig.{name} must be a multiple of 8 in [24, 256], got {v!r}")
        # setmaxnreg raises (consumers) or lowers (producer) a warpgroup's count from the launch's: the other way
        # is an illegal instruction on the device (seen: a consumer at 160)
        for name in ("consumer_registers", "follower_registers"):
            v = getattr(self, name)
            if v is not None and v < LAUNCH_REGISTERS:
                raise ValueError(f"MosaicSparseMLAConfig.{name} must be >= {LAUNCH_REGISTERS} (the launch's "
                                 f"registers a thread; a consumer can only raise them), got {v}")
        if self.producer_registers > LAUNCH_REGISTERS:
            raise ValueError(f"MosaicSparseMLAConfig.producer_registers must be <= {LAUNCH_REGISTERS} (the "
                             f"launch's registers a thread; the producer can only lower them), got "
                             f"{self.producer_registers}")
        if self.follower_registers is not None and not self.share_p:
            raise ValueError("MosaicSparseMLAConfig.follower_registers needs share_p (without it both consumers "
                             "compute S and take consumer_registers)")
        total = self.consumer_registers + self.second_consumer_registers + self.producer_registers
        if total > 504:
            raise ValueError("MosaicSparseMLAConfig: the three warpgroups' registers (consumer_registers, "
                             "follower_registers or consumer_registers again, producer_registers) must be <= 504 "
                             f"in sum, got {self.consumer_registers} + {self.second_consumer_registers} + "
                             f"{self.producer_registers} = {total}")

    @property
    def second_consumer_registers(self) -> int:
        """`set_max_registers` of consumer 1: follower_registers where given, else consumer_registers."""
        return self.consumer_registers if self.follower_registers is None else self.follower_registers


def mosaic_default_config(t: int, k: int, fp8: bool = False, share_p: bool = True) -> MosaicSparseMLAConfig:
    """Split the row's tiles over more CTAs when there are fewer rows than SMs (132 on the H200); the fp8
    producer holds a tile's loads and their conversions in registers, so it takes registers from the consumers:
    128, with consumer 1 (which reads P from shared memory) at the launch's 168 and consumer 0 at 208 (the
    fastest split measured: BENCHMARKS.md, sparse MLA). A bf16 cache read by one CTA a row asks L2 for the next
    tile's rows (measured faster there only).
    share_p False (both consumers compute S): for fp8 the two consumers share what the producer leaves, 184 each
    (not measured for speed; the default schedule is share_p). The fp8 producer takes its slot ids from shared
    memory, fetched a tile ahead (slot_source "smem": measured slightly faster)."""
    tiles = max(1, -(-k // BLOCK_K))
    n_split = 1
    while t * n_split * 2 <= 132 and tiles // (n_split * 2) >= 1:
        n_split *= 2
    if fp8:
        if not share_p:
            return MosaicSparseMLAConfig(n_split=n_split, share_p=False, consumer_registers=184,
                                         producer_registers=128, slot_source="smem")
        return MosaicSparseMLAConfig(n_split=n_split, consumer_registers=208, follower_registers=168,
                                     producer_registers=128, slot_source="smem")
    return MosaicSparseMLAConfig(n_split=n_split, share_p=share_p, l2_prefetch=1 if n_split == 1 else 0)
