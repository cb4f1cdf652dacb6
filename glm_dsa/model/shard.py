"""One device's share of a (TP, DCP) layout, run on one device: the per-shard step the mesh runs, with every
collective a local stand-in of the same shapes (`sharding.StandInCollectives`).

A layout's device (i, j) holds its heads, expert and MLP widths, FP8 scale grids and cache pages as the partition
table places them (`glm_dsa.model.placement`); its step is `GlmDsaModel.__call__` under `jax.shard_map`. Here the
same module code runs on one device, outside any mesh, on parameters and caches of that device's local shapes and
with `StepContext.comm` the stand-ins: the compute is the device's, the collectives are not paid (their cost is
modelled apart from the calls they record: `benchmarks/collective_model.py`). The stand-in's DCP rank is 0, which
owns the most tokens of a group (`sharding.dcp.local_length`), so its share of the attention is the largest.
`python -m glm_dsa bench --shard-of TP[,DCP]` runs it.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from checkpoints.fp8_device import quantize_kept
from checkpoints.layout import kept_fp8_spec, param_specs
from checkpoints.quantization import fp8_plan, scale_path
from checkpoints.random import init_stats
from sharding import ParallelConfig, StandInCollectives, param_spec

from .config import GlmDsaConfig
from .layers import GlmDsaModel, StepBatch, StepContext
from .loading import resolve_dtype
from .options import StepOptions
from .param_tree import nest_params
from .placement import local_shape
from .step import fp8_paths, matmul_precision, model_graphdef


def parse_shard_of(value: str) -> tuple[int, int]:
    """(TP, DCP) of a `--shard-of` value 'TP' or 'TP,DCP' (DCP 1 by default); ValueError naming the flag."""
    parts = [p.strip() for p in str(value).split(",")]
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"--shard-of {value!r}: give TP or TP,DCP as integers, e.g. --shard-of 8,1") from None
    if len(nums) not in (1, 2) or any(n < 1 for n in nums):
        raise ValueError(f"--shard-of {value!r}: give TP or TP,DCP, integers >= 1, e.g. --shard-of 8,1")
    tp, dcp = nums if len(nums) == 2 else (nums[0], 1)
    if tp % dcp:
        raise ValueError(f"--shard-of {value!r}: DCP ({dcp}) must divide TP ({tp}) (DCP groups split the TP devices)")
    return tp, dcp


def shard_parallel(value: str, config: GlmDsaConfig, **fields) -> ParallelConfig:
    """The resolved ParallelConfig of `--shard-of value` for `config` (`fields`: other ParallelConfig fields, e.g.
    dcp_q_replicate); ValueError naming the flag when the model does not divide over the layout."""
    tp, dcp = parse_shard_of(value)
    parallel = ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp, **fields)
    parallel = parallel.resolve(config.parallel_defaults)
    try:
        parallel.check_model(config)
    except ValueError as e:
        raise ValueError(f"--shard-of {value!r}: {e}") from None
    return parallel


def stand_in(parallel: ParallelConfig) -> StandInCollectives:
    """The stand-in collectives of device (0, 0) of `parallel`'s mesh."""
    return StandInCollectives(axis_sizes=dict(parallel.mesh_shape))


def _logical_local(path: str, shape, parallel: ParallelConfig) -> tuple[int, ...]:
    """The local shape of the weight at `path` in our [in, out] layout (before any K-major storing)."""
    return local_shape(shape, param_spec(path, parallel.q_replicate), parallel.mesh_shape)


def init_shard_params(config: GlmDsaConfig, parallel: ParallelConfig, *, seed: int = 0, dtype="bfloat16",
                      quantization=None) -> dict:
    """Random parameters of one device's share of a resolved `parallel` (local shapes, on the default device),
    drawn with `checkpoints.random`'s statistics; quantization "fp8": the weights FP8 releases quantise are drawn at
    their local shape and quantised in 128 x 128 blocks (a float8_e4m3fn leaf in its stored form and its float32
    scale grid), as `random_init.init_params` does on the mesh. Works under `jax.eval_shape` (no allocation)."""
    dt = resolve_dtype(dtype)
    specs = param_specs(config)
    plan = fp8_plan(specs, quantization, lambda spec: False)
    key = jax.random.key(seed)
    flat, programs = {}, {}
    for path, spec in specs.items():
        mean, std = init_stats(path)
        out_dtype = jnp.float32 if spec.fp32 else dt
        shape = _logical_local(path, spec.shape, parallel)
        fp8 = path in plan
        kept = kept_fp8_spec(spec) if fp8 else None
        sig = (shape, out_dtype, (kept.fp8_grid, kept.kmajor) if fp8 else None)
        if sig not in programs:  # one program per (shape, dtype, form): the layers share them
            def draw(k, m, s, shape=shape, d=out_dtype):
                return (m + s * jax.random.normal(k, shape, jnp.float32)).astype(d)
            programs[sig] = jax.jit(
                (lambda k, m, s, draw=draw, kept=kept: quantize_kept(draw(k, m, s), kept.fp8_grid, kept.kmajor))
                if fp8 else draw)
        k = jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)
        out = programs[sig](k, jnp.float32(mean), jnp.float32(std))
        if fp8:
            flat[path], flat[scale_path(path)] = out
        else:
            flat[path] = out
    return nest_params(flat)


def shard_context(config: GlmDsaConfig, parallel: ParallelConfig, block_size: int,
                  options: StepOptions | None = None) -> StepContext:
    """The step context of device (0, 0) of `parallel` run alone: the layout's settings, the stand-in collectives."""
    return StepContext(config, block_size=block_size, parallel=parallel, options=options or StepOptions(),
                       comm=stand_in(parallel))


def shard_model(params, config: GlmDsaConfig) -> GlmDsaModel:
    """The model's modules over one device's parameters `params` (FP8 leaves as they are)."""
    return nnx.merge(model_graphdef(config, fp8_paths(params)), params)


def shard_step(params, caches, batch: StepBatch, *, config: GlmDsaConfig, parallel: ParallelConfig,
               options: StepOptions | None = None, ctx: StepContext | None = None):
    """One step of device (0, 0)'s share of `parallel` (resolved) on one device: (float32 logits [L, vocab] (the
    vocab shard's logits repeated to the gathered width: the stand-in all-gather), updated caches). `params` and
    `caches` have the device's local shapes (`init_shard_params`; caches of one rank's pages); `ctx` defaults to
    `shard_context` (pass one to record its collectives: `ctx.comm.record()`)."""
    ctx = ctx or shard_context(config, parallel, caches["mla"][0].shape[1], options)
    with matmul_precision(params):
        return shard_model(params, config)(caches, batch, ctx)
