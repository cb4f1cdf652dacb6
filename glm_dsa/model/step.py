"""The functional layer: pure `step` and `forward` over pytrees, for use under the caller's own `jax.jit`."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from kernels import registry
from sharding import ParallelConfig, cache_spec, mesh_for, param_partition_specs, path_str

from .config import GlmDsaConfig
from .layers import GlmDsaModel, StepBatch, StepContext
from .options import StepOptions, resolve_options
from .placement import partition_specs
from .paged_cache import allocate_caches, cache_dtype, owner_slots, pages_needed


@functools.lru_cache(maxsize=None)
def model_graphdef(config: GlmDsaConfig, fp8: frozenset = frozenset()):
    """The NNX graph of the model with the weights `fp8` kept FP8 (structure only; built abstractly, no arrays
    allocated)."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: GlmDsaModel(config, fp8=fp8)))
    return graphdef


def fp8_paths(params) -> frozenset:
    """The flat paths of the weights `params` holds in FP8 (float8_e4m3fn leaves): the loader's `QuantizationPlan`
    as the parameters carry it, so `step` (a pure function of its pytrees) builds the graph they were loaded for."""
    return frozenset(path_str(p) for p, leaf in jax.tree_util.tree_leaves_with_path(params)
                     if jnp.dtype(leaf.dtype) == jnp.float8_e4m3fn)


def resolve_parallel(parallel: ParallelConfig | None, config: GlmDsaConfig) -> ParallelConfig:
    """The ParallelConfig with QREP and the comm backend decided (environment > field > model default)."""
    parallel = (parallel or ParallelConfig()).resolve(config.parallel_defaults)
    parallel.check_model(config)
    return parallel


def params_dtype(params) -> jnp.dtype:
    """The model's compute dtype: the embedding's (never FP8; norms and the router stay float32)."""
    return params["embed"].dtype


def matmul_precision(params):
    """A context for tracing the model: float32 weights get float32 dots. On a GPU, XLA's default for a float32
    dot is TF32 (10-bit mantissas), which would make a float32 model neither a reference nor deterministic
    under re-sharding (a last-bit change upstream can move a TF32 rounding by 2**-11)."""
    if params_dtype(params) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def run_sharded(body, params, caches, batch: StepBatch, parallel: ParallelConfig, out_specs,
                config: GlmDsaConfig | None = None):
    """`body(params, caches, batch)` per shard on the mesh of a resolved `parallel`: parameters split by the
    partition table (FP8 scale grids by `placement.partition_specs`, which needs `config`), caches by token over
    the DCP axis, the batch replicated."""
    cspecs = jax.tree.map(lambda _: cache_spec(), caches)
    pspecs = (partition_specs(params, config, parallel) if config is not None
              else param_partition_specs(params, parallel.q_replicate))
    f = jax.shard_map(body, mesh=mesh_for(parallel),
                      in_specs=(pspecs, cspecs, P()),
                      out_specs=out_specs(cspecs) if callable(out_specs) else out_specs, check_vma=False)
    with matmul_precision(params):
        return f(params, caches, batch)


def step(params, caches, batch: StepBatch, *, config: GlmDsaConfig, parallel: ParallelConfig | None = None,
         impl: str | None = None, options: StepOptions | None = None):
    """One model step over a ragged batch: returns (float32 logits [L, vocab] for `batch.logits_indices`,
    updated caches). Pure: jit it, donate `caches` to update them in place. `options` (glm_dsa.model.options) says
    how to compute; `impl=` is a shorthand for `StepOptions(impl=impl)` (both, with different impls: an error)."""
    options = resolve_options(impl, options)
    parallel = resolve_parallel(parallel, config)
    ctx = StepContext(config, block_size=caches["mla"][0].shape[1], parallel=parallel, options=options)
    graphdef = model_graphdef(config, fp8_paths(params))

    def body(params, caches, batch):
        return nnx.merge(graphdef, params)(caches, batch, ctx)

    # the kernels' rules decide while the body traces: in batch-invariant mode each takes its fixed per-row choice
    # for the step's kind, named by its static padded row count (a prompt step from invariant_prompt_rows rows)
    with registry.batch_invariant(options.batch_invariant, rows=batch.token_ids.shape[0],
                                  prompt_rows=options.invariant_prompt_rows,
                                  decode_rows=options.invariant_decode_rows):
        return run_sharded(body, params, caches, batch, parallel, lambda cspecs: (P(), cspecs), config)


def prefill_inputs(params, token_ids, *, config: GlmDsaConfig, parallel: ParallelConfig, block_size: int = 16,
                   kv_cache_dtype: str = "auto") -> tuple[dict, StepBatch]:
    """Zeroed caches just large enough, and the one step that prefills every row of `token_ids` [B, T] and
    returns the logits of all B T rows (row-major)."""
    token_ids = jnp.asarray(token_ids, jnp.int32)
    b, t = token_ids.shape
    pages_per_seq = pages_needed(t, block_size, parallel.dcp, parallel.interleave)
    num_pages = b * pages_per_seq + 1  # per rank; page 0 is the padding page
    dtype = params_dtype(params)
    caches = allocate_caches(config, num_pages * parallel.dcp, block_size, cache_dtype(kv_cache_dtype, dtype),
                             kv_cache_dtype=kv_cache_dtype)
    pos = np.tile(np.arange(t, dtype=np.int32), b)
    req = np.repeat(np.arange(b, dtype=np.int32), t)
    tables = 1 + np.arange(b * pages_per_seq, dtype=np.int32).reshape(b, pages_per_seq)
    slots = owner_slots(tables, req, pos, block_size, parallel.dcp, parallel.interleave)
    batch = StepBatch(token_ids=token_ids.reshape(-1), positions=jnp.asarray(pos), slot_mapping=jnp.asarray(slots),
                      token_req=jnp.asarray(req), block_tables=jnp.asarray(tables),
                      logits_indices=jnp.arange(b * t, dtype=jnp.int32))
    return caches, batch


def forward(params, token_ids, *, config: GlmDsaConfig, parallel: ParallelConfig | None = None,
            impl: str | None = None, options: StepOptions | None = None, block_size: int = 16,
            kv_cache_dtype: str = "auto"):
    """Cache-free full-sequence logits: int [B, T] -> float32 [B, T, vocab] (a fresh cache per call); `impl` and
    `options` as for `step`."""
    options = resolve_options(impl, options)
    par = resolve_parallel(parallel, config)
    caches, batch = prefill_inputs(params, token_ids, config=config, parallel=par, block_size=block_size,
                                   kv_cache_dtype=kv_cache_dtype)
    # one compiled step: run eagerly, a step dispatches its ops one by one over the mesh (minutes on CPU)
    logits, _ = _jitted_step(params, caches, batch, config=config, parallel=par, options=options)
    return logits.reshape(*jnp.shape(token_ids), -1)


@functools.partial(jax.jit, static_argnames=("config", "parallel", "options"))
def _jitted_step(params, caches, batch, *, config, parallel, options):
    return step(params, caches, batch, config=config, parallel=parallel, options=options)
