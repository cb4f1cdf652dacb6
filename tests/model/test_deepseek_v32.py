"""DeepSeek-V3.2 (`deepseek_v32`) on the GLM-5.x path (docs/math.md §13): its config (the release's config.json and
the preset), YaRN frequencies against a float64 oracle, the QREP default, `info`, and random V3.2 checkpoints (bf16
and the FP8 release) across layouts. The comparison with HF's `DeepseekV32ForCausalLM` is in tests/reference."""

import json
import math

import numpy as np
import pytest

import glm_dsa
from checkpoints.fp8_blocks import write_fp8_release
from checkpoints.loader import HFCheckpoint
from checkpoints.random import write_random_checkpoint
from glm_dsa import ParallelConfig, configs
from glm_dsa.cli import main
from glm_dsa.model.config import ConfigError, GlmDsaConfig
from kernels.common.rope import YarnRope, inv_freq

# The fields of DeepSeek-V3.2-Exp's config.json (HF layout, FP8 release) that matter here, as released.
RELEASE = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "ep_size": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}

#: A tiny V3.2: indexer on every layer, group routing (8 groups, 4 kept), YaRN over 32 original positions.
TINY = GlmDsaConfig(
    model_type="deepseek_v32", vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=16, n_group=8, topk_group=4, num_experts_per_tok=4,
    first_k_dense_replace=1, index_n_heads=16, index_head_dim=32, index_topk=8, indexer_rope_interleave=False,
    rope_theta=10000.0, max_position_embeddings=256, rms_norm_eps=1e-6, eos_token_id=(1,), pad_token_id=None,
    rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 1.0,
                  "mscale_all_dim": 1.0},
)


