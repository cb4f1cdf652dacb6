"""GlmDsaConfig: HF config.json parsing, schedules, validation errors that name the field."""

import json

import pytest

from glm_dsa import ConfigError, GlmDsaConfig, configs
from glm_dsa.model.config import indexer_schedule


def _write(tmp_path, **fields):
    d = configs.tiny.to_dict()
    d.update(fields)
    for k in [k for k, v in fields.items() if v is None]:
        d.pop(k)
    (tmp_path / "config.json").write_text(json.dumps(d))
    return tmp_path


def test_glm52_schedule_is_21_full_57_shared():
    full = configs.glm52.full_layers
    assert full[:5] == (0, 1, 2, 6, 10) and full[-1] == 74 and len(full) == 21
    assert configs.glm52.num_hidden_layers - len(full) == 57
    assert all(configs.glm5.is_full(i) for i in range(78))
    assert [configs.glm52.is_moe(i) for i in range(4)] == [False, False, False, True]


def test_round_trip_and_schedule_fields(tmp_path):
    assert GlmDsaConfig.from_pretrained(_write(tmp_path)) == configs.tiny
    cfg = GlmDsaConfig.from_pretrained(_write(tmp_path, indexer_types=None, index_topk_freq=4,
                                              index_skip_topk_offset=3, num_hidden_layers=8, mlp_layer_types=None,
                                              first_k_dense_replace=2))
    assert cfg.indexer_types == indexer_schedule(8, 4, 3) == ("full",) * 3 + ("shared",) * 3 + ("full", "shared")
    assert cfg.mlp_layer_types == ("dense",) * 2 + ("sparse",) * 6
    cfg = GlmDsaConfig.from_pretrained(_write(tmp_path, indexer_types=None, index_topk_pattern="FSSF"))
    assert cfg.indexer_types == ("full", "shared", "shared", "full")
    cfg = GlmDsaConfig.from_pretrained(_write(tmp_path, rope_parameters=None, rope_theta=5e5))
    assert cfg.rope_theta == 5e5


@pytest.mark.parametrize("fields,match", [
    ({"model_type": "deepseek_v3"}, r"field 'model_type' is 'deepseek_v3'"),
    ({"num_attention_heads": 0}, r"'num_attention_heads' must be a positive integer"),
    ({"n_group": 3}, r"'n_routed_experts' \(8\) must be divisible by 'n_group' \(3\)"),
    ({"indexer_types": ["shared", "full", "full", "full"]}, r"layer 0 must be 'full'"),
    ({"indexer_types": ["full", "full"]}, r"'indexer_types' has 2 entries for num_hidden_layers=4"),
    ({"indexer_types": None, "index_topk_pattern": "FXSS"}, r"'index_topk_pattern' has characters \['X'\]"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4}}, r"rope_type' is 'yarn'"),
    ({"hidden_act": "gelu"}, r"'hidden_act' is 'gelu'"),
    ({"index_head_dim": 8}, r"'index_head_dim' \(8\) must be >= 'qk_rope_head_dim' \(16\)"),
])
def test_errors_name_the_field(tmp_path, fields, match):
    with pytest.raises(ConfigError, match=match) as e:
        GlmDsaConfig.from_pretrained(_write(tmp_path, **fields))
    assert "config.json" in str(e.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        GlmDsaConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        GlmDsaConfig.from_pretrained(tmp_path)


def test_presets():
    assert configs.get("bench").hidden_size == 6144 and configs.get("bench").num_hidden_layers == 4
    assert configs.bench.indexer_types == ("full", "full", "shared", "shared")
    # `heads` keeps GLM-5.2's attention geometry (the kernels' real tile shapes) at a small width
    h, g = configs.get("heads"), configs.glm52
    assert (h.num_attention_heads, h.kv_lora_rank, h.qk_rope_head_dim, h.index_n_heads, h.index_head_dim) == \
        (g.num_attention_heads, g.kv_lora_rank, g.qk_rope_head_dim, g.index_n_heads, g.index_head_dim)
    assert h.hidden_size == 1024 and h.indexer_types == ("full", "full", "full", "shared")
    with pytest.raises(KeyError, match="unknown preset"):
        configs.get("glm6")
