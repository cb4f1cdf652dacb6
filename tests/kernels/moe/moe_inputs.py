"""Random inputs shared by the MoE kernel tests (imported by name: pytest puts this folder on sys.path)."""

import numpy as np

from kernels import fp8_formats


def fp8_expert_stacks(rng, n_exp, d, i):
    """K-major FP8 stacks of block-quantised random weights, gate/up [E, I, D] and down [E, D, I] (the model's
    layout), with their scale grids: ([gate, up, down], [gate grid, up grid, down grid]). Each output row has its
    own magnitude (x0.2 to x3), so the blocks' scales differ; draws from `rng` in that order."""
    stacks, grids = [], []
    for n, kk in ((i, d), (i, d), (d, i)):
        w = rng.normal(size=(n_exp, n, kk)) * rng.uniform(0.2, 3.0, size=(n_exp, n, 1)) / np.sqrt(kk)
        q, s = fp8_formats.quantize_weight_blocks(w)
        stacks.append(q)
        grids.append(s)
    return stacks, grids
