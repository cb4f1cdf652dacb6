"""Converted parameters as orbax checkpoints: atomic saves, restore onto any mesh with resharding.

Directory layout of an orbax checkpoint directory ROOT:

    ROOT/config.json                 a copy of the newest committed config (for `info`; `load` reads the one below)
    ROOT/tokenizer.json ...          optional extra files (tokenizer), copied by `save_orbax_params(extra_files=)`
    ROOT/checkpoint-000003/          the newest committed save:
        params/                        orbax (OCDBT) tree {parameter path: array}, one entry per parameter
        config.json                    the model config
        glm_dsa.json                   metadata: format, version, dtype, every leaf's shape and dtype
    ROOT/.checkpoint-000004.tmp-PID/  a save in progress (or one that was killed): never read (PID: the saving
                                      process's, process 0's in a multi-process save)

A save stages the whole new version in a hidden sibling directory (orbax itself writes `params` to its own
`*.orbax-checkpoint-tmp-*` directory and renames it when complete), writes `glm_dsa.json` last, then commits
by renaming the stage to `checkpoint-N`: one atomic rename on a POSIX filesystem. Only then are older
versions and stale stages removed. So a save killed at any point leaves the previous version readable, and
`load_orbax_params` reads only committed versions: a directory holding nothing but an interrupted save, or a
committed version with files missing, raises `CheckpointError` naming the directory, never a partial model.

FP8 weights (float8_e4m3fn leaves in our layout, `checkpoints.quantization`) are saved as they are, each with its
float32 '<path>_scale' grid as a leaf of its own; the metadata's per-leaf dtype says which weights are FP8.
`load_orbax_params(quantization=)` restores them as FP8, dequantises them, or quantises bf16 / fp32 weights, on
the devices (`fp8_device`).

Restore builds the target of every parameter from its path (its global shape from the layout, the dtype
asked for, the sharding `sharding_for` gives), so orbax reads each device's slice only: a checkpoint saved
from any mesh (or from numpy arrays) loads onto any other TP / DCP / QREP mesh.

Paths may be relative (to the working directory): every public function makes them absolute first, since orbax
accepts absolute paths only; the directories it returns are absolute.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from typing import Callable, Iterable

import jax
import numpy as np
from tqdm import tqdm

from kernels.common.fp8_formats import E4M3
from .fp8_device import dequantize_kept, quantize_kept
from .layout import fp8_scale_shape, kept_fp8_spec, param_specs
from .mtp_layout import mtp_param_specs
from .quantization import (QuantizationPlan, check_quantization, fp8_plan, kept_sharding, resolve_quantization,
                           scale_path, stored_leaves)
from .safetensors_io import CheckpointError, as_dtype, fsync_dir, pid_alive, write_json_atomic

FORMAT = "glm_dsa.orbax"
# 2: FP8 expert stacks kept K-major ([E, out, in], `layout.kept_fp8_spec`); version 1 stored them [E, in, out]
FORMAT_VERSION = 2
META = "glm_dsa.json"
PARAMS = "params"
CONFIG = "config.json"
_VERSION = re.compile(r"checkpoint-(\d{6,})")
_STAGE = re.compile(r"\.checkpoint-(\d{6,})\.tmp-(\d+)")

__all__ = ["FORMAT", "check_save_target", "committed_checkpoint", "flatten_params", "is_orbax_checkpoint",
           "load_orbax_params", "read_orbax_metadata", "save_orbax_params", "stored_fp8_plan"]


MTP_PREFIX = "mtp."  # the nextn layer's parameter paths (checkpoints.mtp_layout)
MTP_ITEM = "mtp"  # the orbax item (directory of a version) holding them


def _absolute(path: str | os.PathLike) -> str:
    """`path` made absolute: orbax takes absolute paths only, and every public function here takes relative ones."""
    return os.path.abspath(os.fspath(path))


def flatten_params(params) -> dict:
    """A flat {'layers.0.attn.q_a_proj': array} dict from either that dict or the nested params pytree
    ({'layers': {0: {'attn': {...}}}}, as `glm_dsa.model.param_tree.nest_params` builds it)."""
    flat: dict = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{prefix}.{i}" if prefix else str(i))
        else:
            flat[prefix] = node

    walk(params, "")
    return flat


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is an orbax checkpoint directory of ours (a ROOT, committed or not, or one version)."""
    path = _absolute(path)
    if not os.path.isdir(path):
        return False
    if os.path.exists(os.path.join(path, META)):
        return True
    return any(_VERSION.fullmatch(n) or _STAGE.fullmatch(n) for n in os.listdir(path))


