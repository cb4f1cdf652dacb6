"""Merge partial attention results by their log-sum-exp (docs/math.md §6): the identity of a split is (0, -inf)."""

from __future__ import annotations

from .. import registry
from .reference import merge_partials, merge_splits_xla  # noqa: F401 (merge_partials: the DCP merge)


def merge_splits(o, lse, *, impl: str = "xla", **kernel_options):
    """The merge of split-K partials o [N, T, H, R] / lse [N, T, H] over N (the attention kernels' second step):
    (o [T, H, R] float32, lse [T, H]). impl (`kernels.registry`): "xla" (`merge_partials(axis=0)`, the oracle),
    "triton" / "triton_interpret" (one Pallas Triton launch, `kernels.lse_merge.triton`; `kernel_options` are its
    launch fields), "auto" (the kernel on a GPU where it takes the partials, else xla)."""
    return registry.dispatch("lse_merge", impl, o, lse, **kernel_options)


def choose_impl(platform: str, o, lse, **kernel_options) -> str:
    """The Triton merge on a GPU where it takes the partials (one launch against XLA's five passes), else xla."""
    if platform != "gpu":
        return "xla"
    return "triton" if registry.takes("lse_merge", "triton", o, lse) else "xla"


registry.register("lse_merge", "xla", merge_splits_xla)
registry.register_triton("lse_merge", "kernels.lse_merge.triton:merge_partials_triton",
                         supports="kernels.lse_merge.triton:supports")


def choose_invariant(platform: str, o, lse, **kernel_options) -> str:
    """Batch-invariant decode steps: the xla merge for every shape (each row's splits in index order, nothing
    across rows), not the kernel whose support depends on the shape.

    Prompt steps take the default (`registry.DEFAULT`: the Triton merge where it takes the partials, by their
    static shape): one program per (row, head block, column block), each row's splits weighted and summed in
    split order, nothing across rows. (The model's attention kernels run the merge by impl name, not through
    this rule.)"""
    del platform, o, lse, kernel_options
    return "xla"


registry.register_auto("lse_merge", choose_impl, invariant=choose_invariant, invariant_prompt=registry.DEFAULT)
