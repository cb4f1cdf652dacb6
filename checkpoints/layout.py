"""The parameter layout: our flat parameter paths and shapes, and how each maps to HF safetensors keys (math.md §8).

A parameter path is a dot-separated string (`layers.3.attn.q_b_proj`). Every entry knows its global shape,
whether it stays float32 whatever the compute dtype, and how to build it from HF tensors (`from_hf`) or
split it back into them (`to_hf`). HF linear weights are [out, in]; ours are [in, out], with heads made an
explicit axis so that tensor parallelism shards one axis. Routed experts are stacked on a leading axis.
`hf_axes` states that mapping as data (which of our axes each HF axis is split into), so a loader can read just
the HF rows and columns one device's shard of a parameter needs (`hf_index`, `ours_from_hf_blocks`).

The LM head is stored with `padded_vocab_size(vocab_size)` output columns (zeros past vocab_size) so that any
power-of-two tensor-parallel split divides it (docs/math.md §14); HF tensors keep exactly vocab_size rows.

`cfg` is duck-typed (any object with the GlmDsaConfig fields), so this package does not import the model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: its path, global shape, the HF keys it comes from and the two conversions."""

    path: str
    shape: tuple[int, ...]
    hf_keys: tuple[str, ...]
    from_hf: Callable[..., np.ndarray]  # (*hf arrays in hf_keys order) -> ours
    to_hf: Callable[[np.ndarray], tuple[np.ndarray, ...]]  # ours -> hf arrays in hf_keys order
    hf_shapes: tuple[tuple[int, ...], ...]
    fp32: bool = False  # kept in float32 whatever the compute dtype (router, indexer weights_proj)
    # The same conversion as data: for each axis of an HF tensor, the axes of ours it is split into (C order).
    # With several hf_keys, our axis 0 stacks them (one per key) and the groups name our other axes.
    # E.g. q_b_proj, HF [H * (Dn + Dr), Rq] -> ours [Rq, H, Dn + Dr]: ((1, 2), (0,)). None: not described.
    hf_axes: tuple[tuple[int, ...], ...] | None = None
    # A linear weight an FP8 release stores block-scaled: (lead, n_in, n_out) counts of our axes: `lead` stacked
    # axes (experts), then the `n_in` axes that flatten to the HF input axis, then the `n_out` that flatten to its
    # output axis. Kept in FP8, its scale grid is [*lead, ceil(in / 128), ceil(out / 128)] (`fp8_scale_shape`):
    # the HF `weight_scale_inv` grids transposed (and stacked). None: never FP8 (norms, embeddings, router, ...).
    fp8_grid: tuple[int, int, int] | None = None
    # Kept FP8, this weight is stored K-major: its last two axes swapped to the release's [*lead, out, in] (routed
    # expert stacks, whose grouped-GEMM kernel feeds Hopper's fp8 MMA, which takes a K-major B operand without a
    # transpose: BENCHMARKS.md, FP8 weights). `kept_fp8_spec` gives that stored form.
    fp8_kmajor: bool = False
    # This spec *is* a stored K-major form (`kept_fp8_spec`): its shape, hf_axes and scale grid are the release's.
    kmajor: bool = False


