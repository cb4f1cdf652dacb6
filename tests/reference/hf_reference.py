"""Reference outputs of HF `GlmMoeDsaForCausalLM` / `DeepseekV32ForCausalLM` for glm-dsa's comparison tests.

Runs under the Python 3.11 reference interpreter (CPU torch + transformers >= 5.13), as its own process;
the JAX side only reads the files it writes. For each case spec (see `cases.py`) it:

1. builds a random float32 model of the spec's `model_type` (`GlmMoeDsaForCausalLM` by default,
   `DeepseekV32ForCausalLM` for "deepseek_v32") with eager attention and re-draws every weight from
   its own generator (scaled so activations stay O(1), norms and the router bias not trivial, and
   `lm_head` large enough that greedy decoding has clear winners);
2. runs each prompt as one full forward without cache (`use_cache=False`) and keeps the fp32 logits;
3. decodes `n_greedy` tokens per prompt by a plain loop of full forwards (argmax of the last row, append);
4. guards against ambiguous references (docs/math.md §10). Forward hooks recompute, in every forward of steps
   2-3, each full layer's indexer scores and each MoE router's choice scores, check that they select
   what HF selected, and measure the margin at the selection boundary: indexer k-th vs (k+1)-th score
   (k = min(index_topk, #causal candidates), rows with more candidates than k), router top_k-th vs
   next expert and topk_group-th vs next group. Greedy steps record top-1 minus top-2 logit. If any
   margin is below its threshold the model is re-drawn with the next seed;
5. writes `config.json` + `model.safetensors` (HF `save_pretrained`), `reference.npz` (`logits_<i>`:
   float32 [T_i, vocab]) and, last, `reference.json` (prompts, greedy tokens, margins, seed, versions,
   and `sparsity_effect`: how far the logits move when attention ignores the top-k).

Usage:
  python hf_reference.py [--cache-dir DIR] [--force] [CASE ...]   cached runs of named cases (default all)
  python hf_reference.py --spec SPEC.json --out DIR                 one spec, no cache
The cached directory of a case is `cases.reference_dir(name)`; a complete one is reused as is.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases  # noqa: E402  (sibling module, pure Python)

# Acceptance thresholds of the guard. Two fp32 implementations that sum in different orders differ
# by ~1e-6 relative in a score; the tests allow 1e-4 absolute on logits, so a greedy margin of 2e-3 is
# ten times what any passing implementation could need (2 x 1e-4).
INDEXER_MIN_REL_MARGIN = 1e-5  # (k-th - (k+1)-th score) / max |score| of the row's candidates
ROUTER_MIN_MARGIN = 1e-5       # absolute, on sigmoid scores + correction bias (O(1) values)
GREEDY_MIN_MARGIN = 2e-3       # absolute top-1 minus top-2 logit at every greedy step
MAX_SEEDS = 16                 # seeds tried per case before giving up
LM_HEAD_GAIN = 4.0             # logits std ~ this: well-separated greedy choices

# model_type -> (config class, model class); a spec without "model_type" is GLM.
MODELS = {"glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM),
          "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM)}
INDEXERS = (hf_glm.GlmMoeDsaIndexer, hf_v32.DeepseekV32Indexer)
ROUTERS = (hf_glm.GlmMoeDsaTopkRouter, hf_v32.DeepseekV32TopkRouter)


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
def build_model(config_kwargs: dict, seed: int, model_type: str = "glm_moe_dsa"):
    """A float32 eager-attention model of `model_type` whose every weight is drawn here from `seed`."""
    torch.manual_seed(seed)
    config_cls, model_cls = MODELS[model_type]
    config = config_cls(**config_kwargs, attn_implementation="eager")
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            if name.endswith("e_score_correction_bias"):
                new = normal(t.shape, 0.05)
            elif name.endswith("k_norm.bias"):
                new = normal(t.shape, 0.1)
            elif t.ndim == 1:  # RMSNorm / LayerNorm weights: around 1, not all equal
                new = 1.0 + normal(t.shape, 0.2)
            elif name == "model.embed_tokens.weight":
                new = normal(t.shape, 1.0)
            elif name == "lm_head.weight":
                new = normal(t.shape, LM_HEAD_GAIN / t.shape[-1] ** 0.5)
            else:  # [out, in] linears and stacked experts [E, out, in]: unit-variance outputs
                new = normal(t.shape, t.shape[-1] ** -0.5)
            t.copy_(new)
    return model


# ----------------------------------------------------------------------------------------------
# Guard: selection margins, measured by forward hooks
# ----------------------------------------------------------------------------------------------
class MarginProbe:
    """Forward hooks that measure how close each indexer / router selection is to a tie."""

    def __init__(self, model):
        self.indexer_abs = float("inf")
        self.indexer_rel = float("inf")
        self.indexer_rows = 0  # rows with more candidates than k (where a tie could matter)
        self.router_expert = float("inf")
        self.router_group = float("inf")
        self.handles = []
        for name, mod in model.named_modules():
            if isinstance(mod, INDEXERS):
                self.handles.append(mod.register_forward_hook(self._indexer_hook, with_kwargs=True))
            elif isinstance(mod, ROUTERS):
                self.handles.append(mod.register_forward_hook(self._router_hook))

    def close(self):
        for h in self.handles:
            h.remove()

    @staticmethod
    def indexer_scores(ix, hidden, q_resid, position_embeddings) -> torch.Tensor:
        """docs/math.md §2 indexer scores [B, S, S] (before the causal mask), from the module's own weights; the
        rope is GLM's interleaved one or DeepSeek-V3.2's half-split one (docs/math.md §13)."""
        b, s, _ = hidden.shape
        r = ix.qk_rope_head_dim
        q = ix.wq_b(q_resid).view(b, s, ix.n_heads, ix.head_dim)
        k = ix.k_norm(ix.wk(hidden))[:, :, None, :]  # one key head
        cos, sin = position_embeddings
        rotate = (hf_v32.apply_rotary_pos_emb if isinstance(ix, hf_v32.DeepseekV32Indexer)
                  else hf_glm.apply_rotary_pos_emb_interleave)
        q_rot, k_rot = rotate(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., r:]], dim=-1).float()
        k = torch.cat([k_rot, k[..., r:]], dim=-1)[:, :, 0].float()
        logits = F.relu(torch.einsum("bshd,btd->bsht", q, k) * ix.softmax_scale)
        w = ix.weights_proj(hidden).float() * ix.n_heads ** -0.5
        return torch.einsum("bsh,bsht->bst", w, logits)

    def _indexer_hook(self, ix, args, kwargs, out):
        names = ("hidden_states", "q_resid", "position_embeddings")
        hidden, q_resid, pos = (args[i] if i < len(args) else kwargs[n] for i, n in enumerate(names))
        scores = self.indexer_scores(ix, hidden, q_resid, pos)  # [B, S, S]
        k, s = ix.index_topk, scores.shape[-1]
        if s <= k:  # no row has more causal candidates than k
            return
        # No cache: row t has position t and candidates 0..t; rows t >= k have more than k of them.
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        rows = scores.masked_fill(future, float("-inf"))[:, k:]  # [B, S-k, S]
        top = rows.sort(dim=-1, descending=True)
        margin = top.values[..., k - 1] - top.values[..., k]
        scale = rows.abs().masked_fill(future[k:], 0.0).amax(-1).clamp_min(1e-30)
        rel = margin / scale
        self.indexer_rows += margin.numel()
        self.indexer_abs = min(self.indexer_abs, float(margin.min()))
        self.indexer_rel = min(self.indexer_rel, float(rel.min()))
        # Where the choice is unambiguous, our scores must select exactly what HF selected.
        ours = top.indices[..., :k].sort(-1).values
        hf = out[:, k:].long().sort(-1).values
        bad = (ours != hf).any(-1) & (rel >= INDEXER_MIN_REL_MARGIN)
        if bad.any():
            raise AssertionError(f"indexer recompute disagrees with HF's top-k at layer {ix.layer_idx}")

    def _router_hook(self, router, args, out):
        logits, _, hf_idx = out
        choice = logits.float().sigmoid() + router.e_score_correction_bias
        n, g = router.num_experts, router.num_group
        if g > 1 and router.topk_group < g:
            group_scores = choice.view(-1, g, n // g).topk(2, dim=-1).values.sum(-1)
            top = group_scores.sort(dim=-1, descending=True).values
            self.router_group = min(self.router_group,
                                    float((top[:, router.topk_group - 1] - top[:, router.topk_group]).min()))
            keep = group_scores.topk(router.topk_group, dim=-1).indices
            allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, keep, True)
            choice = choice.masked_fill(~allowed.repeat_interleave(n // g, dim=1), float("-inf"))
        top = choice.sort(dim=-1, descending=True)
        k = router.top_k
        if torch.isfinite(top.values[:, k]).any():
            gap = top.values[:, k - 1] - top.values[:, k]
            self.router_expert = min(self.router_expert, float(gap[torch.isfinite(gap)].min()))
        ours = top.indices[:, :k].sort(-1).values
        if not torch.equal(ours, hf_idx.sort(-1).values):
            raise AssertionError("router recompute disagrees with HF's expert choice")

    def summary(self) -> dict:
        """Minimum margins seen; None where no selection had a boundary (e.g. top-k >= every length)."""
        def fin(x):
            return None if x == float("inf") else x
        return {"indexer_min_abs": fin(self.indexer_abs), "indexer_min_rel": fin(self.indexer_rel),
                "indexer_rows_checked": self.indexer_rows, "router_expert_min": fin(self.router_expert),
                "router_group_min": fin(self.router_group)}


# ----------------------------------------------------------------------------------------------
# One reference run
# ----------------------------------------------------------------------------------------------
@torch.inference_mode()
def run_once(spec: dict, seed: int):
    model = build_model(spec["config"], seed, spec.get("model_type", "glm_moe_dsa"))
    probe = MarginProbe(model)
    try:
        logits = [model(torch.tensor([p]), use_cache=False).logits[0].float().numpy() for p in spec["prompts"]]
        greedy, greedy_margins = [], []
        for p in spec["prompts"]:
            ids, new, margins = list(p), [], []
            for _ in range(spec["n_greedy"]):
                last = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
                top2 = torch.topk(last, 2).values
                margins.append(float(top2[0] - top2[1]))
                tok = int(torch.argmax(last))
                new.append(tok)
                ids.append(tok)
            greedy.append(new)
            greedy_margins.append(margins)
    finally:
        probe.close()
    margins = probe.summary()
    margins["greedy_min"] = min(min(m) for m in greedy_margins)
    margins["greedy_per_step"] = greedy_margins
    return model, logits, greedy, margins


@torch.inference_mode()
def sparsity_effect(model, prompts, logits) -> list[float]:
    """Max |logits| change per prompt when every indexer keeps all tokens (dense attention): how much
    the comparison can see of the top-k selection (large where index_topk < the prompt length)."""
    indexers = [m for m in model.modules() if isinstance(m, INDEXERS)]
    saved = [m.index_topk for m in indexers]
    try:
        for m in indexers:
            m.index_topk = 1 << 30
        return [float(np.abs(model(torch.tensor([p]), use_cache=False).logits[0].float().numpy() - ref).max())
                for p, ref in zip(prompts, logits)]
    finally:
        for m, k in zip(indexers, saved):
            m.index_topk = k


def guard_failures(m: dict) -> list[str]:
    """Reasons this draw is ambiguous (empty: accept it). None margins had no boundary to check."""
    checks = [("indexer_min_rel", INDEXER_MIN_REL_MARGIN, "indexer k-th/(k+1)-th score margin (relative)"),
              ("router_expert_min", ROUTER_MIN_MARGIN, "router top_k-th/next expert margin"),
              ("router_group_min", ROUTER_MIN_MARGIN, "router topk_group-th/next group margin"),
              ("greedy_min", GREEDY_MIN_MARGIN, "greedy top-1/top-2 logit margin")]
    return [f"{what} {m[key]:.3g} < {limit}" for key, limit, what in checks
            if m[key] is not None and m[key] < limit]


def build_reference(spec: dict, out_dir: Path, name: str | None = None) -> dict:
    """Run the reference for `spec` (re-drawing seeds until unambiguous) and write it into `out_dir`."""
    t0 = time.perf_counter()
    rejected = []
    for seed in range(spec["seed"], spec["seed"] + MAX_SEEDS):
        model, logits, greedy, margins = run_once(spec, seed)
        failures = guard_failures(margins)
        if not failures:
            break
        rejected.append({"seed": seed, "why": failures})
    else:
        raise RuntimeError(f"case {name}: no seed in {MAX_SEEDS} tries gives an unambiguous reference: {rejected}")

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    np.savez(out_dir / "reference.npz", **{f"logits_{i}": x for i, x in enumerate(logits)})
    meta = {
        "case": name, "spec": spec, "seed": seed, "rejected_seeds": rejected,
        "prompts": spec["prompts"], "greedy": greedy, "margins": margins,
        "sparsity_effect": sparsity_effect(model, spec["prompts"], logits),
        "thresholds": {"indexer_min_rel": INDEXER_MIN_REL_MARGIN, "router_min": ROUTER_MIN_MARGIN,
                       "greedy_min": GREEDY_MIN_MARGIN},
        "indexer_types": list(getattr(model.config, "indexer_types", None)  # DeepSeek-V3.2: all layers full
                              or ["full"] * model.config.num_hidden_layers),
        "mlp_layer_types": list(model.config.mlp_layer_types),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "seconds": round(time.perf_counter() - t0, 3),
    }
    (out_dir / cases.DONE_FILE).write_text(json.dumps(meta, indent=1))  # last: marks the directory complete
    return meta


def build_cached(name: str, cache_root: Path, force: bool = False) -> Path:
    """Build case `name` into its cache directory unless a complete one exists; returns the directory."""
    final = cases.reference_dir(name, cache_root)
    if cases.is_complete(final) and not force:
        return final
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=cache_root))
    os.chmod(tmp, 0o755)
    try:
        build_reference(cases.CASES[name], tmp, name)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help=f"cases to build (default: all of {sorted(cases.CASES)})")
    ap.add_argument("--cache-dir", type=Path, default=None, help="default: $GLM_DSA_REF_CACHE or <repo>/.ref_cache")
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument("--spec", type=Path, help="a JSON case spec to run without cache (with --out)")
    ap.add_argument("--out", type=Path, help="output directory for --spec")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and results do not vary with cores
    if a.spec is not None:
        if a.out is None:
            ap.error("--spec needs --out")
        meta = build_reference(json.loads(a.spec.read_text()), a.out, a.spec.stem)
        print(json.dumps({"out": str(a.out), "seed": meta["seed"], "seconds": meta["seconds"]}))
        return 0
    root = a.cache_dir or cases.default_cache_root()
    for name in a.names or sorted(cases.CASES):
        if name not in cases.CASES:
            ap.error(f"unknown case {name!r}; known: {sorted(cases.CASES)}")
        t0 = time.perf_counter()
        path = build_cached(name, root, a.force)
        meta = json.loads((path / cases.DONE_FILE).read_text())
        m = meta["margins"]
        print(json.dumps({"case": name, "dir": str(path), "seed": meta["seed"],
                          "seconds": round(time.perf_counter() - t0, 3),
                          **{k: v for k, v in m.items() if k != "greedy_per_step"}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
