"""Load an HF safetensors checkpoint into our flat parameters, streamed one parameter at a time (SPEC §8).

Everything that can be checked without reading tensor data is checked first, for every file: the index, each
file's header and length, missing / unexpected tensors, and every shape. Only then are parameters read (from
memory-mapped files), converted, cast and placed, one at a time, each device receiving only its shard. So a bad
checkpoint fails fast with a `CheckpointError` that names the culprit, and never yields a partial model.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Callable

import jax
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

    def read(self, key: str) -> np.ndarray:
        """Tensor `key`; an FP8 weight with a `<key>_scale_inv` companion comes back dequantized to float32."""
        t = self.files[self.file_of[key]].get(key)
        if key + _SCALE in self:
            scale = self.files[self.file_of[key + _SCALE]].get(key + _SCALE).astype(np.float32)
            full = np.repeat(np.repeat(scale, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)
            t = t.astype(np.float32) * full[: t.shape[0], : t.shape[1]]
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
                if scale in self:
                    blocks = tuple(-(-d // FP8_BLOCK) for d in want)
                    if len(want) != 2 or self.shape(scale) != blocks:
                        raise CheckpointError(f"tensor '{scale}' in {self.file_of[scale]} has shape "
                                              f"{list(self.shape(scale))}, expected {list(blocks)}")


def load_hf_params(path: str | os.PathLike, cfg, *, dtype,
                   sharding_for: Callable[[str, tuple[int, ...]], jax.sharding.Sharding | None] | None = None,
                   progress: bool = True) -> dict[str, jax.Array]:
    """Load the HF checkpoint directory `path` as our flat parameters {path: jax.Array}.

    dtype: the compute dtype ("bfloat16", jnp.bfloat16, ...) every parameter is cast to, except those the
        layout marks fp32, which stay float32. None keeps each tensor's stored dtype.
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
        host = spec.from_hf(*(ckpt.read(k) for k in spec.hf_keys))
        target = np.dtype(np.float32) if spec.fp32 else dtype
        if target is not None:
            host = host.astype(target, copy=False)
        if not host.flags.writeable:  # still a view of the read-only file map: copy, so no array aliases the file
            host = np.array(host)
        sharding = (sharding_for(name, spec.shape) if sharding_for else None) or default
        params[name] = jax.make_array_from_callback(spec.shape, sharding, lambda idx, h=host: h[idx])
        del host
    return params
