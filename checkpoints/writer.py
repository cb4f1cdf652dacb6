"""Write parameters as an HF safetensors checkpoint: one file, or an index and shards (docs/math.md §8).

Tensors are streamed: every file's header is planned from shapes and dtypes alone, then tensors are produced
and written one at a time, so memory holds one tensor, not a file's worth.

A write is staged and committed, so that a directory being overwritten holds, at every instant, either the
complete old checkpoint or the complete new one (as `HFCheckpoint` reads it: the index and the shards it
names if there is an index, else `model.safetensors`). Every new file (shards, index, config.json) is first
written to the hidden `PATH/.staging-PID/`; then, by renames inside PATH:

1. if a new shard would take the name of a shard the live index reads (same shard count), those old shards
   get second names (hard links `.old-PID.model-...`) and the live index is atomically replaced by one naming
   those: still the old checkpoint, now reading no name the new one takes;
2. the new safetensors files are renamed in (the live index does not read them; a new `model.safetensors`
   replacing an old one is itself the atomic switch);
3. the commit: the new index is renamed over the old one (sharded), or the old index is removed (one file);
4. config.json (and any extra file) follows, then files of the old checkpoint are removed.

A writer killed on the way leaves the old checkpoint readable plus leftovers (its staging directory, `.tmp-PID`
files, `.old-PID.*` links), which the next write removes once their writer's process is gone and no live index
reads them. One file's config.json is moved in right after the tensors' commit, not in the same rename.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Callable, Iterable, Iterator

import numpy as np
from tqdm import tqdm

from .layout import param_specs
from .safetensors_io import (INDEX, SINGLE, CheckpointError, SafetensorsWriter, fsync_dir, pid_alive,
                             write_json_atomic)

Entry = tuple[str, np.dtype, tuple[int, ...]]  # HF key, dtype, shape
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")
_STAGING = re.compile(r"\.staging-(\d+)")  # a write in progress (or killed): PATH/.staging-PID/
_TMP = re.compile(r"\..+\.tmp-(\d+)")  # a file being written under a temporary name by process PID
_OLD = re.compile(r"\.old-(\d+)\.(.+\.safetensors)")  # a second name keeping a replaced shard readable (step 1)


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


def check_hf_target(path: str | os.PathLike) -> None:
    """Raise `CheckpointError` if `path` cannot be an HF checkpoint directory (it exists and is not a directory)."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file, not a checkpoint directory: give a directory to write to")


def _live_files(path: str) -> set[str]:
    """The file names the checkpoint in `path` is read from now: the index and its shards, or the one file."""
    if os.path.exists(os.path.join(path, INDEX)):
        try:
            with open(os.path.join(path, INDEX)) as f:
                weight_map = json.load(f).get("weight_map", {})
            return {INDEX} | {v for v in weight_map.values() if isinstance(v, str)}
        except (OSError, ValueError, AttributeError):  # a corrupt index: no readable old checkpoint to keep
            return {INDEX}
    return {SINGLE} if os.path.exists(os.path.join(path, SINGLE)) else set()


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _clean_leftovers(path: str) -> None:
    """Remove what writers of `path` that are gone left behind: staging directories, temporary files, and second
    names of old shards that the live index no longer reads."""
    live = _live_files(path)
    for name in os.listdir(path):
        m = _STAGING.fullmatch(name) or _TMP.fullmatch(name) or _OLD.fullmatch(name)
        if m is None or name in live:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or not pid_alive(pid):
            _remove(os.path.join(path, name))


def _link_or_copy(src: str, dst: str) -> None:
    _remove(dst)
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links: a copy keeps the old shard readable just as well
        shutil.copyfile(src, dst)