#: The LM head's columns are padded to a multiple of this: every power-of-two TP size up to 128 divides the padded
#: width, and FP8 releases' 128 x 128 weight blocks tile it whole. Vocabularies already a multiple (GLM-5.x's
#: 154880, DeepSeek-V3.2's 129280) are not padded at all.
VOCAB_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int) -> int:
    """`vocab_size` rounded up to a multiple of `VOCAB_PAD_MULTIPLE`: the LM head's stored width."""
    return -(-int(vocab_size) // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE


def _lm_head(n_in, vocab, padded):
    """HF [vocab, in] -> ours [in, padded]: the transposed weight, zero columns past vocab (pad logits are 0 and
    cut off by the model). Padded, the layout is not described as data (hf_axes None): a loader reads the whole
    tensor, which only odd vocabularies need."""
    conv = _linear(n_in, vocab)
    if padded == vocab:
        return conv

    def from_hf(w):
        out = np.zeros((n_in, padded), w.dtype)
        out[:, :vocab] = w.T
        return out

    def to_hf(a):
        return (np.ascontiguousarray(np.asarray(a)[:, :vocab].T),)

    return dict(from_hf=from_hf, to_hf=to_hf, hf_shapes=((vocab, n_in),), hf_axes=None)


def _identity(shape):
    return dict(from_hf=lambda a: a, to_hf=lambda a: (a,), hf_shapes=(shape,),
                hf_axes=tuple((i,) for i in range(len(shape))))


def _linear(n_in, n_out, out_split=None):
    """HF [out, in] -> ours [in, *out_split] (out_split factors `out`, e.g. (heads, head_dim))."""
    out_split = out_split or (n_out,)

    def from_hf(w):
        return w.T.reshape(n_in, *out_split)

    def to_hf(a):
        return (np.ascontiguousarray(a.reshape(n_in, n_out).T),)

    return dict(from_hf=from_hf, to_hf=to_hf, hf_shapes=((n_out, n_in),),
                hf_axes=(tuple(range(1, 1 + len(out_split))), (0,)))


def _linear_heads_in(heads, head_dim, n_out):
    """HF [out, heads*head_dim] -> ours [heads, head_dim, out] (o_proj)."""

    def from_hf(w):
        return w.T.reshape(heads, head_dim, n_out)

    def to_hf(a):
        return (np.ascontiguousarray(a.reshape(heads * head_dim, n_out).T),)

    return dict(from_hf=from_hf, to_hf=to_hf, hf_shapes=((n_out, heads * head_dim),), hf_axes=((2,), (0, 1)))


def _stacked_experts(n_experts, n_in, n_out):
    """HF per-expert [out, in] weights -> ours [E, in, out]."""

    def from_hf(*ws):
        return np.stack([w.T for w in ws])

    def to_hf(a):
        return tuple(np.ascontiguousarray(a[e].T) for e in range(n_experts))

    return dict(from_hf=from_hf, to_hf=to_hf, hf_shapes=((n_out, n_in),) * n_experts, hf_axes=((2,), (1,)))


def param_specs(cfg) -> dict[str, ParamSpec]:
    """Every parameter of the model `cfg` describes, keyed by path, in a stable order."""
    D, V = cfg.hidden_size, cfg.vocab_size
    H, Dn, Dr, Dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    Rq, Rkv = cfg.q_lora_rank, cfg.kv_lora_rank
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    E, Im = cfg.n_routed_experts, cfg.moe_intermediate_size
    Is = Im * cfg.n_shared_experts
    specs: dict[str, ParamSpec] = {}

    def add(path, shape, hf_keys, conv, fp32=False, fp8=None, kmajor=False):
        specs[path] = ParamSpec(path, tuple(shape), tuple(hf_keys), fp32=fp32, fp8_grid=fp8, fp8_kmajor=kmajor,
                                **conv)

    col, heads_out, heads_in, experts = (0, 1, 1), (0, 1, 2), (0, 2, 1), (1, 1, 1)  # fp8_grid of each kind

    add("embed", (V, D), ["model.embed_tokens.weight"], _identity((V, D)))
    for i in range(cfg.num_hidden_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        add(p + "input_norm", (D,), [h + "input_layernorm.weight"], _identity((D,)), fp32=True)
        add(p + "post_norm", (D,), [h + "post_attention_layernorm.weight"], _identity((D,)), fp32=True)
        a, ha = p + "attn.", h + "self_attn."
        add(a + "q_a_proj", (D, Rq), [ha + "q_a_proj.weight"], _linear(D, Rq), fp8=col)
        add(a + "q_a_norm", (Rq,), [ha + "q_a_layernorm.weight"], _identity((Rq,)), fp32=True)
        add(a + "q_b_proj", (Rq, H, Dn + Dr), [ha + "q_b_proj.weight"], _linear(Rq, H * (Dn + Dr), (H, Dn + Dr)),
            fp8=heads_out)
        add(a + "kv_a_proj", (D, Rkv + Dr), [ha + "kv_a_proj_with_mqa.weight"], _linear(D, Rkv + Dr), fp8=col)
        add(a + "kv_a_norm", (Rkv,), [ha + "kv_a_layernorm.weight"], _identity((Rkv,)), fp32=True)
        add(a + "kv_b_proj", (Rkv, H, Dn + Dv), [ha + "kv_b_proj.weight"],
            _linear(Rkv, H * (Dn + Dv), (H, Dn + Dv)), fp8=heads_out)
        add(a + "o_proj", (H, Dv, D), [ha + "o_proj.weight"], _linear_heads_in(H, Dv, D), fp8=heads_in)
        if cfg.indexer_types[i] == "full":
            x, hx = a + "indexer.", ha + "indexer."
            add(x + "wq_b", (Rq, Hi, Di), [hx + "wq_b.weight"], _linear(Rq, Hi * Di, (Hi, Di)), fp8=heads_out)
            add(x + "wk", (D, Di), [hx + "wk.weight"], _linear(D, Di), fp8=col)
            add(x + "k_norm_w", (Di,), [hx + "k_norm.weight"], _identity((Di,)), fp32=True)
            add(x + "k_norm_b", (Di,), [hx + "k_norm.bias"], _identity((Di,)), fp32=True)
            add(x + "weights_proj", (D, Hi), [hx + "weights_proj.weight"], _linear(D, Hi), fp32=True)
        if cfg.mlp_layer_types[i] == "dense":
            m, hm, inter = p + "mlp.", h + "mlp.", cfg.intermediate_size
            add(m + "gate", (D, inter), [hm + "gate_proj.weight"], _linear(D, inter), fp8=col)
            add(m + "up", (D, inter), [hm + "up_proj.weight"], _linear(D, inter), fp8=col)
            add(m + "down", (inter, D), [hm + "down_proj.weight"], _linear(inter, D), fp8=col)
        else:
            m, hm = p + "moe.", h + "mlp."
            add(m + "router", (D, E), [hm + "gate.weight"], _linear(D, E), fp32=True)
            add(m + "router_bias", (E,), [hm + "gate.e_score_correction_bias"], _identity((E,)), fp32=True)
            for name in ("gate", "up"):
                add(m + f"experts_{name}", (E, D, Im), [hm + f"experts.{e}.{name}_proj.weight" for e in range(E)],
                    _stacked_experts(E, D, Im), fp8=experts, kmajor=True)
            add(m + "experts_down", (E, Im, D), [hm + f"experts.{e}.down_proj.weight" for e in range(E)],
                _stacked_experts(E, Im, D), fp8=experts, kmajor=True)
            if Is:
                add(m + "shared_gate", (D, Is), [hm + "shared_experts.gate_proj.weight"], _linear(D, Is), fp8=col)
                add(m + "shared_up", (D, Is), [hm + "shared_experts.up_proj.weight"], _linear(D, Is), fp8=col)
                add(m + "shared_down", (Is, D), [hm + "shared_experts.down_proj.weight"], _linear(Is, D), fp8=col)
    add("final_norm", (D,), ["model.norm.weight"], _identity((D,)), fp32=True)
    lm_key = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    Vp = padded_vocab_size(V)
    add("lm_head", (D, Vp), [lm_key], _lm_head(D, V, Vp))
    return specs


def fp8_scale_shape(spec: ParamSpec, block: int = 128) -> tuple[int, ...]:
    """The scale grid of `spec` kept in FP8: [*lead, ceil(in / block), ceil(out / block)] over its flattened
    input and output axes (see `ParamSpec.fp8_grid`)."""
    if spec.fp8_grid is None:
        raise ValueError(f"parameter '{spec.path}' is not a linear weight: it has no FP8 form")
    lead, n_in, _ = spec.fp8_grid
    ins, outs = spec.shape[lead:lead + n_in], spec.shape[lead + n_in:]
    return (*spec.shape[:lead], -(-math.prod(ins) // block), -(-math.prod(outs) // block))


def kept_fp8_spec(spec: ParamSpec) -> ParamSpec:
    """The spec of `spec`'s weight as stored when kept FP8: `spec` itself, or for a K-major weight
    (`fp8_kmajor`: routed experts [E, in, out]) the release's per-expert tensors stacked as they are,
    [E, out, in], whose scale grid (`fp8_scale_shape`) is then [E, out-blocks, in-blocks]: the HF
    `weight_scale_inv` grids stacked, untransposed. Its `fp8_grid` counts the stored axes in order (lead, then
    the out axis, then the in axis). Idempotent."""
    if not spec.fp8_kmajor or spec.kmajor:
        return spec
    lead, n_in, n_out = spec.fp8_grid
    if (lead, n_in, n_out) != (1, 1, 1) or len(spec.hf_keys) != spec.shape[0]:
        raise ValueError(f"parameter '{spec.path}': only stacks of [out, in] tensors can be kept K-major")
    e, k, n = spec.shape

    def to_hf(a):
        return tuple(np.ascontiguousarray(a[i]) for i in range(e))

    return dataclasses.replace(spec, shape=(e, n, k), from_hf=lambda *ws: np.stack(ws), to_hf=to_hf,
                               hf_axes=((1,), (2,)), kmajor=True)


def is_mtp_key(key: str, cfg) -> bool:
    """Keys of the declared multi-token-prediction (nextn) layers, skipped on load (docs/math.md §12): layer
    `num_hidden_layers + j` for j < `num_nextn_predict_layers` (0 when `cfg` has no such field). A layer beyond
    those is not MTP: a checkpoint holding it is deeper than the config says, and its tensors are unexpected."""
    if not key.startswith("model.layers."):
        return False
    idx = key.split(".")[2]
    if not idx.isdigit():
        return False
    first = cfg.num_hidden_layers
    return first <= int(idx) < first + int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)


# ---- one shard of a parameter from the HF tensors (loaders that read only what a device holds) ---------------

def _positions(dims: Sequence[int], slices: Sequence[slice]) -> np.ndarray | slice:
    """Positions along an HF axis that factors (C order) into our axes of sizes `dims`, cut to `slices` of those
    axes: a slice when they are contiguous (the usual case), else an index array."""
    pos = np.arange(math.prod(dims), dtype=np.int64).reshape(tuple(dims))[tuple(slices)].reshape(-1)
    if pos.size and np.array_equal(pos, np.arange(pos[0], pos[0] + pos.size)):
        return slice(int(pos[0]), int(pos[0]) + pos.size)
    return pos


def _check_index(spec: ParamSpec, index: Sequence[slice]) -> tuple[slice, ...]:
    if spec.hf_axes is None:
        raise ValueError(f"parameter '{spec.path}' has no hf_axes: its HF layout is not described as data")
    if len(index) != len(spec.shape) or not all(isinstance(s, slice) for s in index):
        raise ValueError(f"index {index!r} is not one slice per axis of parameter '{spec.path}' {list(spec.shape)}")
    return tuple(slice(*s.indices(d)) for s, d in zip(index, spec.shape))


def hf_index(spec: ParamSpec, index: Sequence[slice]) -> tuple[list[int], tuple[np.ndarray | slice, ...]]:
    """What the shard `ours[index]` (one slice per axis of ours) needs from the HF tensors: the positions in
    `spec.hf_keys` of the tensors it reads and, for each HF axis, the positions along it (a slice or an index
    array), so that `ours_from_hf_blocks(spec, index, [hf[k][np.ix_-style positions] ...])` is the shard."""
    index = _check_index(spec, index)
    stacked = len(spec.hf_keys) > 1
    keys = list(range(len(spec.hf_keys)))[index[0]] if stacked else [0]
    axes = tuple(_positions([spec.shape[a] for a in group], [index[a] for a in group]) for group in spec.hf_axes)
    return keys, axes


def ours_from_hf_blocks(spec: ParamSpec, index: Sequence[slice], blocks: Sequence, xp=np):
    """The shard `ours[index]` from the HF blocks that `hf_index` names (one per key, each cut to its positions
    per HF axis): reshaped and transposed into our layout, stacked for multi-key parameters. `xp` is numpy or
    jax.numpy (a device can assemble its own shard)."""
    index = _check_index(spec, index)
    lens = tuple(len(range(*s.indices(d))) for s, d in zip(index, spec.shape))
    return assemble_shard(spec.hf_axes, len(spec.hf_keys) > 1, lens, blocks, xp)


def assemble_shard(hf_axes: tuple[tuple[int, ...], ...], stacked: bool, lens: Sequence[int], blocks: Sequence,
                   xp=np):
    """`ours_from_hf_blocks` from plain values (a ParamSpec's `hf_axes`, whether it stacks its keys, the shard's
    lengths along our axes), so a jitted caller can take them as static arguments shared across layers."""
    order = [a for group in hf_axes for a in group]  # our axes in the order a reshaped HF block has them
    perm = [order.index(a) for a in range(1 if stacked else 0, len(lens))]
    parts = [xp.transpose(xp.reshape(b, [lens[a] for a in order]), perm) for b in blocks]
    return xp.stack(parts) if stacked else parts[0]
