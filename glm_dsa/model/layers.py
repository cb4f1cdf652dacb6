"""The GLM-5.2 decoder in Flax NNX, written per shard (docs/math.md §2).

Every module computes on the local shard of its parameters inside `jax.shard_map`: head counts and widths
come from the local shapes, and the one reduction a tensor-parallel split needs is a `psum` over the TP
axes after `o_proj` and after each MLP. On a single device those collectives are no-ops. Every collective goes
through the context's `comm` (`sharding.collectives`): the mesh's, or one device's local stand-ins of the same shapes
(`glm_dsa.model.shard`).
Parameter shapes come from `checkpoints.layout`, the single source of truth for names and shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from checkpoints.layout import fp8_scale_shape, kept_fp8_spec, param_specs
from kernels import fused_norm_rope, indexer, moe, rope, sparse_mla
from kernels.common.chunking import map_row_chunks
from kernels.common.norms import rms_norm
from sharding import DCP, TP, TP_AXES, Collectives, ParallelConfig, dcp

from . import linear
from .config import GlmDsaConfig
from .options import StepOptions
from .paged_cache import positions_to_slots
from .taps import NO_TRACE, Tracer


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One ragged step: T token rows (prefill chunks and decode rows mixed) of R requests.

    token_ids, positions, slot_mapping (-1 = write nothing), token_req (the row's request): int32 [T];
    block_tables: int32 [R, pages]; logits_indices: int32 [L], the rows whose logits are returned.
    A row at position -1 is padding (the serving runner pads a step's rows to a static bucket so): it writes
    nothing, attends to nothing and routes to no expert (`MoE.route`); its outputs are never read.
    """

    token_ids: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    token_req: jax.Array
    block_tables: jax.Array
    logits_indices: jax.Array


