"""W8A8 grouped GEMM (SPEC §11) for the FP8 experts: e4m3 x e4m3 on Hopper's fp8 tensor cores.

`grouped_matmul(a_q, a_scale, w_q, w_scale, tile_group, impl=...)`: impl "xla" (`reference.grouped_matmul_xla`),
"mosaic" (`mosaic.grouped_matmul_mosaic`, Pallas Mosaic GPU) or "mosaic_interpret" (that kernel under the
Pallas GPU interpreter); swiglu configs take (gate, up) pairs of weights and scales. `quantize_rows` quantises
activations per row per 128 channels; `group_layout` places groups of rows on tile boundaries. The routed experts
over it (`experts.routed_experts`) are the MoE impl "mosaic" (`kernels.moe`, form "w8a8_mosaic").
"""

from __future__ import annotations

import jax.numpy as jnp

from .config import DECODE, DECODE_SWIGLU, PREFILL, PREFILL_SWIGLU, PREFILL_SWIGLU_NARROW, Fp8GemmConfig
from .reference import (group_layout, grouped_matmul_xla, oracle, quantize_rows, quantize_rows_barrier, row_groups,
                        silu_mul)

IMPLS = ("xla", "mosaic", "mosaic_interpret")


def grouped_matmul(a_q, a_scale, w_q, w_scale, tile_group, *, impl: str = "xla", config: Fp8GemmConfig = PREFILL,
                   out_dtype=jnp.bfloat16):
    """out_dtype [M, N] = the W8A8 grouped product (swiglu configs: silu(gate) * up, w_q and w_scale pairs; see
    `mosaic.grouped_matmul_mosaic` for the operands); config.tile_m is the row tile of `tile_group` for every
    impl."""
    if impl == "xla":
        from .mosaic import check_operands
        w_q, w_scale = check_operands(a_q, a_scale, w_q, w_scale, tile_group, config)
        return grouped_matmul_xla(a_q, a_scale, w_q if config.swiglu else w_q[0],
                                  w_scale if config.swiglu else w_scale[0], tile_group, tile_m=config.tile_m,
                                  out_dtype=out_dtype, swiglu=config.swiglu)
    if impl in ("mosaic", "mosaic_interpret"):
        from .mosaic import grouped_matmul_mosaic
        return grouped_matmul_mosaic(a_q, a_scale, w_q, w_scale, tile_group, config=config, out_dtype=out_dtype,
                                     interpret=impl == "mosaic_interpret")
    raise ValueError(f"fp8_gemm.grouped_matmul: unknown impl {impl!r} (available: {', '.join(IMPLS)})")


__all__ = ["DECODE", "DECODE_SWIGLU", "PREFILL", "PREFILL_SWIGLU", "PREFILL_SWIGLU_NARROW", "Fp8GemmConfig",
           "group_layout", "grouped_matmul", "grouped_matmul_xla", "oracle", "quantize_rows", "quantize_rows_barrier",
           "row_groups", "silu_mul", "IMPLS"]
