"""Preset configurations: the real geometries, a tiny one for tests and a reduced-depth one for benchmarks."""

from __future__ import annotations

from .config import GlmDsaConfig

#: GLM-5 / GLM-5.1: every layer owns an indexer; theta 1e6.
glm5 = GlmDsaConfig(
    rope_theta=1e6,
    max_position_embeddings=202752,
    index_topk_freq=1,
    index_skip_topk_offset=2,
)

#: GLM-5.2: IndexShare (freq 4, offset 3) -> 21 full layers and 57 shared; theta 8e6; 1M context.
glm52 = GlmDsaConfig(
    rope_theta=8e6,
    max_position_embeddings=1048576,
    index_topk_freq=4,
    index_skip_topk_offset=3,
)

#: Tiny model for CPU tests: a dense layer, full and shared indexer layers, grouped routing.
tiny = GlmDsaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=24,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=8,
    indexer_types=("full", "full", "shared", "shared"),
    rope_theta=10000.0,
    max_position_embeddings=4096,
    eos_token_id=(1,),
    pad_token_id=0,
)

#: GLM-5.2 widths at reduced depth for benchmarks: a dense layer, a full-indexer MoE layer, two shared layers.
bench = glm52.replace(
    num_hidden_layers=4,
    first_k_dense_replace=1,
    indexer_types=("full", "full", "shared", "shared"),
)

#: GLM-5.2's attention geometry (64 heads, 576-wide MLA rows, a 32 x 128 indexer) at hidden 1024, 4 layers and 16
#: experts: the GPU tests and diagnostics run the kernels at their real tile shapes in seconds.
heads = glm52.replace(
    num_hidden_layers=4,
    hidden_size=1024,
    intermediate_size=1024,
    moe_intermediate_size=256,
    n_routed_experts=16,
    num_experts_per_tok=4,
    q_lora_rank=512,
    vocab_size=4096,
    first_k_dense_replace=1,
    index_topk=64,
)

#: A small model with GLM-5.2's structure (IndexShare schedule, 3 dense layers then MoE) for the demo.
demo = GlmDsaConfig(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=8,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=16,
    num_experts_per_tok=4,
    first_k_dense_replace=3,
    index_n_heads=16,
    index_head_dim=64,
    index_topk=16,
    index_topk_freq=4,
    index_skip_topk_offset=3,
    rope_theta=8e6,
    max_position_embeddings=4096,
    eos_token_id=(1,),
    pad_token_id=0,
)

#: DeepSeek-V3.2 (HF `DeepseekV32Config` / the release's config.json): 61 layers (3 dense), 128 heads, q_lora 1536,
#: qk_nope 128 + rope 64, v_head 128, an indexer of 64 x 128 on every layer (half-split rope), 256 experts in 8
#: groups (4 kept), vocab 129280, YaRN factor 40 over 4096 original positions (mscale = mscale_all_dim = 1); QREP
#: off by default (docs/math.md §13).
deepseek_v32 = GlmDsaConfig.from_dict({
    "model_type": "deepseek_v32",
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rope_theta": 10000, "max_position_embeddings": 163840, "num_nextn_predict_layers": 1,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc",
}, source="preset deepseek_v32")

#: One TP=2 shard of DeepSeek-V3.2 on one GPU: its 64 heads (128 / 2) and its halves of the dense and expert widths,
#: with the whole indexer (64 heads, replicated) and every other dimension real, for the GPU benchmarks.
deepseek_v32_tp2_shard = deepseek_v32.replace(
    num_attention_heads=64,
    intermediate_size=deepseek_v32.intermediate_size // 2,
    moe_intermediate_size=deepseek_v32.moe_intermediate_size // 2,
)

#: One TP=8 shard of DeepSeek-V3.2 on one GPU: 16 heads (128 / 8), an eighth of the dense and expert widths, the
#: whole 64-head indexer; the geometry where each device's sparse MLA has the fewest heads.
deepseek_v32_tp8_shard = deepseek_v32.replace(
    num_attention_heads=16,
    intermediate_size=deepseek_v32.intermediate_size // 8,
    moe_intermediate_size=deepseek_v32.moe_intermediate_size // 8,
)

PRESETS = {"glm5": glm5, "glm52": glm52, "tiny": tiny, "bench": bench, "heads": heads, "demo": demo,
           "deepseek_v32": deepseek_v32, "deepseek_v32_tp2_shard": deepseek_v32_tp2_shard,
           "deepseek_v32_tp8_shard": deepseek_v32_tp8_shard}


def get(name: str) -> GlmDsaConfig:
    """Look a preset up by name."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None
