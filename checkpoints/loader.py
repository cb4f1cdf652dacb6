"""Load an HF safetensors checkpoint into our flat parameters, streamed one parameter at a time (SPEC §8).

Everything that can be checked without reading tensor data is checked first, for every file: the index, each
file's header and length, missing / unexpected tensors, and every shape. Only then are parameters read (from
memory-mapped files), converted, cast and placed, one at a time, each device receiving only its shard. So a bad
checkpoint fails fast with a `CheckpointError` that names the culprit, and never yields a partial model.

FP8 releases (DeepSeek-V3 style, also GLM-5.x FP8): an e4m3 `*.weight` comes with a float32 `*.weight_scale_inv`
of shape [ceil(out / 128), ceil(in / 128)], one scale per 128 x 128 block (edge blocks ragged); the real weight is
`w * scale_inv` (the name is historical: it is multiplied). Such a parameter is dequantised on the device: the
e4m3 bytes (1 B / value, straight from the memory map) and the small scale grid are uploaded, multiplied in
float32 and cast to the compute dtype there, one parameter at a time; the host never holds a float32 copy.
"""

from __future__ import annotations

import functools
import glob
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm import tqdm

from .layout import ParamSpec, is_mtp_key, param_specs
from .safetensors_io import INDEX, SINGLE, CheckpointError, SafetensorsFile, as_dtype

FP8_BLOCK = 128  # FP8 releases: one `weight_scale_inv` per 128 x 128 block of a weight
_SCALE = "_scale_inv"


