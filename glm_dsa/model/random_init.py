"""Random parameters made directly on the devices (no checkpoint): for benchmarks and experiments."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp

from checkpoints.fp8_device import quantize_kept
from checkpoints.layout import fp8_scale_shape, kept_fp8_spec, param_specs
from checkpoints.quantization import fp8_plan, kept_sharding, scale_path
from checkpoints.random import init_stats

from .config import GlmDsaConfig
from .loading import param_sharding, resolve_dtype
from .param_tree import nest_params
from .step import resolve_parallel


def init_params(config: GlmDsaConfig, *, seed: int = 0, dtype="bfloat16", parallel=None,
                quantization=None) -> dict:
    """A params pytree of `config` drawn as `checkpoints.random` draws its checkpoints (same statistics),
    each parameter created sharded on the mesh of `parallel` by its own jitted generator.

    quantization "fp8": every linear weight the FP8 releases quantise (`checkpoints.quantization.fp8_plan`) is
    the same draw in `dtype`, quantised on the devices in 128 x 128 blocks (`checkpoints.fp8_device`, as an
    orbax restore with quantization "fp8" does): a float8_e4m3fn leaf plus its float32 '<path>_scale' grid, so
    the FP8 model is the bf16 one of the same seed quantised. None / "none": no FP8 leaves."""
    parallel = resolve_parallel(parallel, config)
    sharding_for, dt = param_sharding(parallel, config), resolve_dtype(dtype)
    specs = param_specs(config)
    plan = fp8_plan(specs, quantization, lambda spec: False)  # a random model stores no FP8: None keeps it so
    key = jax.random.key(seed)
    flat, programs = {}, {}
    for path, spec in specs.items():
        mean, std = init_stats(path)
        out_dtype = jnp.float32 if spec.fp32 else dt
        fp8 = path in plan
        kept = kept_fp8_spec(spec) if fp8 else None  # the stored form: K-major for expert stacks
        sharding = kept_sharding(sharding_for, path, spec) if fp8 else sharding_for(path, spec.shape)
        k = jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)
        # one compiled generator per (shape, dtype, sharding): the layers' parameters share them, so a model
        # compiles a few dozen small programs, not one per parameter (each costs ~0.2-0.5 s on a GPU)
        sig = (spec.shape, out_dtype, sharding, (kept.fp8_grid, kept.kmajor) if fp8 else None)
        if sig not in programs:
            def draw(k, m, s, shape=spec.shape, d=out_dtype):
                return (m + s * jax.random.normal(k, shape, jnp.float32)).astype(d)
            if fp8:  # drawn and quantised in one program: the wide draw never leaves the devices
                programs[sig] = jax.jit(lambda k, m, s, draw=draw, kept=kept:
                                        quantize_kept(draw(k, m, s), kept.fp8_grid, kept.kmajor),
                                        out_shardings=(sharding, sharding_for(scale_path(path), fp8_scale_shape(kept))))
            else:
                programs[sig] = jax.jit(draw, out_shardings=sharding)
        m, s = jnp.float32(mean), jnp.float32(std)
        if fp8:
            flat[path], flat[scale_path(path)] = programs[sig](k, m, s)
        else:
            flat[path] = programs[sig](k, m, s)
    return nest_params(flat)
