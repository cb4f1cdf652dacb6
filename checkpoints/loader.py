"""Load an HF safetensors checkpoint into our flat parameters, streamed one parameter at a time (docs/math.md §8).

Everything that can be checked without reading tensor data is checked first, for every file: the index, each
file's header and length, missing / unexpected tensors, and every shape. Only then are parameters read (from
memory-mapped files), converted, cast and placed, one at a time, each device receiving only its shard. So a bad
checkpoint fails fast with a `CheckpointError` that names the culprit, and never yields a partial model.

FP8 releases (DeepSeek-V3 style, also GLM-5.x FP8): an e4m3 `*.weight` comes with a float32 `*.weight_scale_inv`
of shape [ceil(out / 128), ceil(in / 128)], one scale per 128 x 128 block (edge blocks ragged); the real weight is
`w * scale_inv` (the name is historical: it is multiplied). Such a parameter is dequantised on the devices, one
shard each: every device is sent only the e4m3 bytes of its own slice (1 B / value, read from the memory map)
and the part of the scale grid that covers it, multiplies them in float32 and casts to the compute dtype there,
then lays its shard out in our layout (`layout.hf_index` / `assemble_shard`). The host never holds a float32
copy, and no device ever holds more than its shard. e4m3 bytes stored as uint8 are read as e4m3 (when they have
their scales); any other integer or bool tensor is refused: weights are floating point.
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

from kernels.common.fp8_formats import WEIGHT_BLOCK as FP8_BLOCK
from kernels.common.fp8_formats import dequantize_blocks_np, quantize_blocks_np as quantize_blocks
from .layout import (ParamSpec, assemble_shard, fp8_scale_shape, hf_index, is_mtp_key, kept_fp8_spec,
                     ours_from_hf_blocks, param_specs)
from .mtp_layout import mtp_layer_index, mtp_param_specs
from .quantization import QuantizationPlan, fp8_plan, kept_sharding, scale_path
from .safetensors_io import INDEX, SINGLE, CheckpointError, SafetensorsFile, as_dtype

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
            t = dequantize_blocks_np(_fp8_view(t), self.scale_inv(key))
        return t

    def check(self, specs: dict[str, ParamSpec], cfg) -> None:
        """Raise `CheckpointError` unless the checkpoint holds exactly the tensors `specs` need, in their shapes.

        The declared MTP layers (`layout.is_mtp_key`) are ignored; so are the `*_scale_inv` companions of
        expected weights. Every expected tensor must be floating point; FP8 bytes (e4m3 / e5m2, or e4m3 stored
        as uint8) only with their block scales.
        """
        owner = {k: p for p, s in specs.items() for k in s.hf_keys}
        orphan = [k for k in self.keys() if k.endswith(_SCALE) and k[: -len(_SCALE)] not in self]
        if orphan:
            raise CheckpointError(f"checkpoint {self.path} has block scale '{orphan[0]}' in {self.file_of[orphan[0]]} "
                                  f"but no weight '{orphan[0][: -len(_SCALE)]}' for it (a scale without its weight)")
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
                dt = self.dtype(key)
                if not (_is_float(dt) or dt in _FP8 or (dt == np.uint8 and scale in self)):
                    raise CheckpointError(f"tensor '{key}' in {where} has dtype {dt} (parameter '{spec.path}'): "
                                          f"weights must be floating point (float32 / bfloat16 / float16, or FP8 "
                                          f"e4m3 bytes with their '{scale}')")
                if scale in self:
                    blocks = tuple(-(-d // FP8_BLOCK) for d in want)
                    if len(want) != 2 or self.shape(scale) != blocks:
                        raise CheckpointError(f"tensor '{scale}' in {self.file_of[scale]} has shape "
                                              f"{list(self.shape(scale))}, expected {list(blocks)} (one scale per "
                                              f"{FP8_BLOCK}x{FP8_BLOCK} block of '{key}' {list(want)})")
                    if not _is_float(self.dtype(scale)) or self.dtype(scale).itemsize < 2:
                        raise CheckpointError(f"tensor '{scale}' in {self.file_of[scale]} has dtype "
                                              f"{self.dtype(scale)}; block scales must be float32 (or bf16/f16)")
                    grid = self.scale_inv(key)
                    bad = ~(np.isfinite(grid) & (grid > 0))
                    if bad.any():
                        at = tuple(int(i) for i in np.argwhere(bad)[0])
                        raise CheckpointError(f"tensor '{scale}' in {self.file_of[scale]} has {int(bad.sum())} block "
                                              f"scale(s) that are not finite and positive (first: {grid[at]} at "
                                              f"block {list(at)}): the weight '{key}' cannot be dequantised")
                elif self.dtype(key) in _FP8:
                    raise CheckpointError(f"tensor '{key}' in {where} is {self.dtype(key)} but has no '{scale}' "
                                          f"companion: only block-scaled FP8 (one float32 scale per "
                                          f"{FP8_BLOCK}x{FP8_BLOCK} block) is supported")


def load_hf_params(path: str | os.PathLike | HFCheckpoint, cfg, *, dtype,
                   sharding_for: Callable[[str, tuple[int, ...]], jax.sharding.Sharding | None] | None = None,
                   progress: bool = True, mtp: bool = False, quantization=None) -> dict[str, jax.Array]:
    """Load the HF checkpoint directory `path` (or an `HFCheckpoint` already open on it: its headers are not parsed
    again) as our flat parameters {path: jax.Array}; with `mtp`, the nextn
    layer's too (`mtp.*`, `checkpoints.mtp_layout`; a checkpoint without one is a CheckpointError).

    dtype: the compute dtype ("bfloat16", jnp.bfloat16, ...) every parameter is cast to, except those the
        layout marks fp32, which stay float32. None keeps each tensor's stored dtype (FP8 block-scaled
        weights: float32). Block-scaled FP8 weights are dequantised on the device, in float32, then cast.
    sharding_for(path, global_shape): the `jax.sharding.Sharding` to place a parameter with (each device
        receives only its own shard), or None for the default device; a weight kept FP8 is asked for as
        `sharding_for(path, shape, kept=True)` in its stored form (`quantization.kept_sharding`: a callback
        without `kept` is asked for our layout's sharding, transposed for K-major stacks).
    progress: show a tqdm bar over parameters.
    quantization: None | "fp8" | "none", or the `QuantizationPlan` already made of one (`checkpoints.quantization`):
        the weights of its plan (`hf_fp8_plan`) are
        kept FP8: `path` float8_e4m3fn in its stored form (`layout.kept_fp8_spec`: our layout, K-major for expert
        stacks), each device sent only its slice of the e4m3 bytes, placed by `sharding_for(path, shape,
        kept=True)`, and `path + "_scale"` float32 (the HF grids in that form's orientation), placed by
        `sharding_for(path + "_scale", shape)`.
        Stored bf16/fp32 weights in the plan ("fp8") are quantised on the host, one parameter at a time.

    Raises `CheckpointError` (before anything is placed on a device) for a missing or unreadable checkpoint,
    a missing shard, a truncated or corrupt file, a missing or unexpected tensor or a wrong shape.
    """
    ckpt = path if isinstance(path, HFCheckpoint) else HFCheckpoint(path)
    specs = param_specs(cfg)
    if mtp:
        specs = {**specs, **mtp_specs(ckpt, cfg)}
    ckpt.check(specs, cfg)
    # the nextn (MTP) layer is dequantised: one layer of 79, and its module is built from the plain layout
    plan = hf_fp8_plan(ckpt, specs, quantization).without_prefix("mtp.")
    dtype = None if dtype is None else as_dtype(dtype)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params: dict[str, jax.Array] = {}
    for name, spec in tqdm(specs.items(), desc="loading", unit="param", disable=not progress):
        target = np.dtype(np.float32) if spec.fp32 else dtype
        if name in plan:
            kept, scales = kept_fp8_spec(spec), scale_path(name)
            sharding = (kept_sharding(sharding_for, name, spec) if sharding_for else None) or default
            scale_sharding = (sharding_for(scales, fp8_scale_shape(kept)) if sharding_for else None) or default
            src = ckpt if all(ckpt.is_block_scaled(k) for k in spec.hf_keys) else _QuantizedView(ckpt)
            params[name], params[scales] = _load_fp8_kept(src, kept, sharding, scale_sharding)
            continue
        sharding = (sharding_for(name, spec.shape) if sharding_for else None) or default
        # A layout without hf_axes (the padded LM head of an odd vocabulary) cannot be read shard by shard: an FP8
        # one is dequantised on the host by `ckpt.read` below, like any whole tensor.
        if spec.hf_axes is not None and any(ckpt.is_block_scaled(k) for k in spec.hf_keys):
            params[name] = _load_block_scaled(ckpt, spec, target or np.dtype(np.float32), sharding)
            continue
        if spec.hf_axes is not None and not sharding.is_fully_addressable:
            # several processes (multi-host): this one reads only the bytes of its own devices' shards
            params[name] = _load_local_shards(ckpt, spec, target, sharding)
            continue
        host = spec.from_hf(*(ckpt.read(k) for k in spec.hf_keys))
        if target is not None:
            host = host.astype(target, copy=False)
        if not host.flags.writeable:  # still a view of the read-only file map: copy, so no array aliases the file
            host = np.array(host)
        params[name] = jax.make_array_from_callback(spec.shape, sharding, lambda idx, h=host: h[idx])
        del host
    return params


def hf_fp8_plan(ckpt: HFCheckpoint, specs: dict[str, ParamSpec], quantization) -> QuantizationPlan:
    """The parameters of `specs` kept FP8 when loading `ckpt` under `quantization` (`quantization.fp8_plan`):
    with None, those whose every HF tensor is stored block-scaled; a `QuantizationPlan` is returned as it is."""
    return fp8_plan(specs, quantization, lambda spec: all(ckpt.is_block_scaled(k) for k in spec.hf_keys))


class _QuantizedView:
    """`ckpt` with its linear weights read as block-quantised e4m3 (quantization "fp8" of a bf16 / fp32 checkpoint):
    each HF tensor quantised on the host when first asked for (`quantize_blocks_np`, 128 x 128 blocks) and
    kept for the parameter being loaded (one view per parameter)."""

    def __init__(self, ckpt: HFCheckpoint):
        self.ckpt, self._done = ckpt, {}

    def _get(self, key: str):
        if key not in self._done:
            self._done[key] = quantize_blocks(self.ckpt.read(key))
        return self._done[key]

    def raw(self, key: str) -> np.ndarray:
        return self._get(key)[0]

    def scale_inv(self, key: str) -> np.ndarray:
        return self._get(key)[1]


def _load_fp8_kept(ckpt, spec: ParamSpec, sharding, scale_sharding) -> tuple[jax.Array, jax.Array]:
    """(e4m3 weight, float32 scale grid) of a parameter kept FP8, `spec` its stored form (`kept_fp8_spec`). Each of
    this process's devices is sent only the e4m3 bytes of its own shard (read from the memory maps, laid out as
    stored on the host: 1-byte moves), replicas of one slice read once; the scale grid (1/16384 of the weight) is
    the HF grids transposed ([in-blocks, out-blocks]), or for K-major expert stacks the HF grids as they are
    (stacked), each device given its `scale_sharding` part."""
    weight = _place_local_slices(lambda key: _fp8_view(ckpt.raw(key)), spec, sharding)  # uint8 bytes read as e4m3
    grids = [np.asarray(ckpt.scale_inv(k), np.float32) for k in spec.hf_keys]
    grids = grids if spec.kmajor else [g.T for g in grids]
    grid = np.ascontiguousarray(np.stack(grids) if spec.fp8_grid[0] else grids[0])
    if grid.shape != fp8_scale_shape(spec):
        raise CheckpointError(f"parameter '{spec.path}': scale grid {list(grid.shape)} from "
                              f"'{spec.hf_keys[0]}{_SCALE}', expected {list(fp8_scale_shape(spec))}")
    scale = jax.make_array_from_callback(grid.shape, scale_sharding, lambda idx: grid[idx])
    return weight, scale


def mtp_specs(ckpt: HFCheckpoint, cfg) -> dict[str, ParamSpec]:
    """The specs of `ckpt`'s nextn layer (without `mtp.head` when it has no shared_head.head); CheckpointError
    when the config declares no nextn layer or the checkpoint holds none."""
    n = mtp_layer_index(cfg)
    if not int(getattr(cfg, "num_nextn_predict_layers", 0) or 0):
        raise CheckpointError(f"checkpoint {ckpt.path}: config.json declares no MTP (nextn) layer "
                              "(num_nextn_predict_layers is 0); speculative decoding with MTP needs one")
    probe = f"model.layers.{n}.eh_proj.weight"
    if probe not in ckpt:
        raise CheckpointError(f"checkpoint {ckpt.path} has no MTP (nextn) layer: no tensor '{probe}' (the layer "
                              f"model.layers.{n}.* is absent, as in releases without MTP weights); load it with "
                              "num_speculative_tokens=0")
    return mtp_param_specs(cfg, shared_head=f"model.layers.{n}.shared_head.head.weight" in ckpt)


def _place_local_slices(raw, spec: ParamSpec, sharding, convert=lambda host: host) -> jax.Array:
    """One parameter placed with `sharding` from the HF slices its shards need: for each of this process's devices,
    only the rows and columns of its own shard are read (`raw(key)`: a tensor as stored, e.g. a memory map), laid
    out in our layout on the host, passed through `convert` and sent to that device; replicas of one slice are read
    once. Works when the sharding spans other processes' devices too."""
    shards, read = [], {}
    for device, index in sharding.addressable_devices_indices_map(spec.shape).items():
        index = tuple(slice(*s.indices(d)) for s, d in zip(index, spec.shape))
        at = tuple((s.start, s.stop, s.step) for s in index)
        if at not in read:
            keys, axes = hf_index(spec, index)
            cut = axes if all(isinstance(a, slice) for a in axes) else np.ix_(
                *(_positions(a, n) for a, n in zip(axes, spec.hf_shapes[0])))
            blocks = [np.ascontiguousarray(raw(spec.hf_keys[i])[cut]) for i in keys]
            read[at] = np.ascontiguousarray(convert(ours_from_hf_blocks(spec, index, blocks)))
        shards.append(jax.device_put(read[at], device))
    return jax.make_array_from_single_device_arrays(spec.shape, sharding, shards)


def _load_local_shards(ckpt: HFCheckpoint, spec: ParamSpec, dtype: np.dtype | None, sharding) -> jax.Array:
    """One parameter (not block-scaled) placed with a `sharding` that spans other processes' devices too, each device
    sent only its shard's slices (`_place_local_slices`), cast to `dtype` on the host (None: as stored)."""
    return _place_local_slices(ckpt.raw, spec, sharding,
                               (lambda host: host) if dtype is None else (lambda host: host.astype(dtype, copy=False)))


# ---- FP8 block-scaled weights ------------------------------------------------------------------------------

_FP8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_FLOATS = (np.dtype(ml_dtypes.bfloat16),)  # float dtypes numpy does not class as floating ('f')


def _is_float(dtype: np.dtype) -> bool:
    """A floating-point storage dtype that is not FP8 (those need block scales)."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype) in _FLOATS


def _fp8_view(t: np.ndarray) -> np.ndarray:
    """FP8 bytes stored as uint8 (with their block scales) are e4m3 values: a view, no copy."""
    return t.view(_E4M3) if t.dtype == np.uint8 else t


def _positions(p: np.ndarray | slice, n: int) -> np.ndarray:
    return np.arange(n)[p] if isinstance(p, slice) else p


def _host_shard(ckpt: HFCheckpoint, spec: ParamSpec, index) -> tuple:
    """What one device needs for the shard `ours[index]` of a block-scaled parameter, read from the memory maps:
    per HF tensor it reads, its block (stored bytes, uint8 seen as e4m3) and the sub-grid of scales covering it
    (None for a tensor without scales); and, per row / column of a block, its row / column in that sub-grid
    (the global row // 128, renumbered), so a slice need not start on a block boundary."""
    keys, (rows, cols) = hf_index(spec, index)
    n_rows, n_cols = spec.hf_shapes[0]
    rb = _positions(rows, n_rows) // FP8_BLOCK
    cb = _positions(cols, n_cols) // FP8_BLOCK
    ub_r, ub_c = np.unique(rb), np.unique(cb)
    local_r = np.searchsorted(ub_r, rb).astype(np.int32)
    local_c = np.searchsorted(ub_c, cb).astype(np.int32)
    cut = (rows, cols) if isinstance(rows, slice) and isinstance(cols, slice) else np.ix_(
        _positions(rows, n_rows), _positions(cols, n_cols))
    parts = []
    for i in keys:
        key = spec.hf_keys[i]
        w = np.ascontiguousarray(_fp8_view(ckpt.raw(key))[cut])  # a copy of the block only, off the file map
        s = np.ascontiguousarray(ckpt.scale_inv(key)[np.ix_(ub_r, ub_c)]) if ckpt.is_block_scaled(key) else None
        parts.append((w, s))
    return parts, local_r, local_c


@functools.partial(jax.jit, static_argnames=("dtype", "hf_axes", "stacked", "lens"))
def _dequantize_shard(parts, rows, cols, *, dtype, hf_axes, stacked, lens):
    """On one device: each block times its scales (indexed per row and column), in float32, cast to `dtype` (the
    arithmetic of `dequantize_blocks_np`, so the two agree bit for bit); then the blocks laid out as our shard.
    Static arguments are plain values, so layers of one geometry share one compile."""
    blocks = []
    for w, s in parts:
        if s is None:
            blocks.append(w.astype(dtype))
        else:
            blocks.append((w.astype(jnp.float32) * s.astype(jnp.float32)[rows][:, cols]).astype(dtype))
    return assemble_shard(hf_axes, stacked, lens, blocks, jnp)


def _load_block_scaled(ckpt: HFCheckpoint, spec: ParamSpec, dtype: np.dtype, sharding) -> jax.Array:
    """One parameter with FP8 block-scaled HF tensors, placed with `sharding`: each device is sent only the
    stored bytes and scales of its own shard, dequantises them in `dtype` and lays them out in our layout."""
    if spec.hf_axes is None:
        raise CheckpointError(f"parameter '{spec.path}' is block-scaled FP8 but its layout has no hf_axes: "
                              f"cannot read it shard by shard")
    shards, last = [], None
    for device, index in sharding.addressable_devices_indices_map(spec.shape).items():
        index = tuple(slice(*s.indices(d)) for s, d in zip(index, spec.shape))
        at = tuple((s.start, s.stop, s.step) for s in index)
        if last is None or last[0] != at:  # devices holding the same slice (replicas) are usually adjacent
            last = (at, _host_shard(ckpt, spec, index))
        parts, rows, cols = jax.device_put(last[1], device)
        lens = tuple(len(range(*s.indices(d))) for s, d in zip(index, spec.shape))
        shards.append(_dequantize_shard(parts, rows, cols, dtype=np.dtype(dtype), hf_axes=spec.hf_axes,
                                        stacked=len(spec.hf_keys) > 1, lens=lens))
    return jax.make_array_from_single_device_arrays(spec.shape, sharding, shards)