class HFCheckpoint:
    """The tensors of an HF checkpoint directory, validated, by key.

    Reads `model.safetensors.index.json` and the shards it names, else `model.safetensors` (as HF does).
    Every file's header and length are validated on opening (see `SafetensorsFile`).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        self.files: dict[str, SafetensorsFile] = {}
        self.file_of: dict[str, str] = {}  # key -> file name (relative to the directory)
        index = os.path.join(self.path, INDEX)
        if os.path.exists(index):
            self._open_index(index)
        elif os.path.exists(os.path.join(self.path, SINGLE)):
            self.file_of = dict.fromkeys(self._open(SINGLE).keys(), SINGLE)
        else:
            found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(self.path, "*.safetensors")))
            raise CheckpointError(f"no safetensors checkpoint in {self.path}: neither {INDEX} nor {SINGLE}"
                                  + (f" (found {found[:3]} but no index naming them)" if found else ""))

    def _open(self, name: str) -> SafetensorsFile:
        if name not in self.files:
            self.files[name] = SafetensorsFile(os.path.join(self.path, name))
        return self.files[name]

    def _open_index(self, index: str) -> None:
        try:
            with open(index) as f:
                doc = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"index {index} is corrupt (not JSON: {e})") from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"index {index} is corrupt (no 'weight_map' object of key -> file name)")
        for name in sorted(set(weight_map.values())):
            if not os.path.exists(os.path.join(self.path, name)):
                raise CheckpointError(f"index {index} names shard file {name}, which does not exist")
            self._open(name)
        for key, name in weight_map.items():
            if key not in self.files[name]:
                raise CheckpointError(f"index {index} puts tensor '{key}' in {name}, which does not hold it")
        self.file_of = dict(weight_map)

    def __contains__(self, key: str) -> bool:
        return key in self.file_of

    def keys(self) -> list[str]:
        return list(self.file_of)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.files[self.file_of[key]].shape(key)

    def raw(self, key: str) -> np.ndarray:
        """Tensor `key` as stored (a read-only view of the memory-mapped file)."""
        return self.files[self.file_of[key]].get(key)

    def dtype(self, key: str) -> np.dtype:
        return self.files[self.file_of[key]].dtype(key)

    def is_block_scaled(self, key: str) -> bool:
        """True for an FP8 weight with a `<key>_scale_inv` companion (dequantised on load)."""
        return key + _SCALE in self

    def scale_inv(self, key: str) -> np.ndarray:
        """The float32 block-scale grid [ceil(rows / 128), ceil(cols / 128)] of the block-scaled weight `key`."""
        return np.asarray(self.raw(key + _SCALE), np.float32)

    def read(self, key: str) -> np.ndarray:
        """Tensor `key` on the host; a block-scaled FP8 weight comes back dequantized to float32 (numpy)."""
        t = self.raw(key)
        if self.is_block_scaled(key):
            t = dequantize_blocks_np(t, self.scale_inv(key))
        return t

    def check(self, specs: dict[str, ParamSpec], cfg) -> None:
        """Raise `CheckpointError` unless the checkpoint holds exactly the tensors `specs` need, in their shapes.

        MTP layers (`model.layers.{>= num_hidden_layers}.*`) are ignored; so are the `*_scale_inv` companions
        of expected weights.
        """
        owner = {k: p for p, s in specs.items() for k in s.hf_keys}
        missing = [k for k in owner if k not in self]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"checkpoint {self.path} is missing tensor '{missing[0]}' for parameter "
                                  f"'{owner[missing[0]]}'{more}")
        unexpected = [k for k in self.keys() if k not in owner and not is_mtp_key(k, cfg)
                      and not (k.endswith(_SCALE) and k[: -len(_SCALE)] in owner)]
        if unexpected:
            more = f" (and {len(unexpected) - 1} more: {unexpected[1:4]})" if len(unexpected) > 1 else ""
            raise CheckpointError(f"checkpoint {self.path} has unexpected tensor '{unexpected[0]}' in "
                                  f"{self.file_of[unexpected[0]]}{more}")
        for spec in specs.values():
            for key, want in zip(spec.hf_keys, spec.hf_shapes):
                got = self.shape(key)
                if got != tuple(want):
                    raise CheckpointError(f"tensor '{key}' in {os.path.join(self.path, self.file_of[key])} has "
                                          f"shape {list(got)}, expected {list(want)} (parameter '{spec.path}')")
                scale = key + _SCALE
                where = os.path.join(self.path, self.file_of[key])
                if scale in self:
                    blocks = tuple(-(-d // FP8_BLOCK) for d in want)
                    if len(want) != 2 or self.shape(scale) != blocks:
                        raise CheckpointError(f"tensor '{scale}' in {self.file_of[scale]} has shape "
                                              f"{list(self.shape(scale))}, expected {list(blocks)} (one scale per "
                                              f"{FP8_BLOCK}x{FP8_BLOCK} block of '{key}' {list(want)})")
                    if self.dtype(scale).kind != "f" or self.dtype(scale).itemsize < 2:
                        raise CheckpointError(f"tensor '{scale}' in {self.file_of[scale]} has dtype "
                                              f"{self.dtype(scale)}; block scales must be float32 (or bf16/f16)")
                elif self.dtype(key) in _FP8:
                    raise CheckpointError(f"tensor '{key}' in {where} is {self.dtype(key)} but has no '{scale}' "
                                          f"companion: only block-scaled FP8 (one float32 scale per "
                                          f"{FP8_BLOCK}x{FP8_BLOCK} block) is supported")


def load_hf_params(path: str | os.PathLike, cfg, *, dtype,
                   sharding_for: Callable[[str, tuple[int, ...]], jax.sharding.Sharding | None] | None = None,
                   progress: bool = True) -> dict[str, jax.Array]:
    """Load the HF checkpoint directory `path` as our flat parameters {path: jax.Array}.

    dtype: the compute dtype ("bfloat16", jnp.bfloat16, ...) every parameter is cast to, except those the
        layout marks fp32, which stay float32. None keeps each tensor's stored dtype (FP8 block-scaled
        weights: float32). Block-scaled FP8 weights are dequantised on the device, in float32, then cast.
    sharding_for(path, global_shape): the `jax.sharding.Sharding` to place a parameter with (each device
        receives only its own shard), or None for the default device.
    progress: show a tqdm bar over parameters.

    Raises `CheckpointError` (before anything is placed on a device) for a missing or unreadable checkpoint,
    a missing shard, a truncated or corrupt file, a missing or unexpected tensor or a wrong shape.
    """
    ckpt = HFCheckpoint(path)
    specs = param_specs(cfg)
    ckpt.check(specs, cfg)
    dtype = None if dtype is None else as_dtype(dtype)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params: dict[str, jax.Array] = {}
    for name, spec in tqdm(specs.items(), desc="loading", unit="param", disable=not progress):
        target = np.dtype(np.float32) if spec.fp32 else dtype
        sharding = (sharding_for(name, spec.shape) if sharding_for else None) or default
        if any(ckpt.is_block_scaled(k) for k in spec.hf_keys):
            params[name] = _load_block_scaled(ckpt, spec, target or np.dtype(np.float32), sharding)
            continue
        host = spec.from_hf(*(ckpt.read(k) for k in spec.hf_keys))
        if target is not None:
            host = host.astype(target, copy=False)
        if not host.flags.writeable:  # still a view of the read-only file map: copy, so no array aliases the file
            host = np.array(host)
        params[name] = jax.make_array_from_callback(spec.shape, sharding, lambda idx, h=host: h[idx])
        del host
    return params


# ---- FP8 block-scaled weights ------------------------------------------------------------------------------

_FP8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


def dequantize_blocks_np(w: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """Host reference: `w * scale_inv` per block of a 2-D weight, in float32 (edge blocks ragged)."""
    full = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block, axis=0), block, axis=1)
    return np.asarray(w).astype(np.float32) * full[: w.shape[0], : w.shape[1]]


@functools.partial(jax.jit, static_argnames=("dtype", "block"))
def dequantize_blocks(w, scale_inv, *, dtype, block: int = FP8_BLOCK):
    """On the device: e4m3 `w` [rows, cols] times its block scales [ceil(rows/b), ceil(cols/b)], in float32,
    cast to `dtype`. The same arithmetic as `dequantize_blocks_np`, so results agree bit for bit."""
    rows, cols = w.shape
    s = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), block, axis=0), block, axis=1)[:rows, :cols]
    return (w.astype(jnp.float32) * s).astype(dtype)


def _stacks_transposes(spec: ParamSpec) -> bool:
    """Whether the multi-tensor `spec.from_hf` stacks the transposes of its inputs (routed experts): probed
    on tiny arrays, so the device path below never assumes the layout."""
    probe = [np.arange(6, dtype=np.float32).reshape(2, 3) + 6 * i for i in range(len(spec.hf_keys))]
    try:
        return bool(np.array_equal(spec.from_hf(*probe), np.stack([p.T for p in probe])))
    except Exception:  # noqa: BLE001 - a layout whose conversion needs real shapes: not a plain stack
        return False


def _load_block_scaled(ckpt: HFCheckpoint, spec: ParamSpec, dtype: np.dtype, sharding) -> jax.Array:
    """One parameter with FP8 block-scaled HF tensors: dequantised on the device in `dtype`, then laid out in our
    layout (transpose / reshape / stack, on the device) and placed with `sharding`."""
    device = jax.devices()[0]
    parts = []
    for key in spec.hf_keys:
        w = jax.device_put(ckpt.raw(key), device)  # e4m3 bytes straight from the memory map
        if ckpt.is_block_scaled(key):
            parts.append(dequantize_blocks(w, jax.device_put(ckpt.scale_inv(key), device), dtype=dtype))
        else:
            parts.append(w.astype(dtype))
    if len(parts) == 1:
        ours = spec.from_hf(parts[0])  # transposes and reshapes: jax arrays have the same methods
    elif _stacks_transposes(spec):
        ours = jnp.stack([p.T for p in parts])
    else:  # an unknown multi-tensor layout: convert on the host, in the compute dtype
        ours = spec.from_hf(*(np.asarray(p) for p in parts))
    if tuple(ours.shape) != spec.shape:
        raise CheckpointError(f"parameter '{spec.path}' converted to shape {list(ours.shape)}, expected "
                              f"{list(spec.shape)}")
    return jax.device_put(jnp.asarray(ours, dtype), sharding)