def _versions(root: str) -> list[tuple[int, str]]:
    return sorted((int(m.group(1)), n) for n in os.listdir(root) if (m := _VERSION.fullmatch(n))
                  and os.path.isdir(os.path.join(root, n)))


def _stages(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if _STAGE.fullmatch(n))


def committed_checkpoint(path: str | os.PathLike) -> str:
    """The directory of the newest committed version under the ROOT `path` (or `path` itself when it is a
    version directory), as an absolute path. Raises `CheckpointError` when there is none, saying whether a save
    was interrupted."""
    path = _absolute(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"orbax checkpoint directory {path} does not exist")
    if os.path.exists(os.path.join(path, META)):
        return path
    versions = _versions(path)
    if versions:
        return os.path.join(path, versions[-1][1])
    stages = _stages(path)
    if stages:
        raise CheckpointError(f"orbax checkpoint directory {path} holds no committed checkpoint, only the "
                              f"unfinished save {stages[-1]} (interrupted before its commit): nothing to load")
    raise CheckpointError(f"{path} is not a glm_dsa orbax checkpoint (no checkpoint-NNNNNN version and no {META})")


def read_orbax_metadata(path: str | os.PathLike) -> dict:
    """The validated `glm_dsa.json` of the newest committed version under `path` (plus its `directory`)."""
    version = committed_checkpoint(path)
    meta_file = os.path.join(version, META)
    if not os.path.exists(meta_file):
        raise CheckpointError(f"{version} has no {META}: not a committed glm_dsa orbax checkpoint")
    try:
        with open(meta_file) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_file} is corrupt (not JSON: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else meta
        raise CheckpointError(f"{meta_file}: field 'format' is {got!r}, expected {FORMAT!r}")
    if meta.get("version") not in (1, FORMAT_VERSION):
        raise CheckpointError(f"{meta_file}: field 'version' is {meta.get('version')!r}; this glm_dsa reads "
                              f"versions 1 and {FORMAT_VERSION}")
    if not isinstance(meta.get("params"), dict):
        raise CheckpointError(f"{meta_file}: field 'params' (parameter -> shape and dtype) is missing")
    old_fp8 = sorted(p for p in _stored_fp8(meta["params"]) if ".experts_" in p) if meta["version"] == 1 else []
    if old_fp8:  # version 1 differs only there; its bf16 and other FP8 leaves read as version 2's
        raise CheckpointError(f"{meta_file}: format version 1 stores FP8 expert stacks [E, in, out] (e.g. "
                              f"'{old_fp8[0]}'); this glm_dsa keeps them K-major (version {FORMAT_VERSION}): "
                              "convert the HF checkpoint again (python -m glm_dsa convert)")
    for name in (PARAMS, CONFIG):
        if not os.path.exists(os.path.join(version, name)):
            raise CheckpointError(f"orbax checkpoint {version} is incomplete: '{name}' is missing")
    meta["directory"] = version
    return meta


def _dtype_summary(flat: dict, leaves: dict) -> str:
    """The one dtype of the compute-dtype leaves ("mixed" if several): FP8 weights, their scales and the layout's
    float32 parameters do not count."""
    names = {str(np.dtype(flat[p].dtype)) for p, (_, kind) in leaves.items() if kind == "weight"}
    return names.pop() if len(names) == 1 else "mixed"


def _leaves(specs: dict, fp8: frozenset, where: str) -> dict:
    """`stored_leaves(specs, fp8)`; a weight in `fp8` that has no FP8 form is a CheckpointError naming it."""
    for p in sorted(fp8):
        if specs[p].fp8_grid is None:
            raise CheckpointError(f"{where}: parameter '{p}' is float8_e4m3fn but is not a linear weight: it has no "
                                  f"FP8 form (block scales) in this layout")
    return stored_leaves(specs, fp8)


def _remove_quietly(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def check_save_target(path: str | os.PathLike) -> None:
    """Raise `CheckpointError` if `path` cannot take an orbax checkpoint (it holds an HF checkpoint, or is a file)."""
    root = _absolute(path)
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"{root} is a file, not a checkpoint directory")
    if os.path.isdir(root) and any(n.endswith(".safetensors") or n == "model.safetensors.index.json"
                                   for n in os.listdir(root)):
        raise CheckpointError(f"{root} holds an HF safetensors checkpoint; save the orbax checkpoint elsewhere")


def save_orbax_params(params, cfg, path: str | os.PathLike, *, extra_files: Iterable[str | os.PathLike] = (),
                      source: str | None = None, progress: bool = False) -> str:
    """Save parameters (flat {path: array} or the nested pytree; jax arrays on any mesh, or numpy) and `cfg`
    as a new committed version of the orbax checkpoint directory `path`; returns the version directory.

    Every parameter the layout of `cfg` names must be present with its shape (checked before writing); the
    nextn (MTP) layer's `mtp.*` parameters, when given, are saved beside them (`load_orbax_params(mtp=True)`). A weight
    given as float8_e4m3fn is saved as it is, and its float32 block scales '<path>_scale' must be given too
    (`checkpoints.quantization.stored_leaves`); the metadata records every leaf's dtype.
    `extra_files` (e.g. tokenizer.json) are copied into `path` after the commit. An interrupted save leaves
    the previous version as it was (see the module doc).

    Several processes (JAX's multi-controller runtime, arrays on a mesh over all of them): every process calls
    this with the same `path` on a filesystem they share; each writes its own devices' shards, process 0
    numbers the version, makes the stage (named with its PID), writes the metadata and commits. Every process
    returns once the version is committed.
    """
    import orbax.checkpoint as ocp

    root = _absolute(path)  # orbax refuses relative paths
    specs = param_specs(cfg)
    flat = flatten_params(params)
    # the nextn layer (as loaded: compute dtype, never FP8), an orbax item of its own beside the model's
    mtp_flat = {p: flat.pop(p) for p in [p for p in flat if p.startswith(MTP_PREFIX)]}
    mtp_leaves = stored_leaves(mtp_param_specs(cfg, shared_head=MTP_PREFIX + "head" in mtp_flat), frozenset()) \
        if mtp_flat else {}
    _check_leaves(mtp_flat, mtp_leaves, root)
    fp8 = frozenset(p for p in specs if p in flat and np.dtype(flat[p].dtype) == E4M3)
    leaves = _leaves(specs, fp8, f"cannot save to {root}")
    _check_leaves(flat, leaves, root)
    check_save_target(root)
    lead = jax.process_index() == 0  # the one that numbers, stages, commits and cleans up
    if lead:
        os.makedirs(root, exist_ok=True)
    versions = _versions(root) if lead else []
    number, owner = (versions[-1][0] + 1) if versions else 1, os.getpid()
    if jax.process_count() > 1:  # one stage for every process: process 0's number and PID
        number, owner = (int(x) for x in ocp.multihost.broadcast_one_to_all(np.asarray([number, owner], np.int32)))
    stage = os.path.join(root, f".checkpoint-{number:06d}.tmp-{owner}")
    final = os.path.join(root, f"checkpoint-{number:06d}")
    steps = tqdm(total=4, desc=f"saving {os.path.basename(final)}", unit="step", disable=not (progress and lead))
    try:
        if lead:
            _remove_quietly(stage)
            os.makedirs(stage)
        _sync_processes(f"glm_dsa_stage_{number}_{owner}")  # the stage exists before anyone writes into it
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(os.path.join(stage, PARAMS), {p: flat[p] for p in leaves})
        if mtp_flat:
            ckptr.wait_until_finished()
            ckptr.save(os.path.join(stage, MTP_ITEM), mtp_flat)
        ckptr.wait_until_finished()  # every process's shards are written (orbax syncs the processes)
        ckptr.close()
        steps.update()
        if lead:
            cfg.save_pretrained(stage)
            steps.update()
            _write_metadata(stage, {
                "format": FORMAT, "version": FORMAT_VERSION, "layout": "flat",
                "dtype": _dtype_summary(flat, leaves), "source": source,
                "params": {p: {"shape": list(shape), "dtype": str(np.dtype(flat[p].dtype))}
                           for p, (shape, _) in leaves.items()},
                **({"mtp": {p: {"shape": list(shape), "dtype": str(np.dtype(mtp_flat[p].dtype))}
                            for p, (shape, _) in mtp_leaves.items()}} if mtp_flat else {}),
            })
            steps.update()
            fsync_dir(stage)
            os.rename(stage, final)  # the commit
            fsync_dir(root)
    except BaseException:
        if lead:
            _remove_quietly(stage)
        raise
    finally:
        steps.close()
    if not lead:  # process 0 commits and tidies up; return once it has
        _sync_processes(f"glm_dsa_commit_{number}_{owner}")
        return final
    for _, old in versions:
        _remove_quietly(os.path.join(root, old))
    for name in _stages(root):
        pid = int(_STAGE.fullmatch(name).group(2))
        if pid == os.getpid() or not pid_alive(pid):
            _remove_quietly(os.path.join(root, name))
    _copy_atomic(os.path.join(final, CONFIG), os.path.join(root, CONFIG))
    for f in extra_files:
        _copy_atomic(os.fspath(f), os.path.join(root, os.path.basename(os.fspath(f))))
    steps.update()
    _sync_processes(f"glm_dsa_commit_{number}_{owner}")
    return final


def _check_leaves(flat: dict, leaves: dict, root: str) -> None:
    """The parameters to save are exactly `leaves` ({path: (shape, kind)}) with those shapes and float32 scale
    grids: CheckpointError naming the first that is not, before anything is written."""
    missing = [p for p in leaves if p not in flat]
    extra = [p for p in flat if p not in leaves]
    if missing or extra:
        raise CheckpointError(f"cannot save to {root}: missing parameters {missing[:5]}, unknown parameters "
                              f"{extra[:5]}")
    for p, (shape, kind) in leaves.items():
        if tuple(flat[p].shape) != shape:
            raise CheckpointError(f"cannot save parameter '{p}' to {root}: shape {list(flat[p].shape)}, "
                                  f"expected {list(shape)}")
        if kind == "scale" and np.dtype(flat[p].dtype) != np.float32:
            raise CheckpointError(f"cannot save parameter '{p}' to {root}: FP8 scales are float32, got "
                                  f"{np.dtype(flat[p].dtype)}")


def _sync_processes(name: str) -> None:
    """Wait for every process of a multi-process run at the barrier `name` (nothing to wait for in one)."""
    if jax.process_count() > 1:
        import orbax.checkpoint as ocp
        ocp.multihost.sync_global_processes(name)


def _write_metadata(directory: str, meta: dict) -> None:
    write_json_atomic(os.path.join(directory, META), meta)


def _copy_atomic(src: str, dst: str) -> None:
    tmp = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.tmp-{os.getpid()}")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _short(e: BaseException, limit: int = 400) -> str:
    """The first line of an orbax / tensorstore error without its tensorstore spec dump."""
    text = (str(e).splitlines() or [""])[0].split(" [tensorstore_spec")[0]
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def stored_fp8_plan(path: str | os.PathLike, quantization, cfg=None) -> QuantizationPlan:
    """The weights kept FP8 when loading the newest committed version under `path` with `quantization`
    (`checkpoints.quantization`): None, the FP8 weights it stores (its metadata's float8_e4m3fn leaves);
    "none", nothing; "fp8", every `fp8_eligible` weight of `cfg` (the config the checkpoint holds; needed for
    "fp8"). With `cfg`, a stored FP8 weight that is not eligible (kv_b_proj) is left out: it is dequantised."""
    setting = resolve_quantization(quantization)
    if setting == "none":
        return QuantizationPlan((), setting)
    if setting == "fp8" and cfg is None:
        raise ValueError("stored_fp8_plan: quantization 'fp8' needs the model config (cfg=) to name its weights")
    stored = _stored_fp8(read_orbax_metadata(path)["params"])
    if cfg is None:
        return QuantizationPlan(stored, setting)
    return fp8_plan(param_specs(cfg), quantization, lambda spec: spec.path in stored)


def _stored_fp8(stored: dict) -> frozenset[str]:
    """The paths of the metadata `params` whose dtype is float8_e4m3fn."""
    return frozenset(p for p, m in stored.items() if isinstance(m, dict) and m.get("dtype") == E4M3.name)


@functools.lru_cache(maxsize=None)
def _quantizer(grid: tuple, kmajor: bool, weight_sharding, scale_sharding):
    """quantize_kept for a kept form (`grid`, `kmajor`), jitted onto the shardings of the kept weight and its
    scale grid (one compile for the weights of one shape and placement: the layers share it)."""
    return jax.jit(functools.partial(quantize_kept, grid=grid, kmajor=kmajor),
                   out_shardings=(weight_sharding, scale_sharding))


@functools.lru_cache(maxsize=None)
def _dequantizer(grid: tuple, kmajor: bool, dtype: np.dtype, sharding):
    """dequantize_kept for a kept form and `dtype`, jitted onto the weight's sharding."""
    return jax.jit(functools.partial(dequantize_kept, grid=grid, kmajor=kmajor, dtype=dtype), out_shardings=sharding)


def stored_mtp(path: str | os.PathLike) -> bool:
    """Whether the newest committed version under `path` holds a nextn (MTP) layer (`mtp.*` parameters)."""
    return bool(read_orbax_metadata(path).get("mtp"))


def load_orbax_params(path: str | os.PathLike, cfg, *, dtype,
                      sharding_for: Callable[[str, tuple[int, ...]], jax.sharding.Sharding | None] | None = None,
                      progress: bool = True, quantization=None, mtp: bool = False) -> dict[str, jax.Array]:
    """Restore the newest committed version under `path` as flat parameters {path: jax.Array}.

    dtype: compute dtype for every parameter except those the layout keeps in float32 and FP8 weights kept FP8
    (None: as stored; dequantised FP8 weights: float32).
    sharding_for(path, global_shape): each leaf's target sharding (None: the default device), FP8 scale grids
    ('<path>_scale') included; a weight kept FP8 is asked for as `sharding_for(path, shape, kept=True)` (its
    stored form: K-major for expert stacks; `quantization.kept_sharding`: a callback without `kept` is asked for
    our layout's sharding, transposed for K-major stacks). Orbax reads only each device's slice, so the saving
    mesh does not matter.
    quantization (`checkpoints.quantization`): None keeps the checkpoint's form (its FP8 weights restored as
    float8_e4m3fn plus float32 '<path>_scale' grids); "none" dequantises FP8 weights to `dtype` on the devices;
    "fp8" also quantises its bf16 / fp32 linear weights on the devices (128 x 128 blocks, `fp8_device`). The
    FP8 weights of the result are `stored_fp8_plan(path, quantization, cfg)`; a `QuantizationPlan` given as
    `quantization` (`glm_dsa.load` makes it once) is that plan, not decided again.
    mtp: restore the nextn layer's `mtp.*` parameters too (saved by `convert` from a checkpoint that has one; in
    `dtype`, never quantised); without it a stored nextn layer is skipped.
    Raises `CheckpointError` for no committed version, a corrupt or incomplete version, parameters that do not
    match `cfg` (missing, unexpected, wrong shape or scale dtype), or `mtp` asked of a version without the layer,
    before or instead of returning anything.
    """
    import orbax.checkpoint as ocp

    check_quantization(quantization)
    meta = read_orbax_metadata(path)
    version = meta["directory"]
    specs = param_specs(cfg)
    stored = meta["params"]
    mtp_leaves = _mtp_leaves(meta, cfg) if mtp else {}
    stored_fp8 = frozenset(p for p in _stored_fp8(stored) if p in specs)
    leaves = _leaves(specs, stored_fp8, f"orbax checkpoint {version}")
    missing = [p for p in leaves if p not in stored]
    if missing:
        raise CheckpointError(f"orbax checkpoint {version} is missing parameter '{missing[0]}'"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = [p for p in stored if p not in leaves]
    if unexpected:
        raise CheckpointError(f"orbax checkpoint {version} has unexpected parameter '{unexpected[0]}'"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for p, (shape, kind) in leaves.items():
        if tuple(stored[p].get("shape", ())) != shape:
            raise CheckpointError(f"orbax checkpoint {version}: parameter '{p}' has shape {stored[p].get('shape')}, "
                                  f"the config needs {list(shape)}")
        if kind == "scale" and stored[p].get("dtype") != "float32":
            raise CheckpointError(f"orbax checkpoint {version}: FP8 scale grid '{p}' is {stored[p].get('dtype')}, "
                                  f"expected float32")
    plan = fp8_plan(specs, quantization, lambda spec: spec.path in stored_fp8)
    dtype = None if dtype is None else as_dtype(dtype)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def placed(p: str, shape: tuple, kept: bool = False):
        if not sharding_for:
            return default
        return (kept_sharding(sharding_for, p, specs[p]) if kept else sharding_for(p, shape)) or default

    target = {}
    for p, (shape, kind) in leaves.items():
        if kind in ("fp8", "scale", "fp32"):
            dt = E4M3 if kind == "fp8" else np.dtype(np.float32)
        elif p in plan:  # quantised below from the stored values, not from a cast of them
            dt = as_dtype(stored[p]["dtype"])
        else:
            dt = dtype or as_dtype(stored[p]["dtype"])
        target[p] = jax.ShapeDtypeStruct(shape, dt, sharding=placed(p, shape, kind == "fp8"))
    with tqdm(total=len(target), desc="restoring", unit="param", disable=not progress) as bar:
        ckptr = ocp.StandardCheckpointer()
        try:
            restored = ckptr.restore(os.path.join(version, PARAMS), target)
        except Exception as e:  # orbax / tensorstore errors: say which checkpoint, keep the cause
            raise CheckpointError(f"orbax checkpoint {version} could not be restored: {_short(e)}") from e
        finally:
            ckptr.close()
        bar.update(len(target))
    out = {}
    for p, spec in specs.items():
        s = scale_path(p)
        if p in plan and p in stored_fp8:  # kept as stored
            out[p], out[s] = restored.pop(p), restored.pop(s)
        elif p in stored_fp8:  # dequantised: quantization "none", or a stored FP8 weight no plan keeps (kv_b_proj)
            to, kept = dtype or np.dtype(np.float32), kept_fp8_spec(spec)
            out[p] = _dequantizer(kept.fp8_grid, kept.kmajor, to, placed(p, spec.shape))(restored.pop(p),
                                                                                         restored.pop(s))
        elif p in plan:  # quantised: quantization "fp8" of a bf16 / fp32 weight
            kept = kept_fp8_spec(spec)
            q, scale = _quantizer(kept.fp8_grid, kept.kmajor, placed(p, kept.shape, True),
                                  placed(s, fp8_scale_shape(kept)))(restored.pop(p))
            out[p], out[s] = q, scale
        else:
            out[p] = restored.pop(p)
    if mtp_leaves:  # its own orbax item, in `dtype` like the model's weights (float32 norms stay float32)
        target = {p: jax.ShapeDtypeStruct(shape, np.dtype(np.float32) if kind == "fp32" else
                                          (dtype or as_dtype(meta["mtp"][p]["dtype"])), sharding=placed(p, shape))
                  for p, (shape, kind) in mtp_leaves.items()}
        ckptr = ocp.StandardCheckpointer()
        try:
            out.update(ckptr.restore(os.path.join(version, MTP_ITEM), target))
        except Exception as e:
            raise CheckpointError(f"orbax checkpoint {version}: its MTP (nextn) layer could not be restored: "
                                  f"{_short(e)}") from e
        finally:
            ckptr.close()
    return out


def _mtp_leaves(meta: dict, cfg) -> dict:
    """{path: (shape, kind)} of the nextn layer stored in the version `meta` describes, checked against `cfg`;
    CheckpointError when the config declares none, the version holds none, or the stored one does not match."""
    version = meta["directory"]
    if not int(getattr(cfg, "num_nextn_predict_layers", 0) or 0):
        raise CheckpointError(f"orbax checkpoint {version}: config.json declares no MTP (nextn) layer "
                              "(num_nextn_predict_layers is 0); speculative decoding with MTP needs one")
    stored = meta.get("mtp") or {}
    if not stored:
        raise CheckpointError(f"orbax checkpoint {version} has no MTP (nextn) layer (no 'mtp.*' parameters: it was "
                              "converted from a checkpoint without one); load it with num_speculative_tokens=0")
    leaves = stored_leaves(mtp_param_specs(cfg, shared_head=MTP_PREFIX + "head" in stored), frozenset())
    for p, (shape, _) in leaves.items():
        if p not in stored or tuple(stored[p].get("shape", ())) != shape:
            raise CheckpointError(f"orbax checkpoint {version}: MTP parameter '{p}' is "
                                  f"{'missing' if p not in stored else 'of shape ' + str(stored[p].get('shape'))}, "
                                  f"the config needs {list(shape)}")
    unexpected = sorted(set(stored) - set(leaves))
    if unexpected:
        raise CheckpointError(f"orbax checkpoint {version} has unexpected MTP parameter '{unexpected[0]}'")
    if not os.path.exists(os.path.join(version, MTP_ITEM)):
        raise CheckpointError(f"orbax checkpoint {version} is incomplete: '{MTP_ITEM}' is missing")
    return leaves
