"""One safetensors file: a validated, memory-mapped reader and a streaming, atomic writer.

The format: an 8-byte little-endian header length N, N bytes of JSON (`{key: {dtype, shape, data_offsets}}` plus
an optional `__metadata__` of strings), then the data region, which the offsets (relative to its start) tile.
Parsing it here, rather than through the `safetensors` package, lets us validate a whole file before anything is
used, read BF16 / FP8 through `ml_dtypes`, and map the data so each tensor is read once, when it is needed.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Iterable

import ml_dtypes
import numpy as np

#: safetensors dtype names <-> numpy dtypes.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20  # the safetensors package refuses larger headers, too

#: File names of an HF checkpoint directory: one file, or an index naming shards `model-00001-of-00004...`.
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint is unreadable or does not match the model; the message names the file, key or parameter."""


def as_dtype(dtype) -> np.dtype:
    """A numpy dtype from a string ("bfloat16", "float32", "BF16"), a numpy / jnp dtype or a scalar type."""
    if isinstance(dtype, str):
        if dtype in DTYPES:
            return DTYPES[dtype]
        named = getattr(ml_dtypes, dtype, None)
        return np.dtype(named if named is not None else dtype)
    return np.dtype(dtype)


def dtype_name(dtype) -> str:
    """The safetensors name of a numpy dtype (`BF16`, `F32`, ...)."""
    try:
        return _NAMES[np.dtype(dtype)]
    except KeyError:
        raise CheckpointError(f"dtype {np.dtype(dtype)} cannot be stored in safetensors") from None


class SafetensorsFile:
    """A validated safetensors file whose tensors are read lazily from a read-only memory map.

    Opening it parses and checks the whole header: valid JSON, known dtypes, byte ranges that match each
    tensor's shape, do not overlap, and lie inside a data region that is exactly as long as they say (a
    truncated or padded file is refused). `shapes` and `dtypes` come from the header; `get` returns a
    zero-copy view of the mapped bytes.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}  # key -> dtype, shape, begin, end
        self.metadata: dict[str, str] = {}
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise self._error(f"is truncated ({size} bytes; a safetensors file starts with an 8-byte length)")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER:
                raise self._error(f"has a corrupt header (header length {n} bytes)")
            if 8 + n > size:
                raise self._error(f"is truncated (header of {n} bytes, file of {size})")
            self._parse_header(f.read(n))
            self.data_start = 8 + n
            data_size = size - self.data_start
            need = max((e[3] for e in self.entries.values()), default=0)
            if data_size < need:
                raise self._error(f"is truncated (data region is {data_size} bytes, the header needs {need})")
            if data_size > need:
                raise self._error(f"is corrupt ({data_size - need} bytes after the last tensor)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if need else None

    def _error(self, what: str) -> CheckpointError:
        return CheckpointError(f"safetensors file {self.path} {what}")

    def _parse_header(self, raw: bytes) -> None:
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._error(f"has a corrupt header (not JSON: {e})") from None
        if not isinstance(header, dict):
            raise self._error("has a corrupt header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        spans = []
        for key, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(info["shape"])
                begin, end = info["data_offsets"]
                ok = all(type(d) is int and d >= 0 for d in (*shape, begin, end))
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise self._error(f"has a corrupt header entry for tensor '{key}': {info!r}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if end - begin != nbytes:
                raise self._error(f"has a corrupt header: tensor '{key}' of dtype {info['dtype']} and shape "
                                  f"{list(shape)} needs {nbytes} bytes, its offsets span {end - begin}")
            self.entries[key] = (dtype, shape, begin, end)
            spans.append((begin, end, key))
        spans.sort()
        for (_, e0, k0), (b1, _, k1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise self._error(f"has a corrupt header: tensors '{k0}' and '{k1}' overlap")

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][1]

    def dtype(self, key: str) -> np.dtype:
        return self.entries[key][0]

    def get(self, key: str) -> np.ndarray:
        """Tensor `key` as a read-only array viewing the mapped file (no copy)."""
        dtype, shape, begin, end = self.entries[key]
        if end == begin:
            return np.zeros(shape, dtype)
        return np.frombuffer(self._map, dtype, count=(end - begin) // dtype.itemsize,
                             offset=self.data_start + begin).reshape(shape)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (a writer whose temporary files must not be cleaned away yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def _temp_name(path: str) -> str:
    d, name = os.path.split(path)
    return os.path.join(d, f".{name}.tmp-{os.getpid()}")


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor, so only the tensor being written is in memory.

    The header is fixed up front from `entries` (key, dtype, shape in file order); then `write(key, array)`
    must be called once per entry, in that order. Bytes go to a hidden temporary file in the same directory,
    which is renamed to `path` only when every tensor has been written: a crash or an exception leaves no
    file, half-written or otherwise, under the final name (and an older file there untouched).

        with SafetensorsWriter(path, [("a", np.float32, (2, 3))]) as w:
            w.write("a", np.zeros((2, 3), np.float32))
    """

    def __init__(self, path: str | os.PathLike, entries: Iterable[tuple[str, object, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = os.fspath(path)
        self._todo: list[tuple[str, np.dtype, tuple[int, ...]]] = []
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for key, dtype, shape in entries:
            dtype, shape = np.dtype(dtype), tuple(int(d) for d in shape)
            if key in header:
                raise CheckpointError(f"tensor '{key}' listed twice for {self.path}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            header[key] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            self._todo.append((key, dtype, shape))
        raw = json.dumps(header, separators=(",", ":")).encode()
        self._header = raw + b" " * (-len(raw) % 8)  # pad so the data region starts 8-byte aligned
        self.nbytes = 8 + len(self._header) + offset
        self._next = 0
        self._file = None

    def __enter__(self) -> "SafetensorsWriter":
        self._tmp = _temp_name(self.path)
        self._file = open(self._tmp, "wb")
        self._file.write(struct.pack("<Q", len(self._header)) + self._header)
        return self

    def write(self, key: str, array) -> None:
        """Append the next tensor; its key, dtype and shape must be the next entry's."""
        if self._next >= len(self._todo):
            raise CheckpointError(f"tensor '{key}' is not in the header of {self.path}")
        want_key, dtype, shape = self._todo[self._next]
        a = np.asarray(array)
        if key != want_key or a.dtype != dtype or a.shape != shape:
            raise CheckpointError(f"{self.path}: expected tensor '{want_key}' {dtype}{list(shape)} next, "
                                  f"got '{key}' {a.dtype}{list(a.shape)}")
        self._file.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
        self._next += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None and self._next != len(self._todo):
                raise CheckpointError(f"{self.path}: closed after {self._next} of {len(self._todo)} tensors; "
                                      f"'{self._todo[self._next][0]}' was never written")
            if exc_type is None:
                self._file.flush()
                os.fsync(self._file.fileno())
        except BaseException:
            self._file.close()
            os.unlink(self._tmp)
            raise
        self._file.close()
        if exc_type is None:
            os.replace(self._tmp, self.path)
        else:
            os.unlink(self._tmp)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (renames into it) to disk where the platform allows; best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write `obj` as JSON to `path` through a temporary file and a rename."""
    path = os.fspath(path)
    tmp = _temp_name(path)
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
