"""Random HF checkpoints of any geometry, written tensor by tensor in bounded memory.

Each tensor is drawn from its own generator, seeded by (seed, HF key), so its values do not depend on the
sharding or on which other tensors exist. Init keeps a model numerically sane for tests: linear weights
N(0, 0.02), the embedding N(0, 1), norm weights 1 + N(0, 0.02), the indexer's k_norm bias and the router's
correction bias N(0, 0.02). From the command line: `python -m glm_dsa random-checkpoint`.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tqdm import tqdm

from .layout import param_specs
from .mtp_layout import mtp_param_specs
from .safetensors_io import INDEX, SINGLE, CheckpointError, SafetensorsFile, as_dtype
from .writer import write_hf_tensors

_CHUNK = 1 << 22  # values per draw: each worker thread holds one float32 chunk (16 MiB) of scratch
_THREADS = min(16, os.cpu_count() or 1)
#: the header metadata of every file `write_random_checkpoint` writes: what tells one of its checkpoints (which
#: `random-checkpoint` may replace) from any other HF checkpoint (which it replaces only with --overwrite)
MARK = {"format": "pt", "writer": "glm_dsa random-checkpoint"}


def init_stats(param_path: str) -> tuple[float, float]:
    """(mean, std) of the normal a parameter is drawn from, by its path."""
    name = param_path.rsplit(".", 1)[-1]
    if name == "embed":
        return 0.0, 1.0
    if name.endswith("norm") or name == "k_norm_w":
        return 1.0, 0.02
    return 0.0, 0.02  # linear weights, k_norm_b, router_bias


def random_tensor(key: str, shape: tuple[int, ...], mean: float, std: float, dtype, seed: int = 0) -> np.ndarray:
    """mean + std * N(0, 1) in `dtype`, reproducible from (seed, key).

    Drawn in fixed chunks of `_CHUNK` values, chunk i from a generator seeded by (seed, crc32(key), i), filled
    by a few threads at once (numpy's generators release the GIL): the values do not depend on the thread
    count, and scratch memory is bounded whatever the tensor's size.
    """
    out = np.empty(shape, as_dtype(dtype))
    flat = out.reshape(-1)
    base = [seed, zlib.crc32(key.encode())]

    def fill(i: int) -> None:
        start = i * _CHUNK
        draw = np.random.default_rng(base + [i]).standard_normal(min(_CHUNK, flat.size - start), dtype=np.float32)
        draw *= np.float32(std)
        draw += np.float32(mean)
        flat[start:start + draw.size] = draw

    n = -(-flat.size // _CHUNK)
    if n <= 1 or _THREADS == 1:
        for i in range(n):
            fill(i)
    else:
        with ThreadPoolExecutor(min(n, _THREADS)) as pool:
            list(pool.map(fill, range(n)))
    return out


def write_random_checkpoint(cfg, path: str | os.PathLike, *, seed: int = 0, dtype="bfloat16",
                            max_shard_bytes: int | None = None, progress: bool = True, with_mtp: bool = False,
                            mtp_shared_head: bool = True) -> list[str]:
    """Write a random HF checkpoint (safetensors + `config.json`) for `cfg` to the directory `path`.

    Weights are stored in `dtype`, except the parameters the layout keeps in float32, stored as float32.
    Memory holds one HF tensor at a time whatever the file layout. `max_shard_bytes` None writes one
    `model.safetensors`; a limit writes shards plus an index. Returns the safetensors file names written.
    Over an existing checkpoint the write is staged and committed (`checkpoints.writer`): interrupted, it leaves
    the old checkpoint readable. Raises `CheckpointError` if `path` is a file. `with_mtp` adds the nextn layer
    `model.layers.{L}.*` (`checkpoints.mtp_layout`; `mtp_shared_head` False leaves out its shared_head.head, as
    some releases do).
    """
    dtype = as_dtype(dtype)
    todo: dict[str, tuple[tuple[int, ...], np.dtype, tuple[float, float]]] = {}
    specs = dict(param_specs(cfg))
    if with_mtp:
        specs.update(mtp_param_specs(cfg, shared_head=mtp_shared_head))
    for p, spec in specs.items():
        for key, shape in zip(spec.hf_keys, spec.hf_shapes):
            todo.setdefault(key, (tuple(shape), np.dtype(np.float32) if spec.fp32 else dtype, init_stats(p)))

    def tensors():
        for key, (shape, dt, (mean, std)) in tqdm(todo.items(), desc="random weights", unit="tensor",
                                                  disable=not progress):
            yield key, random_tensor(key, shape, mean, std, dt, seed)

    return write_hf_tensors(path, [(k, dt, shape) for k, (shape, dt, _) in todo.items()], tensors(),
                            max_shard_bytes=max_shard_bytes, extra=cfg.save_pretrained, metadata=MARK)


def is_random_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the directory `path` holds a checkpoint `write_random_checkpoint` wrote (its live safetensors file,
    the index's first shard or model.safetensors, carries `MARK`)."""
    import json
    path = os.fspath(path)
    try:
        if os.path.isfile(os.path.join(path, INDEX)):
            with open(os.path.join(path, INDEX)) as f:
                first = sorted(set(json.load(f)["weight_map"].values()))[0]
        else:
            first = SINGLE
        return SafetensorsFile(os.path.join(path, first)).metadata.get("writer") == MARK["writer"]
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, CheckpointError):
        return False