def yarn_inv_freq_oracle(dim, theta, factor, orig, beta_fast=32.0, beta_slow=1.0):
    """YaRN frequencies in float64, written from the paper's definitions (not from kernels.common.rope): the index i
    whose wavelength 2 pi theta^(2i/dim) fits `rotations` times into the original context is
    dim ln(orig / (2 pi rotations)) / (2 ln theta); indices below the beta_fast one keep theta^(-2i/dim), above the
    beta_slow one are divided by `factor`, in between a linear blend."""
    def index(rotations):
        return dim * math.log(orig / (2 * math.pi * rotations)) / (2 * math.log(theta))
    low, high = max(math.floor(index(beta_fast)), 0), min(math.ceil(index(beta_slow)), dim - 1)
    out = []
    for i in range(dim // 2):
        base = theta ** (-2.0 * i / dim)
        t = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep (extrapolate), 1: interpolate
        out.append(base * (1 - t) + base / factor * t)
    return np.array(out)


def test_release_config_reads_as_v32():
    cfg = GlmDsaConfig.from_dict(RELEASE, source="release config.json")
    assert cfg.model_type == "deepseek_v32" and cfg.indexer_types == ("full",) * 61
    assert cfg.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 58
    assert (cfg.rope_interleave, cfg.indexer_rope_interleave) == (True, False)  # MLA interleaved, indexer halves
    assert (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) == (8, 4, 8)
    assert cfg.eos_token_id == (1,) and cfg.rms_norm_eps == 1e-6
    # YaRN: softmax scale (128 + 64)^-0.5 * (0.1 ln 40 + 1)^2, by hand
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    assert cfg.rope == YarnRope(theta=10000.0, factor=40.0, original_max_position_embeddings=4096)
    assert cfg.parallel_defaults == {"dcp_q_replicate": False, "dcp_comm_backend": "a2a"}
    assert configs.glm52.parallel_defaults["dcp_q_replicate"] is True
    assert GlmDsaConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["architectures"] == ["DeepseekV32ForCausalLM"]
    assert cfg == configs.deepseek_v32


def test_preset_is_v32_at_its_real_dims():
    c = configs.deepseek_v32
    assert (c.num_hidden_layers, c.num_attention_heads, c.q_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
            c.v_head_dim, c.index_n_heads, c.index_head_dim, c.vocab_size) == (61, 128, 1536, 128, 64, 128, 64, 128,
                                                                               129280)
    assert c.rope_scaling.factor == 40 and c.padded_vocab_size == 129280  # 129280 = 1010 * 128: no padding
    shard = configs.deepseek_v32_tp2_shard
    assert shard.num_attention_heads == 64 and shard.index_n_heads == 64 and shard.mla_row_dim == 576
    assert shard.with_depth(4).indexer_types == ("full",) * 4
    tp8 = configs.deepseek_v32_tp8_shard  # 128 heads / 8, widths / 8, the indexer whole
    assert (tp8.num_attention_heads, tp8.index_n_heads, tp8.moe_intermediate_size, tp8.intermediate_size) == \
        (16, 64, 2048 // 8, 18432 // 8)


def test_yarn_frequencies_match_a_float64_oracle():
    for dim, theta, factor, orig, bf, bs in ((64, 10000.0, 40.0, 4096, 32.0, 1.0), (16, 10000.0, 8.0, 64, 32.0, 1.0),
                                             (16, 500.0, 4.0, 64, 16.0, 2.0)):
        got = np.asarray(inv_freq(dim, YarnRope(theta, factor, orig, bf, bs)), np.float64)
        want = yarn_inv_freq_oracle(dim, theta, factor, orig, bf, bs)
        np.testing.assert_allclose(got, want, rtol=2e-6)
        plain = theta ** (-np.arange(0, dim, 2) / dim)
        assert np.abs(got / plain - 1).max() > 0.5  # some frequencies are interpolated: YaRN changes them
    np.testing.assert_allclose(np.asarray(inv_freq(16, 1e4)), 1e4 ** (-np.arange(0, 16, 2) / 16), rtol=1e-6)


@pytest.mark.parametrize("change,match", [
    ({"rope_scaling": {**RELEASE["rope_scaling"], "mscale_all_dim": 0.707}}, "attention_factor"),
    ({"rope_scaling": {**RELEASE["rope_scaling"], "original_max_position_embeddings": None}},
     "original_max_position_embeddings"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type' is 'linear'"),
    ({"rope_scaling": {**RELEASE["rope_scaling"], "low_freq_factor": 1}}, "low_freq_factor"),
    ({"model_type": "deepseek_v3"}, "model_type' is 'deepseek_v3'"),
    ({"model_type": "glm_moe_dsa"}, "rope_type' is 'yarn'.*DeepSeek-V3.2 only"),  # GLM-5.x: plain RoPE only
    ({"indexer_types": ["full", "shared"] * 30 + ["full"]}, None),  # ignored: V3.2 has an indexer everywhere
])
def test_config_errors_name_the_field(change, match):
    d = {**RELEASE, **change}
    if match is None:
        assert GlmDsaConfig.from_dict(d).indexer_types == ("full",) * 61
        return
    with pytest.raises(ConfigError, match=match) as e:
        GlmDsaConfig.from_dict(d, source="v32/config.json")
    assert "v32/config.json" in str(e.value)


def test_v32_with_shared_indexer_layers_is_refused():
    with pytest.raises(ConfigError, match="DeepSeek-V3.2 has an indexer on every layer"):
        TINY.replace(indexer_types=("full", "shared", "full"))


def test_qrep_default_off_and_on_when_asked(monkeypatch):
    monkeypatch.delenv("GLM_DSA_DCP_Q_REPLICATE", raising=False)
    d = TINY.parallel_defaults
    assert ParallelConfig(4, 2).resolve(d).q_replicate is False
    assert ParallelConfig(4, 2, dcp_q_replicate=True).resolve(d).q_replicate is True
    assert ParallelConfig(4, 2).resolve(d, env={"GLM_DSA_DCP_Q_REPLICATE": "1"}).q_replicate is True
    assert ParallelConfig(4, 2).resolve(configs.tiny.parallel_defaults).q_replicate is True


def _info(capsys, *argv) -> dict:
    assert main(["info", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out[out.index("{"):])


def test_info_preset_and_checkpoint_show_the_qrep_default(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("GLM_DSA_DCP_Q_REPLICATE", raising=False)
    info = _info(capsys, "--preset", "deepseek_v32", "-tp", "8")
    assert info["model_type"] == "deepseek_v32" and info["layers"] == 61 and info["shared_indexer_layers"] == []
    assert info["dcp_q_replicate_model_default"] is False and info["dcp_q_replicate_requested"] is False
    assert info["vocab_size"] == info["padded_vocab_size"] == 129280
    assert info["rope_scaling"]["factor"] == 40
    info = _info(capsys, "--preset", "deepseek_v32", "-tp", "8", "--dcp-q-replicate")
    assert info["dcp_q_replicate_requested"] is True and info["dcp_q_replicate"] is False  # DCP = 1: not in effect
    info = _info(capsys, "--preset", "deepseek_v32", "-tp", "8", "-dcp", "8", "--dcp-q-replicate")
    assert info["dcp_q_replicate"] is True
    assert info["param_bytes_per_device_with_qrep"] != info["param_bytes_per_device_without_qrep"]
    assert _info(capsys, "--preset", "glm52", "-tp", "8")["dcp_q_replicate_model_default"] is True

    write_random_checkpoint(TINY, tmp_path / "v32", dtype="float32", progress=False)
    info = _info(capsys, "--checkpoint", str(tmp_path / "v32"), "-tp", "4", "-dcp", "2")
    assert info["model_type"] == "deepseek_v32" and info["dcp_q_replicate"] is False
    assert info["dcp_q_replicate_model_default"] is False and info["full_indexer_layers"] == [0, 1, 2]
    info = _info(capsys, "--checkpoint", str(tmp_path / "v32"), "-tp", "4", "-dcp", "2", "--dcp-q-replicate")
    assert info["dcp_q_replicate"] is True


@pytest.fixture(scope="module")
def v32_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("v32")
    write_random_checkpoint(TINY, path, seed=3, dtype="float32", progress=False)
    return path


PROMPTS = [[5, 9, 33, 7, 100, 200, 3, 17, 250, 1, 2, 64, 65, 66, 90, 91, 12, 13, 14, 40],
           list(range(10, 40))]


def _logits(eng):
    return [np.asarray(eng.logits(np.array([p])))[0] for p in PROMPTS]


def test_v32_checkpoint_layouts_agree(v32_ckpt):
    """A random V3.2 checkpoint in float32: TP = 2 and TP = 4 x DCP = 2 (QREP off, its default, and on) give the
    one-device logits (to summation order) and greedy tokens."""
    one = glm_dsa.load(v32_ckpt, dtype="float32", max_model_len=64, progress=False)
    assert one.config == TINY
    ref, greedy = _logits(one), one.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])
    for par in (ParallelConfig(2), ParallelConfig(4, 2), ParallelConfig(4, 2, dcp_q_replicate=True)):
        eng = glm_dsa.load(v32_ckpt, dtype="float32", max_model_len=64, progress=False, parallel=par)
        for a, b in zip(ref, _logits(eng)):
            assert np.abs(a - b).max() <= 1e-5, par
        assert eng.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[]) == greedy, par


def test_v32_fp8_release_loads(v32_ckpt, tmp_path):
    """The FP8 release form (e4m3 + 128 x 128 block scales, indexer wq_b / wk included) loads to the logits of
    the weights it rounds: against the float32 checkpoint, a relative error of e4m3's order."""
    fp8 = tmp_path / "v32-fp8"
    write_fp8_release(v32_ckpt, fp8)
    ck = HFCheckpoint(fp8)
    assert ck.is_block_scaled("model.layers.1.self_attn.indexer.wq_b.weight")
    assert ck.is_block_scaled("model.layers.2.self_attn.indexer.wk.weight")
    assert not ck.is_block_scaled("model.layers.1.self_attn.indexer.weights_proj.weight")
    f32 = glm_dsa.load(v32_ckpt, dtype="float32", max_model_len=64, progress=False)
    q = glm_dsa.load(fp8, dtype="float32", max_model_len=64, progress=False, parallel=ParallelConfig(2))
    assert q.config == TINY
    for a, b in zip(_logits(f32), _logits(q)):
        rel = np.linalg.norm(a - b) / np.linalg.norm(a)
        assert 0 < rel < 0.1, rel
