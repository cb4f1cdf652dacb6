"""HF safetensors checkpoints <-> our flat parameters: layout, streamed loading (FP8 block-scaled too), saving,
random checkpoints, and orbax checkpoints of converted parameters (`orbax_io`).

This package maps names and shapes; it does not import the model (`cfg` is duck-typed). Names are imported
lazily, so `python -m checkpoints.fp8_blocks` neither imports jax nor runs into its own module half-imported.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ParamSpec": "layout", "param_specs": "layout", "is_mtp_key": "layout",
    "CheckpointError": "safetensors_io", "SafetensorsFile": "safetensors_io", "SafetensorsWriter": "safetensors_io",
    "HFCheckpoint": "loader", "load_hf_params": "loader",
    "save_hf_params": "writer", "write_hf_tensors": "writer", "check_hf_target": "writer",
    "write_random_checkpoint": "random",
    "is_orbax_checkpoint": "orbax_io", "committed_checkpoint": "orbax_io", "load_orbax_params": "orbax_io",
    "save_orbax_params": "orbax_io", "read_orbax_metadata": "orbax_io", "flatten_params": "orbax_io",
    "check_save_target": "orbax_io", "stored_fp8_plan": "orbax_io", "stored_mtp": "orbax_io",
    "quantize_fp8": "fp8_device", "dequantize_fp8": "fp8_device",
    "quantize_blocks": "fp8_blocks", "write_fp8_release": "fp8_blocks",
    "fp8_plan": "quantization", "scale_path": "quantization", "stored_leaves": "quantization",
    "check_quantization": "quantization", "fp8_scale_shape": "layout", "kept_fp8_spec": "layout",
    "QuantizationPlan": "quantization", "resolve_quantization": "quantization",
}
# submodules, reachable as attributes (`checkpoints.orbax_io`) even before anything imported them
_SUBMODULES = ("fp8_blocks", "fp8_device", "layout", "loader", "orbax_io", "quantization", "random",
               "safetensors_io", "writer")
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return __all__
