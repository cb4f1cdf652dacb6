"""Helpers shared by the Pallas Mosaic GPU kernels' Lane code (code run inside `plgpu.inline_mgpu`)."""

from __future__ import annotations


def ptx(text: str) -> None:
    """One PTX statement with side effects and no operands (e.g. "cp.async.wait_group 0;")."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    mgpu_utils.inline_ptx(text, has_side_effects=True)


def wait_async_copies(pending: int) -> None:
    """Warpgroup code: each thread waits until at most `pending` of its committed cp.async groups are in flight."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    plgpu.inline_mgpu()(lambda ctx: ptx(f"cp.async.wait_group {pending};"))()
