"""Fused q/kv norm + RoPE + paged cache write, one op per layer (docs/math.md §4).

Per token row:
  (a) q RMSNorm, ALWAYS, whatever the slot;
  (b) slot < 0: no MLA cache write and no indexer cache write for that row;
  (c) kv RMSNorm + rope(k_pe) -> MLA cache row [kv | k_pe] at the slot;
  (d) full layers: indexer key LayerNorm + rope on its first dims -> indexer cache at its own slot
      (defaults to the MLA slot);
  (e) full layers: the top-k buffer is reset to -1; shared layers leave it as it is.
Skipping (a) for non-owned rows is the DCP bug this op exists to prevent.
"""

from __future__ import annotations

from .. import registry
from .reference import QKV_NORM_EPS, fused_norm_rope_cache_xla


def fused_norm_rope_cache(q_c, kv_c, positions, slot_mapping, q_norm_w, kv_norm_w, mla_cache, *,
                          rope_theta, rope_interleave: bool = True, eps: float = QKV_NORM_EPS,
                          index_k=None, index_norm_w=None, index_norm_b=None, index_cache=None,
                          index_slot_mapping=None, index_rope_interleave: bool = True, topk_buf=None,
                          impl: str = "xla", block_size=None, **triton_options):
    """Normalise q, write this step's kv (and indexer key) rows into the paged caches.

    q_c [T, Rq] (q_a_proj output), kv_c [T, R + Dr] (kv_a_proj output), positions [T], slot_mapping [T]
    (-1 = write nothing), norm weights, mla_cache [slots, R + Dr]. Full layers also pass index_k [T, Di]
    (wk output, before LayerNorm), its LayerNorm weight/bias, index_cache [slots, Di], optionally their
    own index_slot_mapping and the top-k buffer to clear. Returns (q_normed, mla_cache, index_cache, topk_buf).

    Cache formats (docs/math.md §3): a uint8 mla_cache holds fp8_ds_mla rows ([slots, mla_row_bytes(R, Dr)]), a
    uint8 index_cache FP8 keys + UE8M0 scale ([slots, Di + 4]); see `kernels.common.fp8_formats`. Any other dtype
    holds the rows cast to it. Caches may also be [pages, page_rows, pitch] with slot = page * block_size +
    offset (block_size <= page_rows, default page_rows) and pitch >= the row width: padding is untouched.

    impl (`kernels.registry`): "xla" (the oracle above), "triton" (the Pallas Triton kernel
    `kernels.fused_norm_rope.triton`, caches aliased input -> output: donate them (jit donate_argnums) and they are
    updated in place), "triton_interpret" (that kernel under the Pallas interpreter: CPU tests).
    "auto" (the GPU default) is the Triton kernel on a GPU and the xla form elsewhere.
    `triton_options` go to the kernel: config or its fields (`config.FusedNormRopeConfig`:
    layout, q_rows, cache_rows, num_warps, num_stages, q_programs, cache_programs, q_warps).
    """
    return registry.dispatch(
        "fused_norm_rope", impl, q_c, kv_c, positions, slot_mapping, q_norm_w, kv_norm_w, mla_cache,
        rope_theta=rope_theta, rope_interleave=rope_interleave, eps=eps, index_k=index_k, index_norm_w=index_norm_w,
        index_norm_b=index_norm_b, index_cache=index_cache, index_slot_mapping=index_slot_mapping,
        index_rope_interleave=index_rope_interleave, topk_buf=topk_buf, block_size=block_size, **triton_options)


registry.register("fused_norm_rope", "xla", fused_norm_rope_cache_xla)
registry.register_triton("fused_norm_rope", "kernels.fused_norm_rope.triton:fused_norm_rope_cache_triton",
                         supports="kernels.fused_norm_rope.triton:supports")
registry.register_auto("fused_norm_rope")
