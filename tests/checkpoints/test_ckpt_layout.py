"""The layout's HF keys and shapes are those transformers writes for GLM-5 (`glm_moe_dsa`), listed by hand."""

from __future__ import annotations

import numpy as np

from checkpoints.layout import hf_index, is_mtp_key, ours_from_hf_blocks, param_specs


def _expected_hf(cfg2) -> dict[str, tuple[int, ...]]:
    """What transformers' save_pretrained writes for the 2-layer tiny config (V=256, D=64, I=96, Im=32,
    H=4, Rq=48, Rkv=32, Dn=Dr=16, Dv=24, E=8, index 16 heads x 32): HF linear weights are [out, in]."""
    keys = {
        "model.embed_tokens.weight": (256, 64),
        "model.norm.weight": (64,),
        "lm_head.weight": (256, 64),
    }
    for i in (0, 1):
        h = f"model.layers.{i}."
        keys |= {
            h + "input_layernorm.weight": (64,),
            h + "post_attention_layernorm.weight": (64,),
            h + "self_attn.q_a_proj.weight": (48, 64),
            h + "self_attn.q_a_layernorm.weight": (48,),
            h + "self_attn.q_b_proj.weight": (128, 48),  # 4 heads x (16 nope + 16 rope)
            h + "self_attn.kv_a_proj_with_mqa.weight": (48, 64),  # 32 latent + 16 rope
            h + "self_attn.kv_a_layernorm.weight": (32,),
            h + "self_attn.kv_b_proj.weight": (160, 32),  # 4 heads x (16 nope + 24 v)
            h + "self_attn.o_proj.weight": (64, 96),  # 4 heads x 24 v
        }
    keys |= {  # layer 0 owns an indexer; layer 1 shares it and has none
        "model.layers.0.self_attn.indexer.wq_b.weight": (512, 48),
        "model.layers.0.self_attn.indexer.wk.weight": (32, 64),
        "model.layers.0.self_attn.indexer.k_norm.weight": (32,),
        "model.layers.0.self_attn.indexer.k_norm.bias": (32,),
        "model.layers.0.self_attn.indexer.weights_proj.weight": (16, 64),
    }
    keys |= {  # layer 0 dense MLP
        "model.layers.0.mlp.gate_proj.weight": (96, 64),
        "model.layers.0.mlp.up_proj.weight": (96, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 96),
    }
    keys |= {  # layer 1 MoE
        "model.layers.1.mlp.gate.weight": (8, 64),
        "model.layers.1.mlp.gate.e_score_correction_bias": (8,),
        "model.layers.1.mlp.shared_experts.gate_proj.weight": (32, 64),
        "model.layers.1.mlp.shared_experts.up_proj.weight": (32, 64),
        "model.layers.1.mlp.shared_experts.down_proj.weight": (64, 32),
    }
    for e in range(8):
        x = f"model.layers.1.mlp.experts.{e}."
        keys |= {x + "gate_proj.weight": (32, 64), x + "up_proj.weight": (32, 64), x + "down_proj.weight": (64, 32)}
    return keys


def test_hf_keys_and_shapes_match_transformers(cfg2):
    got = {k: tuple(s) for spec in param_specs(cfg2).values() for k, s in zip(spec.hf_keys, spec.hf_shapes)}
    want = _expected_hf(cfg2)
    assert set(got) == set(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    assert got == want


def test_from_hf_to_hf_invert_each_other(cfg2):
    rng = np.random.default_rng(0)
    for spec in param_specs(cfg2).values():
        ours = rng.standard_normal(spec.shape).astype(np.float32)
        hf = spec.to_hf(ours)
        assert tuple(t.shape for t in hf) == spec.hf_shapes
        np.testing.assert_array_equal(spec.from_hf(*hf), ours)


def test_mtp_keys(cfg2):
    """Only the declared nextn layers (num_hidden_layers + j, j < num_nextn_predict_layers) are MTP (docs/math.md §12)."""
    assert cfg2.num_nextn_predict_layers == 1
    assert is_mtp_key("model.layers.2.eh_proj.weight", cfg2)
    assert is_mtp_key("model.layers.2.self_attn.q_a_proj.weight", cfg2)
    assert not is_mtp_key("model.layers.3.self_attn.q_a_proj.weight", cfg2)  # beyond the nextn layers
    assert not is_mtp_key("model.layers.7.self_attn.q_a_proj.weight", cfg2)
    assert not is_mtp_key("model.layers.1.self_attn.q_a_proj.weight", cfg2)
    assert not is_mtp_key("model.norm.weight", cfg2)
    two = cfg2.replace(num_nextn_predict_layers=2)
    assert is_mtp_key("model.layers.3.eh_proj.weight", two) and not is_mtp_key("model.layers.4.eh_proj.weight", two)
    assert not is_mtp_key("model.layers.2.eh_proj.weight", cfg2.replace(num_nextn_predict_layers=0))


def _cut(a, positions):
    """a cut to the positions (slice or index array) along each axis, one axis at a time."""
    for axis, p in enumerate(positions):
        a = a[(slice(None),) * axis + (p,)]
    return a


def test_shard_from_hf_blocks_matches_from_hf(cfg2):
    """hf_axes (the layout as data) agrees with from_hf: for whole parameters and for random slices of every
    axis, the shard assembled from just the HF rows / columns `hf_index` names is from_hf(...)[index]."""
    rng = np.random.default_rng(1)
    for spec in param_specs(cfg2).values():
        hf = [rng.standard_normal(s).astype(np.float32) for s in spec.hf_shapes]
        full = spec.from_hf(*hf)
        for trial in range(6):
            index = []
            for d in spec.shape:
                lo = int(rng.integers(0, d))
                index.append(slice(lo, int(rng.integers(lo + 1, d + 1))) if trial else slice(None))
            keys, positions = hf_index(spec, index)
            got = ours_from_hf_blocks(spec, index, [_cut(hf[k], positions) for k in keys])
            np.testing.assert_array_equal(got, full[tuple(index)], err_msg=f"{spec.path} {index}")


def test_hf_index_reads_only_the_shard(cfg2):
    """A TP slice of q_b_proj heads reads just those heads' HF rows (a slice); a cut inside each head reads an
    index array of rows; experts sliced on the leading axis read only those experts' tensors."""
    specs = param_specs(cfg2)
    q = specs["layers.0.attn.q_b_proj"]  # [Rq=48, H=4, 32] from HF [128, 48]
    keys, (rows, cols) = hf_index(q, (slice(None), slice(1, 3), slice(None)))
    assert keys == [0] and rows == slice(32, 96) and cols == slice(0, 48)
    keys, (rows, cols) = hf_index(q, (slice(0, 8), slice(1, 3), slice(0, 2)))
    assert list(rows) == [32, 33, 64, 65] and cols == slice(0, 8)
    e = specs["layers.1.moe.experts_down"]  # [E=8, Im, D]
    keys, _ = hf_index(e, (slice(2, 4), slice(None), slice(None)))
    assert keys == [2, 3]
