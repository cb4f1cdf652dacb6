"""Sparse MLA attention (docs/math.md §5): absorbed query rows against selected rows of the paged MLA cache.

q [T, H, R + Dr] attends cache rows [kv (R) | k_pe (Dr)] at `indices` [T, K] (physical slots, -1 = none);
the value of a row is its kv latent. Returns o [T, H, R] float32 and lse [T, H] (natural log), with
(0, -inf) for a row that has no valid index: the identity of `merge_partials`.
"""

from __future__ import annotations

from .. import registry
from .reference import ROW_CHUNK, sparse_mla_xla  # noqa: F401 (ROW_CHUNK: the xla form's default)


def sparse_mla(q, cache, indices, *, scale: float, kv_lora_rank: int, impl: str = "xla", **kernel_options):
    """o [T, H, R] float32, lse [T, H] for query rows `q` [T, H, R + Dr] against `cache` (bf16 [slots, R + Dr]
    or fp8_ds_mla uint8 [slots, mla_row_bytes]) at `indices` [T, K] (physical slots, -1 = none).

    impl (`kernels.registry`): "xla" (the oracle, CPU default), "triton" (Pallas Triton), "mosaic" (the
    warp-specialised Pallas Mosaic GPU kernel: H <= 64, bf16 or fp8_ds_mla), "triton_interpret" /
    "mosaic_interpret" (those kernels run by the Pallas interpreter: CPU tests), "auto" (the GPU default:
    `choose_impl`). `kernel_options` go to the kernel (`triton.sparse_mla_triton`: config, block_h,
    block_k, n_split, num_warps, num_stages, return_partials; `mosaic.sparse_mla_mosaic`: config and
    its fields, return_partials); the xla form takes `row_chunk`.
    """
    return registry.dispatch("sparse_mla", impl, q, cache, indices, scale=scale, kv_lora_rank=kv_lora_rank,
                             **kernel_options)


def choose_impl(platform: str, q, cache, indices, *, scale: float, kv_lora_rank: int, **kernel_options) -> str:
    """Mosaic where it takes the inputs, else Triton (also when Triton launch options are given); xla off the GPU.

    The Mosaic kernel was measured faster than the Triton one for both cache formats from one query row
    (BENCHMARKS.md, sparse MLA)."""
    if platform != "gpu":
        return "xla"
    if (not kernel_options and q.shape[0] >= 1
            and registry.takes("sparse_mla", "mosaic", q, cache, indices, kv_lora_rank=kv_lora_rank)):
        return "mosaic"
    return "triton"


registry.register("sparse_mla", "xla", sparse_mla_xla)
registry.register_triton("sparse_mla", "kernels.sparse_mla.triton:sparse_mla_triton",
                         supports="kernels.sparse_mla.triton:supports")
# batch-invariant mode keeps `choose_impl`'s choice: it reads the head count, cache format and options, never the
# rows. The kernels' split counts come from `registry.config_rows`: decode steps fix them for INVARIANT_CONFIG_ROWS
# rows (2 splits of the Mosaic kernel), prompt steps take the default's for their static rows (one split a row at
# 8192 rows); either way one count per step shape, each row's keys in index order within a split and the splits
# merged in split order, so a row's output does not depend on the other rows
registry.register_auto("sparse_mla", choose_impl, invariant=registry.ROW_FREE)
registry.register_mosaic("sparse_mla", "kernels.sparse_mla.mosaic:sparse_mla_mosaic",
                         supports="kernels.sparse_mla.mosaic:supports")
