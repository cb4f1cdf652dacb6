"""The 128 x 128 block FP8 code of weight tensors on the host (numpy): quantise and dequantise (docs/math.md §11)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_BLOCK = 128  # FP8 releases: one `weight_scale_inv` per 128 x 128 block of a weight
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0


def quantize_blocks(w: np.ndarray, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """A 2-D weight -> (e4m3 values, float32 scale_inv per block) with `scale = amax(block) / 448`
    (1.0 for an all-zero block), so that `dequantize_blocks_np(*quantize_blocks(w))` ~= w."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_blocks: a 2-D weight is needed, got shape {list(w.shape)}")
    rows, cols = w.shape
    rb, cb = -(-rows // block), -(-cols // block)
    padded = np.zeros((rb * block, cb * block), np.float32)
    padded[:rows, :cols] = np.abs(w)
    amax = padded.reshape(rb, block, cb, block).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, block, axis=0), block, axis=1)[:rows, :cols]
    return (w / full).astype(E4M3), scale


def dequantize_blocks_np(w: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """Host reference: `w * scale_inv` per block of a 2-D weight, in float32 (edge blocks ragged)."""
    full = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block, axis=0), block, axis=1)
    return np.asarray(w).astype(np.float32) * full[: w.shape[0], : w.shape[1]]