def _commit(path: str, stage: str, names: list[str]) -> None:
    """Move the complete new checkpoint staged in `stage` into `path` (steps 1-4 of the module doc)."""
    sharded = os.path.exists(os.path.join(stage, INDEX))
    live = _live_files(path)
    index = os.path.join(path, INDEX)
    if INDEX in live:
        taken = sorted(set(names) & (live - {INDEX}))
        if taken:  # step 1: the live index reads names the new files take; give it second names to read
            with open(index) as f:
                doc = json.load(f)
            renamed = {n: f".old-{os.getpid()}.{n}" for n in taken}
            for old, new in renamed.items():
                _link_or_copy(os.path.join(path, old), os.path.join(path, new))
            doc["weight_map"] = {k: renamed.get(v, v) for k, v in doc["weight_map"].items()}
            fsync_dir(path)
            write_json_atomic(index, doc)
    for name in names:  # step 2
        os.replace(os.path.join(stage, name), os.path.join(path, name))
    fsync_dir(path)
    if sharded:  # step 3: the commit
        os.replace(os.path.join(stage, INDEX), index)
    elif os.path.exists(index):
        os.unlink(index)
    fsync_dir(path)
    for name in sorted(os.listdir(stage)):  # step 4: config.json and other extra files
        os.replace(os.path.join(stage, name), os.path.join(path, name))
    keep = set(names) | ({INDEX} if sharded else set())
    for name in os.listdir(path):
        if name not in keep and (name in (SINGLE, INDEX) or _SHARD.fullmatch(name) or _OLD.fullmatch(name)):
            _remove(os.path.join(path, name))


def write_hf_tensors(path: str | os.PathLike, entries: Iterable[Entry], tensors: Iterable[tuple[str, np.ndarray]],
                     *, max_shard_bytes: int | None = None,
                     extra: Callable[[str], None] | None = None,
                     metadata: dict[str, str] | None = None) -> list[str]:
    """Write HF tensors to the directory `path`; returns the file names written.

    `entries` lists every tensor (key, dtype, shape) in order; `tensors` then yields (key, array) in the same
    order, lazily. One file `model.safetensors` if everything fits in `max_shard_bytes` (or it is None), else
    shards `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`. `extra(directory)` writes
    other files of the checkpoint (config.json, tokenizer) into the directory it is given; they are staged and
    moved in with the tensors. `metadata`: every file's header `__metadata__` (default {"format": "pt"}).
    Over an existing checkpoint the write is staged and committed (module doc): if it
    fails or is killed, the old checkpoint stays readable as it was; once it is complete, checkpoint files of
    the earlier save that the new one does not use are removed. Raises `CheckpointError` if `path` is a file.
    """
    path = os.fspath(path)
    check_hf_target(path)
    os.makedirs(path, exist_ok=True)
    _clean_leftovers(path)
    groups = plan_shards([(k, np.dtype(d), tuple(s)) for k, d, s in entries], max_shard_bytes)
    n = len(groups)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    stage = os.path.join(path, f".staging-{os.getpid()}")
    try:
        _remove(stage)
        os.makedirs(stage)
        it: Iterator[tuple[str, np.ndarray]] = iter(tensors)
        for name, group in zip(names, groups):
            with SafetensorsWriter(os.path.join(stage, name), group, metadata) as w:
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
            write_json_atomic(os.path.join(stage, INDEX), {"metadata": {"total_size": total},
                                                           "weight_map": weight_map})
        if extra is not None:
            extra(stage)
        _commit(path, stage, names)
    finally:
        _remove(stage)
    return names


def save_hf_params(params: dict, cfg, path: str | os.PathLike, *, max_shard_bytes: int | None = None,
                   progress: bool = False) -> None:
    """Save our flat parameters {path: numpy or jax array} as an HF checkpoint directory, plus `config.json`.

    Each tensor keeps its array's dtype. With tied embeddings `lm_head` shares `embed`'s key and is not
    written again. `max_shard_bytes` as in `write_hf_tensors`. Raises `CheckpointError` naming a missing,
    unknown or misshapen parameter, or a `path` that is a file, before writing anything. Overwriting a
    checkpoint is staged and committed (see the module doc): interrupted, it leaves the old one readable.
    """
    check_hf_target(path)
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

    write_hf_tensors(path, entries.values(), tensors(), max_shard_bytes=max_shard_bytes, extra=cfg.save_pretrained)
