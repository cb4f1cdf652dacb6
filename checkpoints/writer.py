"""Write parameters as an HF safetensors checkpoint: one file, or an index and shards (SPEC §8).

Tensors are streamed: every file's header is planned from shapes and dtypes alone, then tensors are produced
and written one at a time, so memory holds one tensor, not a file's worth. Each file is written under a
temporary name and renamed when complete; the index, written last, commits a sharded checkpoint.
"""

from __future__ import annotations

import os
import re
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from .layout import param_specs
from .safetensors_io import INDEX, SINGLE, CheckpointError, SafetensorsWriter, write_json_atomic

Entry = tuple[str, np.dtype, tuple[int, ...]]  # HF key, dtype, shape
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")


def _nbytes(entry: Entry) -> int:
    return int(np.prod(entry[2], dtype=np.int64)) * np.dtype(entry[1]).itemsize


def plan_shards(entries: list[Entry], max_shard_bytes: int | None) -> list[list[Entry]]:
    """Split entries, in order, into files of at most `max_shard_bytes` of tensor data each.

    A tensor larger than the limit gets a file of its own; None puts everything in one file.
    """
    groups: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        n = _nbytes(e)
        if max_shard_bytes is not None and groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += n
    return groups


def write_hf_tensors(path: str | os.PathLike, entries: Iterable[Entry], tensors: Iterable[tuple[str, np.ndarray]],
                     *, max_shard_bytes: int | None = None) -> list[str]:
    """Write HF tensors to the directory `path`; returns the file names written.

    `entries` lists every tensor (key, dtype, shape) in order; `tensors` then yields (key, array) in the same
    order, lazily. One file `model.safetensors` if everything fits in `max_shard_bytes` (or it is None), else
    shards `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`. Checkpoint files of an
    earlier save in the directory that the new one does not use are removed once it is complete.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    groups = plan_shards([(k, np.dtype(d), tuple(s)) for k, d, s in entries], max_shard_bytes)
    n = len(groups)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    index = os.path.join(path, INDEX)
    if n > 1 and os.path.exists(index):
        os.unlink(index)  # shards are about to be replaced: never leave an old index over new shards
    it: Iterator[tuple[str, np.ndarray]] = iter(tensors)
    for name, group in zip(names, groups):
        with SafetensorsWriter(os.path.join(path, name), group) as w:
            for key, _, _ in group:
                try:
                    got, array = next(it)
                except StopIteration:
                    raise CheckpointError(f"ran out of tensors before '{key}' while writing {path}") from None
                w.write(got, array)
    for got, _ in it:  # also lets a generator run to its end (and close its progress bar)
        raise CheckpointError(f"tensor '{got}' is not among the entries to write to {path}")
    if n > 1:
        weight_map = {k: name for name, group in zip(names, groups) for k, _, _ in group}
        total = sum(_nbytes(e) for group in groups for e in group)
        write_json_atomic(index, {"metadata": {"total_size": total}, "weight_map": weight_map})
    keep = set(names) | ({INDEX} if n > 1 else set())
    for old in os.listdir(path):
        if old not in keep and (old in (SINGLE, INDEX) or _SHARD.fullmatch(old)):
            os.unlink(os.path.join(path, old))
    return names


def save_hf_params(params: dict, cfg, path: str | os.PathLike, *, max_shard_bytes: int | None = None,
                   progress: bool = False) -> None:
    """Save our flat parameters {path: numpy or jax array} as an HF checkpoint directory, plus `config.json`.

    Each tensor keeps its array's dtype. With tied embeddings `lm_head` shares `embed`'s key and is not
    written again. `max_shard_bytes` as in `write_hf_tensors`. Raises `CheckpointError` naming a missing,
    unknown or misshapen parameter before writing anything.
    """
    specs = param_specs(cfg)
    missing = [p for p in specs if p not in params]
    extra = [p for p in params if p not in specs]
    if missing or extra:
        raise CheckpointError(f"cannot save: missing parameters {missing[:5]}, unknown parameters {extra[:5]}")
    for p, spec in specs.items():
        if tuple(params[p].shape) != spec.shape:
            raise CheckpointError(f"cannot save parameter '{p}': shape {list(params[p].shape)}, "
                                  f"expected {list(spec.shape)}")
    entries: dict[str, Entry] = {}
    for p, spec in specs.items():
        for key, shape in zip(spec.hf_keys, spec.hf_shapes):
            entries.setdefault(key, (key, np.dtype(params[p].dtype), shape))

    def tensors():
        done = set()
        for p, spec in tqdm(specs.items(), desc="saving", unit="param", disable=not progress):
            if all(k in done for k in spec.hf_keys):
                continue
            for key, t in zip(spec.hf_keys, spec.to_hf(np.asarray(params[p]))):
                if key not in done:
                    done.add(key)
                    yield key, t

    write_hf_tensors(path, entries.values(), tensors(), max_shard_bytes=max_shard_bytes)
    cfg.save_pretrained(path)
