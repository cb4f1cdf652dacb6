"""FP8 block-scaled weights as the DeepSeek-V3 / GLM-5.x FP8 releases store them (docs/math.md §8), on the host.

A 2-D weight [rows, cols] becomes e4m3 values plus `weight_scale_inv` [ceil(rows / 128), ceil(cols / 128)]
(float32), one scale per 128 x 128 block, edge blocks ragged; the weight is `w8 * scale_inv`. The loader
dequantises such weights on the device (`checkpoints.loader`); this module quantises (to write FP8 test
checkpoints) and holds the numpy reference dequantisation.

    python -m checkpoints.fp8_blocks SRC_HF_DIR DST_HF_DIR     # an FP8 copy of an HF checkpoint
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Callable

import numpy as np

from kernels.common.fp8_formats import E4M3, dequantize_blocks_np
from kernels.common.fp8_formats import WEIGHT_BLOCK as FP8_BLOCK
from kernels.common.fp8_formats import quantize_blocks_np as quantize_blocks
from .loader import HFCheckpoint
from .safetensors_io import CheckpointError
from .writer import write_hf_tensors

SCALE_SUFFIX = "_scale_inv"
__all__ = ["E4M3", "dequantize_blocks_np", "is_fp8_weight_key", "quantize_blocks", "write_fp8_release"]


def is_fp8_weight_key(key: str) -> bool:
    """The tensors an FP8 release stores in e4m3: the decoder layers' linear weights (attention projections,
    indexer wq_b / wk, dense and expert MLPs); not embeddings, lm_head, norms, the router or weights_proj."""
    if not (key.startswith("model.layers.") and key.endswith(".weight")):
        return False
    skip = ("layernorm", "norm.", "mlp.gate.weight", "weights_proj", "k_norm")
    return not any(s in key for s in skip)


def write_fp8_release(src: str | os.PathLike, dst: str | os.PathLike, *,
                      quantize: Callable[[str], bool] = is_fp8_weight_key, max_shard_bytes: int | None = None,
                      block: int = FP8_BLOCK) -> list[str]:
    """Copy the HF checkpoint `src` to `dst` with every 2-D tensor `quantize(key)` selects stored as e4m3 plus its
    `<key>_scale_inv`; other tensors, `config.json` and any tokenizer files are copied unchanged. Streamed: one
    tensor in memory at a time. Returns the safetensors file names written."""
    ckpt = HFCheckpoint(src)
    keys = ckpt.keys()
    chosen = {k for k in keys if quantize(k) and len(ckpt.shape(k)) == 2}
    entries = []
    for k in keys:
        shape = ckpt.shape(k)
        if k in chosen:
            entries.append((k, E4M3, shape))
            entries.append((k + SCALE_SUFFIX, np.dtype(np.float32), tuple(-(-d // block) for d in shape)))
        else:
            entries.append((k, ckpt.dtype(k), shape))

    def tensors():
        for k in keys:
            if k in chosen:
                w8, scale = quantize_blocks(ckpt.raw(k), block)
                yield k, w8
                yield k + SCALE_SUFFIX, scale
            else:
                yield k, np.array(ckpt.raw(k))

    if not os.path.exists(os.path.join(ckpt.path, "config.json")):
        raise CheckpointError(f"{src} has no config.json to copy")

    def copy_json(directory: str) -> None:  # staged with the tensors, committed with them (checkpoints.writer)
        for extra in os.listdir(ckpt.path):
            if extra.endswith(".json") and not extra.startswith("model.safetensors"):
                shutil.copyfile(os.path.join(ckpt.path, extra), os.path.join(directory, extra))

    return write_hf_tensors(dst, entries, tensors(), max_shard_bytes=max_shard_bytes, extra=copy_json)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m checkpoints.fp8_blocks", description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    args = ap.parse_args(argv)
    names = write_fp8_release(args.src, args.dst)
    print(f"wrote {len(names)} FP8 block-scaled safetensors file(s) to {args.dst}")


if __name__ == "__main__":
    main()
