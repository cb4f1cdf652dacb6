"""Launch configs of the Mosaic GPU W8A8 grouped GEMM (`kernels.fp8_gemm.mosaic`)."""

from __future__ import annotations

import dataclasses

# SMEM_LIMIT is read from here
from ..common.mosaic_common import MBARRIER_BYTES, SMEM_LIMIT, round_up, smem_align  # noqa: F401

WGMMA_M = 64  # rows of one warpgroup's wgmma
BLOCK = 128  # the FP8 scale block; every K step is one block
TMA_SMEM_ALIGN = 128  # bytes: a TMA's shared-memory address must be a multiple of this
SCALE_REPEAT = TMA_SMEM_ALIGN // 4  # float32 copies of each weight scale: one stage's block is whole 128 bytes
SWAP_SWIGLU_MAX_M = 128  # swap_ab + swiglu: two running 64 x tile_m accumulators and a partial per warpgroup


@dataclasses.dataclass(frozen=True)
class Fp8GemmConfig:
    """One launch shape.

    swap_ab False (prefill: many rows per group): a CTA tile is `tile_m` activation rows x `tile_n` weight rows;
    each compute warpgroup owns 64 x m_sub rows (tile_m = 64 x m_sub x compute_wgs) and all the tile's weight rows,
    issued as m_sub x tile_n / 128 wgmmas of 64 x 128 per K block (one weight scale each), each waited for and
    promoted before the next, so only one 64 x 128 partial is live beside the running accumulators
    (m_sub x tile_n / 128 <= 2 of them: 128 float32 registers a thread); partials smaller than that are issued
    together and waited for once (`issue_together`).
    swap_ab True (decode: few rows per group): the weights sit on wgmma's M side. A CTA tile is `tile_n` weight
    rows (64 per compute warpgroup and weight operand, at most one 128-row scale block) x `tile_m` activation rows
    (wgmma's N: a multiple of 8, at most 256); the kernel writes out^T and the wrapper transposes it.
    swiglu: two weight operands, gate and up (each [G, N, K], the release's [out, in] experts as stored), and the
    epilogue stores silu(gate) * up, [M, N]. A tile's `tile_n` weight rows are half gate rows, half the matching up
    rows: 128 + 128 (swap_ab False, tile_n 256: two 64 x 128 wgmmas a K block), 64 + 64 (swap_ab False, tile_n
    128: two 64 x 64 wgmmas, the plain 128 x 128 tile's registers and shared memory, so as many stages), or 64 +
    64 per compute warpgroup (swap_ab, tile_n 128 x compute_wgs, tile_m <= 128: two running accumulators of 64 x
    tile_m).
    stages: K blocks in flight in shared memory (the producer warpgroup's TMA ring).
    chain: each CTA's tiles run as one chain of pipelines (`chains`): the producer loads the next tile's first K
    blocks while the compute warpgroups finish the current tile and store it, instead of each tile's pipeline
    filling its ring and draining it alone."""
    tile_m: int = 128
    tile_n: int = 128
    stages: int = 4
    compute_wgs: int = 2
    swap_ab: bool = False
    m_sub: int = 1
    swiglu: bool = False
    chain: bool = False

    def __post_init__(self):
        if not isinstance(self.chain, bool):
            raise ValueError(f"Fp8GemmConfig.chain must be a bool, got {self.chain!r}")
        for name in ("tile_m", "tile_n", "stages", "compute_wgs", "m_sub"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Fp8GemmConfig.{name} must be an int >= 1, got {v!r}")
        if self.compute_wgs not in (1, 2):
            raise ValueError(f"Fp8GemmConfig.compute_wgs must be 1 or 2, got {self.compute_wgs}")
        if self.swap_ab:
            if self.tile_n != WGMMA_M * self.compute_wgs * self.n_operands:
                raise ValueError(f"Fp8GemmConfig: swap_ab needs tile_n = 64 x compute_wgs x weight operands = "
                                 f"{WGMMA_M * self.compute_wgs * self.n_operands}, got {self.tile_n}")
            if self.tile_m % 8 or self.tile_m > 256:
                raise ValueError(f"Fp8GemmConfig: swap_ab needs tile_m a multiple of 8 up to 256 (wgmma's N), "
                                 f"got {self.tile_m}")
            if self.m_sub != 1:
                raise ValueError("Fp8GemmConfig: swap_ab takes m_sub 1")
            if self.swiglu and self.tile_m > SWAP_SWIGLU_MAX_M:
                raise ValueError(f"Fp8GemmConfig: swap_ab with swiglu takes tile_m up to {SWAP_SWIGLU_MAX_M} (two "
                                 f"64 x tile_m accumulators a warpgroup), got {self.tile_m}")
        else:
            if self.tile_m != WGMMA_M * self.m_sub * self.compute_wgs:
                raise ValueError(f"Fp8GemmConfig: tile_m must be 64 x m_sub x compute_wgs = "
                                 f"{WGMMA_M * self.m_sub * self.compute_wgs}, got {self.tile_m}")
            if self.tile_n % BLOCK or self.tile_n > 256:
                raise ValueError(f"Fp8GemmConfig: tile_n must be 128 or 256, got {self.tile_n}")
            if self.m_sub * self.tile_n > 2 * BLOCK:
                raise ValueError(f"Fp8GemmConfig: m_sub x tile_n = {self.m_sub * self.tile_n} accumulator columns "
                                 "per warpgroup: at most 256 (two 64 x 128 float32 accumulators) fit the registers")
        if self.smem_bytes() > SMEM_LIMIT:
            raise ValueError(f"Fp8GemmConfig {self}: {self.smem_bytes()} bytes of shared memory, over {SMEM_LIMIT}")

    @property
    def n_operands(self) -> int:
        """Weight operands: 2 (gate, up) for swiglu, else 1."""
        return 2 if self.swiglu else 1

    @property
    def operand_rows(self) -> int:
        """Rows of each weight operand in one CTA tile (the output columns of a tile: out^T rows under swap_ab)."""
        return self.tile_n // self.n_operands

    @property
    def n_sub(self) -> int:
        """wgmmas per warpgroup, m sub-tile and K block: tile_n / 128 (swap_ab or swiglu: one per weight
        operand)."""
        return self.n_operands if self.swap_ab or self.swiglu else self.tile_n // BLOCK

    @property
    def issue_together(self) -> bool:
        """Whether a warpgroup issues the n_sub wgmmas of one m sub-tile and K block back to back and waits for them
        once: where their partials together are at most 64 x 128 float32 (64 registers a thread, one plain
        partial's), i.e. the narrow fused tile's two 64 x 64 and swap_ab SwiGLU's two 64 x tile_m at tile_m <= 64.
        Wider partials (the 128 + 128 fused tile, a plain tile_n 256) are issued, waited for and promoted one at a
        time, so only one is live beside the running accumulators. Either way each accumulator gets the same
        products in the same order: the same bits."""
        return self.n_sub * self.out_tile()[1] <= BLOCK

    def chains(self, k_blocks: int) -> bool:
        """Whether the kernel chains a CTA's tile pipelines at K = 128 k_blocks: `chain` set and the ring's slots
        used a whole number of times per tile (k_blocks a multiple of min(stages, k_blocks), what Pallas's
        pipeline_state asks), so that every tile starts on slot 0; else each tile's pipeline stands alone."""
        return self.chain and k_blocks % min(self.stages, k_blocks) == 0

    @property
    def operand_blocks(self) -> int:
        """128-row weight-scale blocks of one operand's rows in one warpgroup's wgmmas (1 but for a plain
        tile_n 256)."""
        return self.n_sub // self.n_operands

    def out_tile(self) -> tuple[int, int]:
        """One warpgroup's store tile, which is also each wgmma's accumulator: 64 x 128 output (swiglu: 64 x the
        operand's rows; swap_ab: 64 weight rows x tile_m rows of out^T)."""
        if self.swap_ab:
            return (WGMMA_M, self.tile_m)
        return (WGMMA_M, self.operand_rows if self.swiglu else BLOCK)

    def smem_bytes(self, out_itemsize: int = 2, k_blocks: int | None = None) -> int:
        """Shared memory of one CTA in bytes, as Mosaic GPU counts it for the kernel (`mosaic._kernel`) with
        `out_itemsize`-byte outputs (2: bf16, 4: float32) and `k_blocks` = K / 128 K blocks (None: any K).

        The kernel allocates everything in one `pl.run_scoped`; Mosaic GPU's resource estimate (jax 0.11.2)
        (jax/_src/pallas/mosaic_gpu/lowering.py, `_run_scoped_resource_estimator` and `Resources`) rounds each
        shared-memory allocation up to SMEM_ALIGNMENT (1024) bytes and adds them; the launch
        (jax/experimental/mosaic/gpu/core.py, `_smem_tree_size`) puts the mbarriers, MBARRIER_BYTES (8) each,
        after that scratch. With S = min(stages, k_blocks) (`emit_pipeline_warp_specialized` shrinks its ring to
        the K steps there are; without k_blocks S = stages, a bound from above for K below stages blocks):
          the pipeline's TMA ring (`get_allocations`: one [S, block] buffer per in_spec), each rounded up:
            e4m3 rows: S x tile_m x 128 bytes; each weight operand's e4m3 rows: S x operand_rows x 128;
            activation scales: S x 4 sa_w, each operand's weight scales S x 4 sw_w (`scale_block_widths`);
          the store tiles, [compute_wgs, *out_tile()] of the output dtype, rounded up;
          the pipeline's barriers: one produced and one consumed barrier per stage, 2 S x 8 bytes, not rounded.
        Nothing else: the wgmma accumulators are registers (`plgpu.ACC`), the kernel has no reduction (which
        would reserve Mosaic's reduction scratch) and no TMEM. benchmarks/diagnostics/fp8_gemm_configs.py records
        Mosaic's own count (`mosaic.lowered_smem_bytes`) beside this one; tests/kernels/fp8_gemm checks the two
        are equal."""
        s = self.stages if k_blocks is None else max(1, min(self.stages, k_blocks))
        sa_w, sw_w = scale_block_widths(self)
        r, c = self.out_tile()
        scratch = [s * self.tile_m * BLOCK, *[s * self.operand_rows * BLOCK] * self.n_operands, s * sa_w * 4,
                   *[s * sw_w * 4] * self.n_operands, self.compute_wgs * r * c * out_itemsize]
        return sum(smem_align(b) for b in scratch) + 2 * s * MBARRIER_BYTES


def scale_block_widths(config: Fp8GemmConfig) -> tuple[int, int]:
    """float32 widths of one stage's activation-scale block and of each weight operand's scale block. Every
    stage's buffer must start on a TMA_SMEM_ALIGN boundary, so each block is a multiple of 128 bytes: the
    activation block covers tile_m scales rounded up to 32 (a decode tile of 8 rows reads 24 scales past it, from
    padding), a weight block SCALE_REPEAT copies of each of the operand's `operand_blocks` scales."""
    per = TMA_SMEM_ALIGN // 4
    return round_up(config.tile_m, per), SCALE_REPEAT * config.operand_blocks


PREFILL = Fp8GemmConfig()
DECODE = Fp8GemmConfig(tile_m=16, tile_n=128, stages=6, swap_ab=True)
PREFILL_SWIGLU = Fp8GemmConfig(tile_n=256, stages=2, swiglu=True)  # 3 stages: 1.3-1.4x slower (H100, H200)
PREFILL_SWIGLU_NARROW = Fp8GemmConfig(tile_n=128, stages=4, swiglu=True)  # 64 gate + 64 up columns a tile
#: The routed experts' prompt-step GEMMs (`experts.expert_configs`, layout "grouped"): the narrow fused gate+up tile
#: and the plain 128 x 128 down tile, each CTA's tiles chained, the fastest of the launch-config sweep
#: (benchmarks/diagnostics/fp8_gemm_configs.py; BENCHMARKS.md, Experts and FP8 GEMMs).
EXPERTS_PREFILL_UP = Fp8GemmConfig(tile_n=128, stages=4, swiglu=True, chain=True)
EXPERTS_PREFILL_DOWN = Fp8GemmConfig(chain=True)
DECODE_SWIGLU = Fp8GemmConfig(tile_m=16, tile_n=256, stages=4, swap_ab=True, swiglu=True)
