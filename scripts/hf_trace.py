"""Dump the glm_dsa trace names (see glm_dsa/debug/trace.py) from Hugging Face transformers' GlmMoeDsaForCausalLM.

A standalone script for the reference environment (torch + transformers >= 5.13; it imports nothing from
glm_dsa, so it runs under Python 3.11):

    python scripts/hf_trace.py --checkpoint DIR --prompt-ids 1,2,3 --out hf.safetensors

Forward hooks record module inputs and outputs; the rope parts are recomputed from the hooked projections
with HF's own rotary function and converted from HF's de-interleaved layout ([even..., odd...]) to the
interleaved one. HF's top-k rows list non-causal positions when a row has fewer candidates than k: those
become -1.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch


def _interleave(x: torch.Tensor) -> torch.Tensor:
    """HF's rotated output [..., a0 a1 .. | b0 b1 ..] -> pairs (a0, b0, a1, b1, ...)."""
    half = x.shape[-1] // 2
    return torch.stack([x[..., :half], x[..., half:]], dim=-1).reshape(x.shape)


def trace_hf(model, ids: list[int]) -> dict[str, np.ndarray]:
    """Run `ids` through an eval-mode GlmMoeDsaForCausalLM and return the trace tensors (one sequence)."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    cfg = model.config
    dn, dr, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    t = len(ids)
    out: dict[str, torch.Tensor] = {}
    grab: dict = {}
    hooks = [model.model.rotary_emb.register_forward_hook(lambda m, i, o: grab.__setitem__("cos_sin", o))]

    def rope(x, heads_axis_present: bool):
        cos, sin = grab["cos_sin"]
        q = x if heads_axis_present else x[:, None]
        rot, _ = hf.apply_rotary_pos_emb_interleave(q, q, cos, sin)
        return _interleave(rot if heads_axis_present else rot[:, 0])

    for i, layer in enumerate(model.model.layers):
        p, attn = f"layers.{i}.", layer.self_attn

        def keep(name, fn=lambda o: o, p=p):
            return lambda m, inp, o: out.__setitem__(p + name, fn(o).detach()[0])

        hooks += [
            attn.q_a_layernorm.register_forward_hook(keep("attn.q_norm")),
            attn.kv_a_layernorm.register_forward_hook(keep("attn.kv_norm")),
            attn.kv_a_proj_with_mqa.register_forward_hook(keep("attn.k_pe", lambda o: rope(o[..., r:], False))),
            attn.q_b_proj.register_forward_hook(keep("attn.q_pe", lambda o: rope(
                o.view(1, t, -1, dn + dr).transpose(1, 2)[..., dn:], True).transpose(1, 2))),
            attn.register_forward_hook(keep("attn.topk", lambda o: o[2])),
            attn.o_proj.register_forward_pre_hook(
                lambda m, inp, p=p: out.__setitem__(p + "attn.out", inp[0].detach()[0].view(t, -1, cfg.v_head_dim))),
            layer.register_forward_hook(keep("residual", lambda o: o[0] if isinstance(o, tuple) else o)),
        ]
        if hasattr(layer.mlp, "gate"):
            def route(m, inp, o, p=p):
                _, w, e = o
                order = torch.argsort(e, dim=-1)
                out[p + "moe.experts"] = torch.gather(e, 1, order).detach()
                out[p + "moe.weights"] = torch.gather(w, 1, order).detach()
            hooks.append(layer.mlp.gate.register_forward_hook(route))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    res = {}
    for k, v in out.items():
        if k.endswith("attn.topk"):
            v = torch.where(v > torch.arange(t)[:, None], -1, v)  # non-causal picks of short rows
        res[k] = v.numpy().astype(np.int32 if not v.is_floating_point() else np.float32)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    ap.add_argument("--out", required=True, help="output .safetensors")
    args = ap.parse_args(argv)
    from safetensors.numpy import save_file
    from transformers import GlmMoeDsaForCausalLM

    torch.set_num_threads(1)
    model = GlmMoeDsaForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = [int(x) for x in args.prompt_ids.replace(" ", ",").split(",") if x]
    save_file({k: np.ascontiguousarray(v) for k, v in trace_hf(model, ids).items()}, args.out,
              metadata={"source": "transformers", "checkpoint": args.checkpoint})


if __name__ == "__main__":
    main()
