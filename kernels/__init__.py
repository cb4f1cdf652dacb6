"""Ops of one GLM-5.2 layer, one package per op, behind one dispatch rule (`kernels.registry`). Arrays in, arrays
out: nothing here knows the model or the mesh.

Ops: `fused_norm_rope` (q/kv norm + RoPE + paged cache write), `indexer` (scores + top-k, the op "topk"),
`sparse_mla` (attention over selected cache rows -> (o, lse)), `moe` (routed SwiGLU experts, bf16 or FP8
block-scaled weights), `fp8_linear` (a linear layer over FP8 block-scaled weights: W8A16 or W8A8), `lse_merge`.
Each package: `__init__` (the public function, its checks, the impls and rules it registers), `reference.py` (the
plain-jnp oracle, impl "xla"), `triton.py` / `mosaic.py` (the Pallas Triton / Mosaic GPU kernels and their frozen
launch configs, imported on first use of their impl), and what only that op needs (`indexer/config.py`,
`indexer/stages.py`, `indexer/topk_triton.py`, `moe/tiles.py`). `kernels.common`: the helpers
shared by the ops (`norms`, `rope`, `chunking`, `fp8_formats` with the FP8 block codec, `triton_common`,
`mosaic_common`).
"""

from . import registry
from .common import chunking, fp8_formats, norms, rope
from . import fp8_linear, fused_norm_rope, indexer, lse_merge, moe, sparse_mla

IMPLS = ("xla", "triton", "triton_interpret", "auto")  # every op's impls ("mosaic": sparse_mla, indexer, moe,
# fp8_linear; the op "fp8_swiglu", a SwiGLU MLP's FP8 gate and up, has "xla" and "mosaic" only)


def default_impl() -> str:
    """"auto" on NVIDIA GPUs (each op picks its fastest kernel per shape, `registry.register_auto`), the
    plain-XLA references elsewhere."""
    return "auto" if registry.platform() == "gpu" else "xla"


def _cache_offsets(platform: str, impl: str) -> str:
    """"int32" where a Triton kernel may read the caches (impl "triton", or "auto" on a GPU), else "int64".

    The Pallas Triton kernels address a cache with 32-bit offsets, so under "int32" a layer's cache must stay
    under 2 GiB (the engine caps its pages)."""
    return "int32" if impl == "triton" or (impl == "auto" and platform == "gpu") else "int64"


registry.register_rule("cache_offsets", "cache", _cache_offsets, ("int32", "int64"), invariant=registry.ROW_FREE)


__all__ = ["IMPLS", "default_impl", "chunking", "fp8_formats", "fp8_linear", "fused_norm_rope", "indexer",
           "lse_merge", "moe", "norms", "registry", "rope", "sparse_mla"]
