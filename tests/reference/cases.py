"""Case specs for the reference run against Hugging Face transformers (docs/math.md §1, §2, §10).

Pure Python with no third-party imports: both interpreters read this file, the Python 3.11 one that
runs `hf_reference.py` (torch + transformers) and the Python 3.12 one that runs the JAX tests.

A case spec is a JSON-able dict:
  model_type absent (GLM: `transformers.GlmMoeDsaConfig`) or "deepseek_v32" (`transformers.DeepseekV32Config`)
  config     keyword arguments for that config class (they end up in `config.json`)
  seed       first seed tried for the random weights; `hf_reference.py` moves on to seed+1, ... while the
             drawn model has a near-tie at a top-k boundary (see its docstring) and records the seed it kept
  prompts    token-id lists, run as separate forwards (no padding)
  n_greedy   greedy tokens generated per prompt

Every width is tiny so that the whole reference run takes seconds on two CPU cores; `index_n_heads`
is >= 16 everywhere (docs/math.md §10: few indexer heads make exact relu-zero ties at the top-k boundary likely).

`reference_dir` names the cache directory of a case's outputs: a hash of the case spec and of the
source of `hf_reference.py`, so editing either makes the reference run again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SCRIPT = HERE / "hf_reference.py"
DONE_FILE = "reference.json"  # written last: its presence marks a complete case directory


def default_cache_root() -> Path:
    return Path(os.environ.get("GLM_DSA_REF_CACHE") or REPO / ".ref_cache")


def _prompt(length: int, salt: int, vocab: int = 256) -> list[int]:
    """Deterministic pseudo-random token ids (a 32-bit LCG: identical on every Python version)."""
    x, out = (salt * 2654435761 + 12345) & 0xFFFFFFFF, []
    for _ in range(length):
        x = (1664525 * x + 1013904223) & 0xFFFFFFFF
        out.append((x >> 8) % vocab)
    return out


_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

# Shared geometry: GLM-5 proportions shrunk (docs/math.md §1); no eos/bos/pad so greedy runs never stop early;
# no MTP layer in these checkpoints (`num_nextn_predict_layers` 0 is written to config.json as is).
_BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
    n_group=1, topk_group=1, norm_topk_prob=True, first_k_dense_replace=1,
    index_n_heads=16, index_head_dim=32, index_topk=8,
    rope_parameters=_ROPE, max_position_embeddings=4096, rms_norm_eps=1e-5,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    num_nextn_predict_layers=0,
)


def _case(seed: int, prompt_lens: tuple[int, int], **config) -> dict:
    return {
        "config": {**_BASE, **config},
        "seed": seed,
        "prompts": [_prompt(n, seed * 10 + i) for i, n in enumerate(prompt_lens)],
        "n_greedy": 16,
    }


def _v32_case(seed: int, prompt_lens: tuple[int, int], **config) -> dict:
    """A DeepSeek-V3.2 case (docs/math.md §13): an indexer on every layer (half-split rope), YaRN, 8 expert groups."""
    return {"model_type": "deepseek_v32", **_case(seed, prompt_lens, **{**_V32, **config})}


def _yarn(factor: float, original: int, mscale: float = 1.0, **extra) -> dict:
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor, "original_max_position_embeddings": original,
            "mscale": mscale, "mscale_all_dim": mscale, **extra}


# DeepSeek-V3.2's structure shrunk: YaRN over a short original context (64 positions, factor 8) so that the
# prompts' positions reach the interpolated frequencies; group-limited routing with V3.2's 8 groups / 4 kept.
_V32 = dict(n_routed_experts=16, n_group=8, topk_group=4, num_experts_per_tok=4, rms_norm_eps=1e-6,
            rope_parameters=_yarn(8.0, 64), max_position_embeddings=512)


CASES: dict[str, dict] = {
    # Default schedule (freq 1, offset 2): every layer owns an indexer. top-k 8 against prompts of
    # 23 and 37 tokens, so most query rows attend a strict subset of their past: the sparse case.
    "all_full_sparse": _case(1, (23, 37), num_hidden_layers=4, first_k_dense_replace=1, index_topk=8),
    # GLM-5.2 IndexShare schedule (freq 4, offset 3) on 8 layers: F F F S S S F S. Three dense layers
    # first, as GLM-5 does, then MoE.
    "glm52_shared": _case(2, (20, 40), num_hidden_layers=8, hidden_size=96, first_k_dense_replace=3,
                          index_topk=12, index_topk_freq=4, index_skip_topk_offset=3),
    # Group-limited routing (n_group 4 > topk_group 2, two experts per group), 32 indexer heads; one
    # prompt shorter than top-k (every row attends its whole past), one longer.
    "grouped_router": _case(3, (9, 30), num_hidden_layers=3, hidden_size=128, first_k_dense_replace=1,
                            n_group=4, topk_group=2, index_n_heads=32, index_topk=16),
    # top-k larger than any sequence (dense attention through the indexer path) and an explicit F/S
    # pattern string, which wins over the freq/offset schedule.
    "topk_exceeds_len": _case(4, (12, 26), num_hidden_layers=4, first_k_dense_replace=2, index_topk=64,
                              index_topk_pattern="FSFS"),
    # DeepSeek-V3.2: 4 layers (1 dense), top-k 8 against 23 / 37 tokens, YaRN factor 8 with mscale 1.
    "v32_yarn": _v32_case(5, (23, 37), num_hidden_layers=4, first_k_dense_replace=1, index_topk=8),
    # DeepSeek-V3.2, 8 heads (TP = 8 splits them), 5 layers (2 dense), 32 indexer heads, top-k 12, YaRN factor 4
    # over 64 positions with mscale 0.8 and its own ramp (beta_fast 16, beta_slow 2).
    "v32_yarn_tp8": _v32_case(6, (19, 34), num_hidden_layers=5, first_k_dense_replace=2, num_attention_heads=8,
                              num_key_value_heads=8, index_n_heads=32, index_topk=12,
                              rope_parameters=_yarn(4.0, 64, 0.8, beta_fast=16.0, beta_slow=2.0),
                              max_position_embeddings=256),
    # A prime vocabulary (257: no TP > 1 divides it; the LM head is padded, docs/math.md §14) and 8 heads, so
    # TP = 8 applies; prompts use the last id.
    "glm_prime_vocab": {**_case(7, (21, 33), vocab_size=257, num_attention_heads=8, num_key_value_heads=8,
                                index_topk=8),
                        "prompts": [[256] + _prompt(20, 70, 257), _prompt(32, 71, 257) + [256]]},
}


def spec_hash(spec: dict) -> str:
    """Hash of a case spec and of the reference script's source."""
    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
    h.update(SCRIPT.read_bytes())
    return h.hexdigest()[:16]


def reference_dir(name: str, cache_root: Path | None = None) -> Path:
    """Where case `name`'s checkpoint and reference outputs live (complete iff DONE_FILE exists)."""
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    return root / f"{name}-{spec_hash(CASES[name])}"


def is_complete(path: Path) -> bool:
    return (Path(path) / DONE_FILE).is_file()
