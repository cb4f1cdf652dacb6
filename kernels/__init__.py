"""Ops of one GLM-5.2 layer, one module per op: a plain-jnp reference (`impl="xla"`) and, where landed, a
Pallas kernel, behind one dispatch rule (`kernels.registry`). Arrays in, arrays out: nothing here knows the
model or the mesh.

Modules: `fused_norm_rope` (q/kv norm + RoPE + paged cache write), `indexer` (scores + top-k),
`sparse_mla` (attention over selected cache rows -> (o, lse)), `moe` (routed SwiGLU experts, bf16 or FP8
block-scaled weights), `fp8_linear` (a linear layer over FP8 block-scaled weights: W8A16 or W8A8), `lse_merge`,
`rope`, `norms`, `fp8_formats`, `chunking`. The Pallas Triton kernels (`*_triton`, helpers in
`triton_common`, MoE tile layout in `moe_tiles`) and the Pallas Mosaic GPU kernels (`sparse_mla_mosaic`,
`indexer_mosaic`, helpers in `mosaic_common`) are imported on first use of their impl; `indexer_stages` is the
indexer's scores -> top-k composition both its kernel impls share.
"""

from . import registry
from .common import chunking, fp8_formats, norms, rope
from . import fp8_linear, fused_norm_rope, indexer, lse_merge, moe, sparse_mla

IMPLS = ("xla", "triton", "triton_interpret", "auto")  # every op's impls ("mosaic": sparse_mla and indexer)


def default_impl() -> str:
    """"auto" on NVIDIA GPUs (each op picks its fastest kernel per shape, `registry.register_auto`), the
    plain-XLA references elsewhere."""
    return "auto" if registry.platform() == "gpu" else "xla"


def _cache_offsets(platform: str, impl: str) -> str:
    """"int32" where a Triton kernel may read the caches (impl "triton", or "auto" on a GPU), else "int64".

    The Pallas Triton kernels address a cache with 32-bit offsets, so under "int32" a layer's cache must stay
    under 2 GiB (the engine caps its pages)."""
    return "int32" if impl == "triton" or (impl == "auto" and platform == "gpu") else "int64"


registry.register_rule("cache_offsets", "cache", _cache_offsets, ("int32", "int64"))


__all__ = ["IMPLS", "default_impl", "chunking", "fp8_formats", "fp8_linear", "fused_norm_rope", "indexer",
           "lse_merge", "moe", "norms", "registry", "rope", "sparse_mla"]
