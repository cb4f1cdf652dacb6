"""Helpers shared by the Pallas Mosaic GPU kernels: their Lane code (code run inside `plgpu.inline_mgpu`) and Mosaic
GPU's shared-memory accounting."""

from __future__ import annotations

import re
from typing import Any, Callable

# Mosaic GPU's shared-memory accounting (jax 0.11.2): each allocation rounded up to SMEM_ALIGNMENT bytes
# (jax/_src/pallas/mosaic_gpu/core.py), MBARRIER_BYTES an mbarrier (jax/experimental/mosaic/gpu/utils.py)
SMEM_ALIGNMENT = 1024
MBARRIER_BYTES = 8
SMEM_LIMIT = 232448  # shared memory one CTA may take on Hopper (H100, H200: Mosaic GPU's max_smem_bytes)


def round_up(n: int, to: int) -> int:
    """n rounded up to a multiple of `to` (tile, block and alignment sizes)."""
    return -(-n // to) * to


def smem_align(n: int) -> int:
    """n bytes rounded up to Mosaic GPU's SMEM_ALIGNMENT."""
    return round_up(n, SMEM_ALIGNMENT)


def lowered_smem_bytes(lower: Callable[[], Any], what: str) -> int:
    """Mosaic GPU's own count of a kernel's shared memory (bytes a CTA): `lower()` lowers it for CUDA (no device
    needed, e.g. `jitted.trace(*shapes).lower(lowering_platforms=("cuda",))`) under an artificial limit of 0 bytes,
    whose error names the count. ValueError naming `what` when the lowering fails otherwise."""
    from jax.experimental.mosaic.gpu import core as mgpu_core
    try:
        with mgpu_core.artificial_shared_memory_limit(0):
            lower()
    except Exception as e:  # noqa: BLE001  the expected exit: over the limit of 0 bytes
        hit = re.search(r"smem_bytes=(\d+)", str(e))
        if hit:
            return int(hit.group(1))
        raise ValueError(f"{what}: lowering for CUDA failed: {type(e).__name__}: {e}") from e
    raise ValueError(f"{what}: lowering under a shared-memory limit of 0 did not fail")


def ptx(text: str) -> None:
    """One PTX statement with side effects and no operands (e.g. "cp.async.wait_group 0;")."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    mgpu_utils.inline_ptx(text, has_side_effects=True)


def wait_async_copies(pending: int) -> None:
    """Warpgroup code: each thread waits until at most `pending` of its committed cp.async groups are in flight."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    plgpu.inline_mgpu()(lambda ctx: ptx(f"cp.async.wait_group {pending};"))()
