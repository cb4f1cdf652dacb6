"""The layout of the multi-token-prediction (nextn) layer (docs/math.md §12): our `mtp.*` parameter paths and the
HF keys `model.layers.{L}.*` they come from, L = num_hidden_layers.

    mtp.enorm, mtp.hnorm      <- enorm.weight, hnorm.weight (RMSNorm of the token embedding / the target hidden)
    mtp.eh_proj               <- eh_proj.weight [H, 2H] (ours [2H, H]: rows [embedding | hidden])
    mtp.block.*               <- the decoder layer's tensors (self_attn.*, mlp.*, *_layernorm), laid out as any
                                 decoder layer's (`layout.param_specs`)
    mtp.head_norm             <- shared_head.norm.weight
    mtp.head                  <- shared_head.head.weight, only when the checkpoint has it: without it the nextn layer
                                 uses the target's lm_head (a missing head gave NaN logits in vLLM #34385)

The layer's own `embed_tokens` copy (DeepSeek-V3-style releases store one) is not loaded: the nextn layer shares
the target's embedding, as in the DeepSeek-V3 report and vLLM. The decoder layer always has its own indexer (the
schedule puts one on GLM-5.2's layer 78; a checkpoint without it fails the loader's missing-tensor check) and is
MoE or dense by `first_k_dense_replace`, as any layer at its depth.

`cfg` is duck-typed (a GlmDsaConfig: fields plus `replace` and `scheduled_mlp_layer_types`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .layout import ParamSpec, param_specs

#: Path prefix of the nextn layer's parameters; its decoder layer is under `MTP_BLOCK`.
MTP_PREFIX = "mtp."
MTP_BLOCK = "mtp.block."


def mtp_layer_index(cfg) -> int:
    """L: the nextn layer is `model.layers.{L}` in HF checkpoints, L = num_hidden_layers."""
    return int(cfg.num_hidden_layers)


def mtp_block_config(cfg):
    """`cfg` one layer deeper, whose last layer (L) is the nextn layer's decoder block: with its own indexer, MoE or
    dense by the config's dense-layer schedule. Model code builds the block as `DecoderLayer(this, L, ...)`."""
    n = mtp_layer_index(cfg)
    mlp = cfg.scheduled_mlp_layer_types(n + 1)[n]
    return cfg.replace(num_hidden_layers=n + 1, indexer_types=tuple(cfg.indexer_types) + ("full",),
                       mlp_layer_types=tuple(cfg.mlp_layer_types) + (mlp,))


def mtp_param_specs(cfg, *, shared_head: bool = True) -> dict[str, ParamSpec]:
    """The nextn layer's parameters keyed by `mtp.*` path (see the module docstring); `shared_head` False: no
    `mtp.head` (the checkpoint has no shared_head.head; the target's lm_head stands in)."""
    n, d = mtp_layer_index(cfg), cfg.hidden_size
    h = f"model.layers.{n}."
    target = param_specs(mtp_block_config(cfg))  # the target's specs plus layer L: norms and the head are reused

    def like(path, spec, key):  # the same shape and conversion as `spec`, read from another HF key
        return dataclasses.replace(spec, path=path, hf_keys=(key,))

    specs = {p: like(p, target["final_norm"], h + k)
             for p, k in (("mtp.enorm", "enorm.weight"), ("mtp.hnorm", "hnorm.weight"))}
    specs["mtp.eh_proj"] = ParamSpec(
        "mtp.eh_proj", (2 * d, d), (h + "eh_proj.weight",),
        from_hf=lambda w: np.ascontiguousarray(w.T), to_hf=lambda a: (np.ascontiguousarray(np.asarray(a).T),),
        hf_shapes=((d, 2 * d),), hf_axes=((1,), (0,)))
    layer = f"layers.{n}."
    for path, spec in target.items():
        if path.startswith(layer):
            specs[MTP_BLOCK + path[len(layer):]] = dataclasses.replace(spec, path=MTP_BLOCK + path[len(layer):])
    specs["mtp.head_norm"] = like("mtp.head_norm", target["final_norm"], h + "shared_head.norm.weight")
    if shared_head:
        specs["mtp.head"] = like("mtp.head", target["lm_head"], h + "shared_head.head.weight")
    return specs

