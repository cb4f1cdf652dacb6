"""The MTP (nextn) layer of GLM-5.x / DeepSeek-V3 (docs/math.md §12), written per shard like glm_dsa.model.

One draft row at position t takes the target's final-normed hidden state h_t and the token x_{t+1}:
`z = eh_proj([enorm(embed(x_{t+1})) | hnorm(h_t)])`, one decoder layer (`model.DecoderLayer`, with its own MLA
and indexer caches), then `hn = shared_head.norm(z)` and `logits = shared_head.head(hn)`. Chained drafts feed `hn`
(normalised: vLLM #46075) back as the next row's h. Rows sit at position t (vLLM's numbering: the row of h_t),
so the layer's cache holds one row per position whose next token is known and causal attention over positions
<= t sees only written rows; RoPE is relative, so this equals the layer "at t + 1" over rows 1..t+1. As vLLM
does, the embedding of a row at position 0 is zeroed.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from checkpoints.layout import param_specs
from checkpoints.mtp_layout import mtp_block_config, mtp_param_specs
from checkpoints.random import init_stats
from kernels.common.norms import rms_norm
from sharding import TP_AXES, Collectives, ParallelConfig, cache_spec, mesh_for, param_partition_specs

from .config import GlmDsaConfig
from .layers import DecoderLayer, StepBatch, StepContext
from .loading import param_sharding, resolve_dtype
from .options import StepOptions
from .paged_cache import allocate_caches, cache_bytes_per_token
from .param_tree import nest_params
from .step import matmul_precision, resolve_parallel


class MtpLayer(nnx.Module):
    """The nextn layer: enorm, hnorm, eh_proj, a decoder layer (`block`), shared_head.norm and, when the checkpoint
    has it, shared_head.head (else the target's lm_head is used)."""

    def __init__(self, cfg: GlmDsaConfig, dtype=jnp.bfloat16, shared_head: bool = True):
        specs = mtp_param_specs(cfg, shared_head=shared_head)
        names = ["enorm", "hnorm", "eh_proj", "head_norm"] + (["head"] if shared_head else [])
        for name in names:
            spec = specs["mtp." + name]
            setattr(self, name, nnx.Param(jnp.zeros(spec.shape, jnp.float32 if spec.fp32 else dtype)))
        block_cfg = mtp_block_config(cfg)
        self.block = DecoderLayer(block_cfg, cfg.num_hidden_layers, param_specs(block_cfg), dtype)
        self.has_head = shared_head

    def __call__(self, h, embed, mla_cache, index_cache, batch: StepBatch, ctx: StepContext):
        """(hn [T, hidden]: shared_head.norm of the layer's output, the next chained row's h; mla_cache,
        index_cache) for rows of hidden states `h` [T, hidden] and tokens `batch.token_ids` (the token after h's)."""
        eps = ctx.cfg.rms_norm_eps
        e = embed[batch.token_ids]
        e = jnp.where((batch.positions == 0)[:, None], jnp.zeros_like(e), e)  # vLLM masks position 0's embedding
        u = jnp.concatenate([rms_norm(e, self.enorm[...], eps), rms_norm(h.astype(e.dtype), self.hnorm[...], eps)],
                            axis=-1)
        z = u @ self.eh_proj[...]
        z, mla_cache, index_cache, _ = self.block(z, mla_cache, index_cache, None, batch, ctx)
        return rms_norm(z, self.head_norm[...], eps), mla_cache, index_cache

    def logits(self, hn, lm_head, vocab_size: int, comm: Collectives | None = None):
        """float32 logits [L, vocab_size] of normed rows `hn` [L, hidden] (vocab-sharded head, gathered over TP by
        `comm`, the mesh's collectives by default)."""
        w = self.head[...] if self.has_head else lm_head
        logits = jnp.einsum("td,dv->tv", hn.astype(w.dtype), w, preferred_element_type=jnp.float32)
        return (comm or Collectives()).all_gather(logits, TP_AXES, axis=1, tiled=True)[:, :vocab_size]


@functools.lru_cache(maxsize=None)
def mtp_graphdef(config: GlmDsaConfig, shared_head: bool):
    """The NNX graph of the nextn layer (structure only)."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: MtpLayer(config, shared_head=shared_head)))
    return graphdef


def cache_config(config: GlmDsaConfig) -> GlmDsaConfig:
    """A one-layer config whose caches are the nextn layer's: one MLA cache and one indexer cache."""
    return config.replace(num_hidden_layers=1, indexer_types=("full",), mlp_layer_types=("sparse",))


def allocate_mtp_caches(config: GlmDsaConfig, num_pages: int, block_size: int, dtype, sharding=None,
                        kv_cache_dtype: str = "auto") -> dict:
    """The nextn layer's own zeroed caches {"mla": (one,), "indexer": (one,)}, paged like the target's (the same
    page table serves both: a request's page holds its rows in every layer, the nextn layer's too)."""
    return allocate_caches(cache_config(config), num_pages, block_size, dtype, sharding, kv_cache_dtype)


def mtp_cache_bytes_per_token(config: GlmDsaConfig, dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of the nextn layer's caches per token."""
    return cache_bytes_per_token(cache_config(config), dtype, kv_cache_dtype)


def run_mtp(target_params, mtp_params, mtp_caches, h, batch: StepBatch, *, config: GlmDsaConfig,
            parallel: ParallelConfig, options: StepOptions):
    """One nextn-layer pass over rows (h [T, hidden], `batch`: tokens, positions, owner slots, ...) on the mesh:
    returns (hn [T, hidden], float32 logits [L, vocab] of the rows `batch.logits_indices`, updated mtp_caches).
    `parallel` resolved; the embedding and (without a shared head) lm_head come from `target_params`."""
    ctx = StepContext(config, block_size=mtp_caches["mla"][0].shape[1], parallel=parallel, options=options)
    graphdef = mtp_graphdef(config, "head" in mtp_params)
    params = {"embed": target_params["embed"], "lm_head": target_params["lm_head"], "mtp": mtp_params}

    def body(params, caches, h, batch):
        layer = nnx.merge(graphdef, params["mtp"])
        mla, index = caches["mla"][0], caches["indexer"][0]
        hn, new_mla, new_index = layer(h, params["embed"], mla, index, batch, ctx)
        logits = layer.logits(hn[batch.logits_indices], params["lm_head"], config.vocab_size, ctx.comm)
        return hn, logits, {"mla": (new_mla.reshape(mla.shape),), "indexer": (new_index.reshape(index.shape),)}

    cspecs = jax.tree.map(lambda _: cache_spec(), mtp_caches)
    f = jax.shard_map(body, mesh=mesh_for(parallel),
                      in_specs=(param_partition_specs(params, parallel.q_replicate), cspecs, P(), P()),
                      out_specs=(P(), P(), cspecs), check_vma=False)
    with matmul_precision(target_params):
        return f(params, mtp_caches, h, batch)


def init_mtp_params(config: GlmDsaConfig, *, seed: int = 0, dtype="bfloat16", parallel=None,
                    shared_head: bool = True) -> dict:
    """Random nextn-layer parameters (the `mtp` subtree: pass it as `Engine(..., mtp_params=...)`), drawn as
    `checkpoints.random` draws them, each made sharded on the mesh of `parallel` (benchmarks, no checkpoint)."""
    parallel = resolve_parallel(parallel, config)
    sharding_for, dt = param_sharding(parallel), resolve_dtype(dtype)
    key = jax.random.key(seed)
    flat = {}
    for path, spec in mtp_param_specs(config, shared_head=shared_head).items():
        mean, std = init_stats(path)
        k = jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)
        make = jax.jit(lambda k, shape=spec.shape, m=mean, s=std, d=jnp.float32 if spec.fp32 else dt:
                       (m + s * jax.random.normal(k, shape, jnp.float32)).astype(d),
                       out_shardings=sharding_for(path, spec.shape))
        flat[path] = make(k)
    return nest_params(flat)["mtp"]