jax.tree_util.register_dataclass(StepBatch, data_fields=[f.name for f in dataclasses.fields(StepBatch)],
                                 meta_fields=[])


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Static per-step settings shared by the layers: the model, the page size, the resolved `parallel` (QREP
    and backend decided), how to compute (`options`), the tracer (inactive unless glm_dsa.debug.trace runs) and
    the collectives (`comm`: the mesh's, or `sharding.StandInCollectives` for one device's share)."""

    cfg: GlmDsaConfig
    block_size: int
    parallel: ParallelConfig
    options: StepOptions = dataclasses.field(default_factory=StepOptions)
    tracer: Tracer = NO_TRACE
    comm: Collectives = dataclasses.field(default_factory=Collectives)

    @property
    def n(self) -> int:
        return self.parallel.dcp

    def attend_rows(self, rows: int) -> int:
        """Query rows per gather/attend/merge round: all `rows` on one rank (no DCP workspace to bound) and while
        tracing (the tracer records each layer's DCP partials whole), else `options.dcp_row_chunk`."""
        return rows if self.n == 1 or self.tracer.active else self.options.dcp_row_chunk


@dataclasses.dataclass(frozen=True)
class ModelSpecs:
    """The layout's parameter specs and the weights kept FP8 (`checkpoints.quantization`): what `_declare` makes."""

    specs: dict
    fp8: frozenset = frozenset()

    def __getitem__(self, path):
        return self.specs[path]


def _declare(module: nnx.Module, prefix: str, names, specs: ModelSpecs, dtype) -> None:
    """Give `module` a zero Param per name, shaped and typed from the layout (`fp32` params stay float32); a weight
    kept FP8 is float8_e4m3fn with its float32 scale grid `<name>_scale` beside it (glm_dsa.model.linear)."""
    for name in names:
        spec = specs[prefix + name]
        if prefix + name in getattr(specs, "fp8", ()):
            kept = kept_fp8_spec(spec)  # the stored form: K-major for expert stacks
            setattr(module, name, nnx.Param(jnp.zeros(kept.shape, jnp.float8_e4m3fn)))
            setattr(module, name + "_scale", nnx.Param(jnp.zeros(fp8_scale_shape(kept), jnp.float32)))
            continue
        setattr(module, name, nnx.Param(jnp.zeros(spec.shape, jnp.float32 if spec.fp32 else dtype)))


def _swiglu(module, x, names, impl: str, comm: Collectives):
    """down(silu(gate(x)) * up(x)) from `module`'s three weights (bf16 or FP8; gate/up split on their output, down
    on its input over every TP device): `linear.swiglu`."""
    return linear.swiglu(module, names, x, impl=impl, comm=comm, axes=TP_AXES)


class Indexer(nnx.Module):
    """Lightning indexer of a full layer: picks the top-k cached positions for every query row."""

    def __init__(self, specs, prefix, dtype):
        _declare(self, prefix, ("wq_b", "wk", "k_norm_w", "k_norm_b", "weights_proj"), specs, dtype)

    def head_weights(self, h):
        """w[t, h] = weights_proj(h) * Hi^-0.5, times the score scale Di^-0.5 (folded: both > 0)."""
        n_heads, head_dim = self.wq_b.shape[1], self.wq_b.shape[2]
        wp = self.weights_proj[...]
        w = linear.at_decode_rows(lambda h_: h_.astype(jnp.float32) @ wp, h)
        return w * (n_heads ** -0.5) * (head_dim ** -0.5)

    def __call__(self, h, q_n, index_cache, cos, sin, batch: StepBatch, ctx: StepContext):
        """Top-k local positions [T, K] (-1 = none; a set, in no particular order) of the tokens each row attends
        to on this rank; `cos`, `sin` are the layer's rope angles of the rows' positions."""
        cfg, n, inter = ctx.cfg, ctx.n, ctx.parallel.interleave
        qi = linear.apply(self, "wq_b", q_n, impl=ctx.options.impl)
        rot = rope.apply_rope(qi[..., : cfg.qk_rope_head_dim], cos[:, None], sin[:, None],
                              interleave=cfg.indexer_rope_interleave)
        qi = jnp.concatenate([rot, qi[..., cfg.qk_rope_head_dim:]], axis=-1)
        rank = ctx.comm.axis_index(DCP)
        kv_lens = dcp.local_length(batch.positions + 1, rank, n, inter)  # this rank's tokens at or before pos
        out = indexer.indexer_topk(qi, self.head_weights(h), index_cache, batch.token_req, kv_lens,
                                   batch.block_tables, block_size=ctx.block_size, topk=cfg.index_topk,
                                   return_scores=n > 1, ordered=False, impl=ctx.options.impl)
        if n == 1:
            return out
        local_pos, scores = out
        return dcp.global_topk(scores, local_pos, rank, n=n, interleave=inter, topk=cfg.index_topk, comm=ctx.comm)


class MLA(nnx.Module):
    """Multi-head latent attention in the absorbed form over the paged cache, sparse over the indexer's top-k."""

    def __init__(self, cfg: GlmDsaConfig, layer: int, specs, dtype):
        p = f"layers.{layer}.attn."
        _declare(self, p, ("q_a_proj", "q_a_norm", "q_b_proj", "kv_a_proj", "kv_a_norm", "kv_b_proj", "o_proj"),
                 specs, dtype)
        self.indexer = Indexer(specs, p + "indexer.", dtype) if cfg.is_full(layer) else None
        self.layer = layer

    def __call__(self, h, mla_cache, index_cache, topk_prev, batch: StepBatch, ctx: StepContext):
        """(output [T, hidden] summed over the TP devices, mla_cache, index_cache, this layer's top-k) for the
        normed rows `h`; docs/math.md §2 (MLA, Indexer) with the DCP steps of docs/math.md §6."""
        cfg, par, tr = ctx.cfg, ctx.parallel, ctx.tracer.at(self.layer)
        rank = ctx.comm.axis_index(DCP)
        cos, sin = rope.rope_cos_sin(batch.positions, cfg.qk_rope_head_dim, cfg.rope)
        # batch.slot_mapping is the slot on the token's owning rank; the other ranks write nothing for it.
        own_slots = jnp.where(dcp.owner(batch.positions, ctx.n, par.interleave) == rank, batch.slot_mapping, -1)
        # q_a -> norm; kv_a -> norm | rope -> cache (and the indexer's keys -> its cache)
        q_n, mla_cache, index_cache = self.norm_rope_cache(h, mla_cache, index_cache, batch.positions, own_slots,
                                                           ctx)
        tr.record("attn.q_norm", q_n)
        tr.cache_latents(mla_cache, own_slots, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        # q_b -> rope -> absorb W_UK: query rows [T, h, R + Dr] against cache rows [kv | k_pe]
        q_row, q_pe = self.absorbed_query(q_n, cos, sin, ctx)
        tr.heads("attn.q_pe", q_pe, par.q_replicate)
        # indexer top-k (IndexShare: a shared layer reuses the nearest full layer's selection)
        topk = topk_prev if self.indexer is None else self.indexer(h, q_n, index_cache, cos, sin, batch, ctx)
        tr.positions("attn.topk", topk, ctx.n, par.interleave)
        slots = positions_to_slots(topk, batch.token_req, batch.block_tables, ctx.block_size)
        # sparse MLA over the selected rows (under DCP: partials over each rank's tokens, merged by LSE)
        o = map_row_chunks(functools.partial(self.attend, mla_cache=mla_cache, ctx=ctx, tr=tr), (q_row, slots),
                           ctx.attend_rows(q_row.shape[0]))
        # W_UV, o_proj, summed over the heads of every TP device
        w_uv = self.value_up(rank, ctx)
        o_v = linear.at_decode_rows(lambda o_: jnp.einsum("thr,rhd->thd", o_.astype(w_uv.dtype), w_uv), o)
        tr.heads("attn.out", o_v)
        out = ctx.comm.psum(linear.apply(self, "o_proj", o_v, n_in=2, split=("in", TP_AXES), impl=ctx.options.impl,
                                         comm=ctx.comm), TP_AXES)
        return out, mla_cache, index_cache, topk

    def norm_rope_cache(self, h, mla_cache, index_cache, positions, slots, ctx: StepContext):
        """(q latent after q_a_layernorm [T, q_lora_rank], mla_cache, index_cache) with the kv latents (normed
        | roped) and the indexer keys written at `slots` (-1: none): one fused op (docs/math.md §4)."""
        cfg, idx, impl = ctx.cfg, self.indexer, ctx.options.impl
        q_n, mla_cache, index_cache, _ = fused_norm_rope.fused_norm_rope_cache(
            linear.apply(self, "q_a_proj", h, impl=impl), linear.apply(self, "kv_a_proj", h, impl=impl), positions,
            slots,
            self.q_a_norm[...], self.kv_a_norm[...], mla_cache.reshape(-1, mla_cache.shape[-1]),
            rope_theta=cfg.rope, rope_interleave=cfg.rope_interleave,
            index_k=None if idx is None else linear.apply(idx, "wk", h, impl=impl),
            index_norm_w=None if idx is None else idx.k_norm_w[...],
            index_norm_b=None if idx is None else idx.k_norm_b[...],
            index_cache=None if index_cache is None else index_cache.reshape(-1, index_cache.shape[-1]),
            index_rope_interleave=cfg.indexer_rope_interleave, impl=ctx.options.impl)
        return q_n, mla_cache, index_cache

    def absorbed_query(self, q_n, cos, sin, ctx: StepContext):
        """(query rows [T, h, R + Dr] = [q_nope @ W_UK | rope(q_pe)] per head, the roped q_pe [T, h, Dr]).
        With QREP the projections hold the whole DCP group's heads, so no query gather is needed later."""
        cfg = ctx.cfg
        dn = cfg.qk_nope_head_dim
        heads = TP if ctx.parallel.q_replicate else TP_AXES  # QREP: the DCP group's heads, split over 'tp' only
        q = linear.apply(self, "q_b_proj", q_n, split=("out", heads), impl=ctx.options.impl, comm=ctx.comm)
        q_pe = rope.apply_rope(q[..., dn:], cos[:, None], sin[:, None], interleave=cfg.rope_interleave)
        w_uk = self.kv_b_proj[:, :, :dn]
        q_lat = linear.at_decode_rows(lambda q_: jnp.einsum("thd,rhd->thr", q_, w_uk), q[..., :dn])
        return jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1), q_pe

    def attend(self, q_rows, slot_rows, *, mla_cache, ctx: StepContext, tr: Tracer):
        """Attention output [T, h, R] of this rank's heads for query rows [T, h, R + Dr] over the cache rows at
        `slot_rows` [T, K]. Under DCP every rank attends the group's heads over its own tokens and the partials
        are merged by LSE into this rank's heads over all of the group's tokens (docs/math.md §6)."""
        n, par = ctx.n, ctx.parallel
        if n > 1 and not par.q_replicate:
            q_rows = dcp.gather_query_heads(q_rows, ctx.comm)  # the group's heads, rank-major
        o, lse = sparse_mla.sparse_mla(q_rows, mla_cache, slot_rows, scale=ctx.cfg.softmax_scale,
                                       kv_lora_rank=ctx.cfg.kv_lora_rank, impl=ctx.options.impl)
        if n == 1:
            return o
        tr.dcp_partials(o, lse)
        o, lse = (dcp.merge_a2a if par.dcp_comm_backend == "a2a" else dcp.merge_ag_rs)(o, lse, ctx.comm)
        tr.dcp_merged(o, lse)
        return o

    def value_up(self, rank, ctx: StepContext):
        """W_UV [R, h, v_head_dim] of this rank's heads: under QREP kv_b_proj holds the group's heads."""
        w_uv = self.kv_b_proj[:, :, ctx.cfg.qk_nope_head_dim:]
        if ctx.parallel.q_replicate:
            h = w_uv.shape[1] // ctx.n
            w_uv = jax.lax.dynamic_slice_in_dim(w_uv, rank * h, h, axis=1)
        return w_uv


class DenseMLP(nnx.Module):
    def __init__(self, specs, prefix, dtype):
        _declare(self, prefix, ("gate", "up", "down"), specs, dtype)

    def __call__(self, x, options: StepOptions | None = None, comm: Collectives | None = None):
        """The MLP output [T, hidden] summed over the TP devices (`comm`: the step's collectives)."""
        impl, comm = (options or StepOptions()).impl, comm or Collectives()
        return comm.psum(_swiglu(self, x, ("gate", "up", "down"), impl, comm), TP_AXES)


class MoE(nnx.Module):
    """Sigmoid noaux_tc routing with group limits, the routed SwiGLU experts (kernels.moe), plus the shared expert."""

    def __init__(self, cfg: GlmDsaConfig, specs, prefix, dtype):
        names = ["router", "router_bias", "experts_gate", "experts_up", "experts_down"]
        if cfg.n_shared_experts:
            names += ["shared_gate", "shared_up", "shared_down"]
        _declare(self, prefix, names, specs, dtype)
        self.has_shared = bool(cfg.n_shared_experts)

    def route(self, x, cfg: GlmDsaConfig, valid=None):
        """Chosen experts [T, k] and their weights [T, k] (float32). `valid` (bool [T], default all): rows marked
        False (padding) route to no expert: their experts are the sentinel E (one past the last expert, which
        `kernels.moe.routed_experts` computes nowhere) and their weights 0. Padding rows all carry the same token,
        so they would otherwise all pick the same k experts, real work whose output is never read. The scores and
        the top-k run over the decode kind's rows in a batch-invariant decode step (`linear.at_decode_rows`)."""
        experts, w = linear.at_decode_rows(functools.partial(self._route, cfg=cfg), x)
        if valid is not None:
            experts = jnp.where(valid[:, None], experts, self.router.shape[-1])
            w = jnp.where(valid[:, None], w, 0.0)
        return experts, w

    def _route(self, x, cfg: GlmDsaConfig):
        """(experts [T, k], weights [T, k]) of every row of `x`, as `route` without `valid`."""
        s = jax.nn.sigmoid(x.astype(jnp.float32) @ self.router[...])
        choice = s + self.router_bias[...]
        t, e = choice.shape
        if cfg.n_group > 1:
            grouped = choice.reshape(t, cfg.n_group, e // cfg.n_group)
            group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
            _, top_groups = jax.lax.top_k(group_score, cfg.topk_group)
            keep = jnp.zeros((t, cfg.n_group), bool).at[jnp.arange(t)[:, None], top_groups].set(True)
            choice = jnp.where(jnp.repeat(keep, e // cfg.n_group, axis=1), choice, -jnp.inf)
        _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)
        w = jnp.take_along_axis(s, experts, axis=1)
        if cfg.norm_topk_prob:
            w = w / (jnp.sum(w, axis=1, keepdims=True) + 1e-20)
        return experts, w * cfg.routed_scaling_factor

    def expert_scales(self, comm: Collectives | None = None) -> dict:
        """The FP8 experts' keywords for `moe.routed_experts`: their scale grids (this device's blocks of the expert
        width and the width slice's offset in its first block: glm_dsa.model.linear.local_grid) and their K-major layout
        (kept FP8 the stacks are the release's [E, out, in]: gate/up [E, I, D] with grids [E, I-blocks, D-blocks],
        down [E, D, I] with [E, D-blocks, I-blocks]; checkpoints.layout.kept_fp8_spec); {} for bf16 experts."""
        if linear.scale_of(self, "experts_gate") is None:
            return {}
        width, comm = self.experts_gate.shape[1], comm or Collectives()
        wg, off = linear.local_grid(self.experts_gate_scale[...], width, 1, TP_AXES, comm)
        wu, _ = linear.local_grid(self.experts_up_scale[...], width, 1, TP_AXES, comm)
        wd, _ = linear.local_grid(self.experts_down_scale[...], width, 2, TP_AXES, comm)
        return dict(wg_scale=wg, wu_scale=wu, wd_scale=wd, i_offset=off, w_layout="nk")

    def __call__(self, x, cfg: GlmDsaConfig, options: StepOptions | None = None, tracer: Tracer = NO_TRACE,
                 comm: Collectives | None = None, valid=None):
        """The MoE output [T, hidden] summed over the TP devices; `options` picks the experts' impl and form,
        `comm` the collectives (the mesh's by default). `valid` (bool [T], default all rows; the decoder layer
        passes `batch.positions >= 0`): the rows that are not padding. None of a padding row's pairs is computed
        (`route`) and its routed experts' output is 0; its shared expert still runs (a dense GEMM over every row)."""
        options, comm = options or StepOptions(), comm or Collectives()
        experts, weights = self.route(x, cfg, valid)
        tracer.experts(experts, weights, self.router.shape[1])
        out = moe.routed_experts(x, experts, weights, self.experts_gate[...], self.experts_up[...],
                                 self.experts_down[...], impl=options.impl, mode=options.moe_mode,
                                 **self.expert_scales(comm))
        if self.has_shared:
            out = out + _swiglu(self, x, ("shared_gate", "shared_up", "shared_down"), options.impl, comm)
        return comm.psum(out.astype(x.dtype), TP_AXES)


class DecoderLayer(nnx.Module):
    """x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x))."""

    def __init__(self, cfg: GlmDsaConfig, layer: int, specs, dtype):
        p = f"layers.{layer}."
        _declare(self, p, ("input_norm", "post_norm"), specs, dtype)
        self.attn = MLA(cfg, layer, specs, dtype)
        self.moe = MoE(cfg, specs, p + "moe.", dtype) if cfg.is_moe(layer) else None
        self.mlp = None if cfg.is_moe(layer) else DenseMLP(specs, p + "mlp.", dtype)
        self.layer = layer

    def __call__(self, x, mla_cache, index_cache, topk_prev, batch: StepBatch, ctx: StepContext):
        eps, tr = ctx.cfg.rms_norm_eps, ctx.tracer.at(self.layer)
        a, mla_cache, index_cache, topk = self.attn(_row_norm(x, self.input_norm[...], eps), mla_cache, index_cache,
                                                    topk_prev, batch, ctx)
        x = x + a
        h = _row_norm(x, self.post_norm[...], eps)
        x = x + (self.moe(h, ctx.cfg, ctx.options, tr, ctx.comm, valid=batch.positions >= 0) if self.moe is not None
                 else self.mlp(h, ctx.options, ctx.comm))
        tr.record("residual", x)
        return x, mla_cache, index_cache, topk


def _row_norm(x, weight, eps: float):
    """rms_norm of the step's rows, at the decode kind's rows in a batch-invariant decode step
    (`linear.at_decode_rows`): a row's sum over the hidden width is its own, but XLA compiles the reduction, and
    fuses it with its neighbours, for the whole shape, so at a decode step's bucket of rows it need not round a row
    as at another bucket."""
    return linear.at_decode_rows(lambda x_: rms_norm(x_, weight, eps), x)


class GlmDsaModel(nnx.Module):
    """Embedding, decoder layers, final norm and the (vocab-sharded, padded: docs/math.md §14) LM head."""

    def __init__(self, cfg: GlmDsaConfig, dtype=jnp.bfloat16, fp8: frozenset = frozenset()):
        """`fp8`: the weight paths kept FP8 (float8_e4m3fn with a `<name>_scale` grid: checkpoints.quantization)."""
        specs = ModelSpecs(param_specs(cfg), frozenset(fp8))
        _declare(self, "", ("embed", "final_norm", "lm_head"), specs, dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, specs, dtype) for i in range(cfg.num_hidden_layers)])

    def __call__(self, caches, batch: StepBatch, ctx: StepContext, return_hidden: bool = False):
        """Per-shard step: returns (float32 logits [L, vocab_size] of the logits rows, updated caches); an active
        `ctx.tracer` records every layer's intermediate tensors (glm_dsa.debug.trace). The LM head's padding columns
        (past vocab_size) are cut off here, so no caller (logits, sampling, trace) ever sees a pad id.
        `return_hidden` adds every row's final-normed hidden state [T, hidden] (the MTP layer's input,
        glm_dsa.model.mtp)."""
        cfg = ctx.cfg
        x = self.embed[...][batch.token_ids]
        mla, index = list(caches["mla"]), list(caches["indexer"])
        topk = None
        for i, layer in enumerate(self.layers):
            j = cfg.full_layers.index(i) if cfg.is_full(i) else None
            x, mla[i], new_index, topk = layer(x, mla[i], None if j is None else index[j], topk, batch, ctx)
            if j is not None:
                index[j] = new_index.reshape(index[j].shape)
            mla[i] = mla[i].reshape(caches["mla"][i].shape)
        hidden = _row_norm(x, self.final_norm[...], cfg.rms_norm_eps) if return_hidden else None
        x = hidden[batch.logits_indices] if return_hidden else rms_norm(x[batch.logits_indices], self.final_norm[...],
                                                                          cfg.rms_norm_eps)
        logits = jnp.einsum("td,dv->tv", x, self.lm_head[...], preferred_element_type=jnp.float32)
        logits = ctx.comm.all_gather(logits, TP_AXES, axis=1, tiled=True)[:, : cfg.vocab_size]
        out = logits, {"mla": tuple(mla), "indexer": tuple(index)}
        return out + (hidden,) if return_hidden else out
