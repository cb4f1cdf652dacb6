"""Ops of one GLM-5.2 layer, one module per op: a plain-jnp reference (`impl="xla"`) and, where landed, a
Pallas kernel, behind one dispatcher. Arrays in, arrays out: nothing here knows the model or the mesh.

Modules: `fused_norm_rope` (q/kv norm + RoPE + paged cache write), `indexer` (scores + top-k),
`sparse_mla` (attention over selected cache rows -> (o, lse)), `moe` (routed SwiGLU experts), `lse_merge`,
`rope`, `norms`.
"""

from . import chunking, fused_norm_rope, indexer, lse_merge, moe, norms, rope, sparse_mla

IMPLS = ("xla", "triton", "triton_interpret")


def default_impl() -> str:
    """Pallas Triton kernels on NVIDIA GPUs, the plain-XLA references elsewhere."""
    import jax
    return "triton" if jax.default_backend() == "gpu" else "xla"


__all__ = ["IMPLS", "default_impl", "chunking", "fused_norm_rope", "indexer", "lse_merge", "moe", "norms", "rope", "sparse_mla"]
