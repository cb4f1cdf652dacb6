"""A bad checkpoint fails with one `CheckpointError` naming the culprit, before anything reaches a device."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from checkpoints import CheckpointError, load_hf_params, param_specs, save_hf_params

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture
def single(tmp_path, cfg2, make_params):
    save_hf_params(make_params(cfg2, np.float32), cfg2, tmp_path)
    return tmp_path


@pytest.fixture
def sharded(tmp_path, cfg2, make_params):
    save_hf_params(make_params(cfg2, np.float32), cfg2, tmp_path, max_shard_bytes=60_000)
    return tmp_path


def _shards(path):
    return sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))


def _edit(path, fn):
    """Rewrite model.safetensors with the safetensors package after fn(tensors) edits the dict."""
    tensors = load_file(path / SINGLE)
    fn(tensors)
    save_file(tensors, path / SINGLE)


def _load(path, cfg, **kw):
    """Load, recording every parameter that reached placement."""
    placed = []

    def sharding_for(p, shape):
        placed.append(p)
        return None

    try:
        return load_hf_params(path, cfg, dtype=np.float32, sharding_for=sharding_for, progress=False, **kw)
    finally:
        _load.placed = placed


def _fails(path, cfg, *fragments):
    with pytest.raises(CheckpointError) as e:
        _load(path, cfg)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))
    assert _load.placed == []  # nothing was placed on a device
    return str(e.value)


def test_missing_tensor(single, cfg2):
    key = "model.layers.1.mlp.experts.5.down_proj.weight"
    _edit(single, lambda t: t.pop(key))
    _fails(single, cfg2, "missing", key, "'layers.1.moe.experts_down'")


def test_unexpected_tensor(single, cfg2):
    key = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _edit(single, lambda t: t.update({key: np.ones(8, np.float32)}))
    _fails(single, cfg2, "unexpected", key, SINGLE)


def test_indexer_in_a_shared_layer_is_unexpected(single, cfg2):
    key = "model.layers.1.self_attn.indexer.wk.weight"
    _edit(single, lambda t: t.update({key: np.ones((32, 64), np.float32)}))
    _fails(single, cfg2, "unexpected", key)


def test_wrong_shape(single, cfg2):
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    _edit(single, lambda t: t.update({key: np.ones((33, 64), np.float32)}))
    _fails(single, cfg2, key, os.path.join(str(single), SINGLE), "[33, 64]", "expected [32, 64]")


def test_wrong_shape_in_last_shard_is_found_before_placing(sharded, cfg2):
    last = _shards(sharded)[-1]
    tensors = load_file(sharded / last)
    key = sorted(tensors)[0]
    tensors[key] = np.ones((3, 5), np.float32)
    save_file(tensors, sharded / last)
    _fails(sharded, cfg2, key, last, "[3, 5]")


def test_truncated_file(single, cfg2):
    f = single / SINGLE
    os.truncate(f, f.stat().st_size - 10)
    _fails(single, cfg2, str(f), "truncated")


def test_truncated_last_shard_fails_before_placing(sharded, cfg2):
    f = sharded / _shards(sharded)[-1]
    os.truncate(f, f.stat().st_size - 1)
    _fails(sharded, cfg2, str(f), "truncated")


def test_file_cut_inside_header(single, cfg2):
    f = single / SINGLE
    os.truncate(f, 100)
    _fails(single, cfg2, str(f), "truncated")


def test_trailing_garbage(single, cfg2):
    f = single / SINGLE
    with open(f, "ab") as fh:
        fh.write(b"\0" * 16)
    _fails(single, cfg2, str(f), "corrupt")


@pytest.mark.parametrize("damage", ["json", "length", "offsets", "dtype"])
def test_corrupt_header(single, cfg2, damage):
    f = single / SINGLE
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    if damage == "json":
        raw = raw[:8] + b"#" * 16 + raw[24:]
    elif damage == "length":
        raw = struct.pack("<Q", 1 << 60) + raw[8:]
    else:
        k = "model.layers.0.self_attn.q_a_proj.weight"
        if damage == "offsets":
            header[k]["data_offsets"][1] += 4
        else:
            header[k]["dtype"] = "Q7"
        new = json.dumps(header, separators=(",", ":")).encode()
        new += b" " * (n - len(new))
        assert len(new) == n
        raw = raw[:8] + new + raw[8 + n:]
    f.write_bytes(raw)
    _fails(single, cfg2, str(f), "corrupt")


def test_index_names_missing_shard(sharded, cfg2):
    gone = _shards(sharded)[1]
    os.unlink(sharded / gone)
    _fails(sharded, cfg2, gone, INDEX, "does not exist")


def test_index_points_at_wrong_shard(sharded, cfg2):
    index = json.loads((sharded / INDEX).read_text())
    key = "model.norm.weight"
    first = _shards(sharded)[0]
    assert index["weight_map"][key] != first
    index["weight_map"][key] = first
    (sharded / INDEX).write_text(json.dumps(index))
    _fails(sharded, cfg2, key, first)


def test_corrupt_index(sharded, cfg2):
    (sharded / INDEX).write_text("{not json")
    _fails(sharded, cfg2, INDEX, "corrupt")


def test_no_safetensors(tmp_path, cfg2):
    _fails(tmp_path, cfg2, str(tmp_path), "no safetensors")


def test_shards_without_index(sharded, cfg2):
    os.unlink(sharded / INDEX)
    _fails(sharded, cfg2, "no safetensors", "model-00001-of-")


def test_missing_directory(tmp_path, cfg2):
    _fails(tmp_path / "nope", cfg2, "nope", "does not exist")


def test_checkpoint_of_another_geometry(single, cfg2):
    deeper = cfg2.replace(num_hidden_layers=3, indexer_types=("full", "shared", "shared"))
    _fails(single, deeper, "missing", "model.layers.2.")


def test_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_config_shallower_than_checkpoint_is_refused(tmp_path, make_params):
    """A config with fewer layers than the checkpoint: only the declared nextn (MTP) layers are skipped; the
    layers beyond them are unexpected tensors, never a silently truncated model."""
    from glm_dsa import configs

    deep = configs.tiny  # 4 decoder layers
    save_hf_params(make_params(deep, np.float32), deep, tmp_path)
    shallow = deep.replace(num_hidden_layers=2, indexer_types=deep.indexer_types[:2])
    assert shallow.num_nextn_predict_layers == 1  # layer 2 is its MTP layer; layer 3 is nothing it declares
    _fails(tmp_path, shallow, "unexpected", "'model.layers.3.")
    _fails(tmp_path, shallow.replace(num_nextn_predict_layers=0), "unexpected", "'model.layers.2.")
    # two declared nextn layers cover both: the first two layers load, exactly as saved
    params = make_params(deep, np.float32)
    loaded = _load(tmp_path, shallow.replace(num_nextn_predict_layers=2))
    assert set(loaded) == set(param_specs(shallow))
    for p, a in loaded.items():
        np.testing.assert_array_equal(np.asarray(a), params[p], err_msg=p)


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8, np.int64, np.bool_])
@pytest.mark.parametrize("key", ["model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.weight",
                                 "model.norm.weight"])
def test_non_float_weights_are_refused(single, cfg2, key, dtype):
    """Integer or bool weights are refused, naming the tensor and its dtype, not cast (FP8 bytes stored as uint8
    are accepted only with their block scales: tests/checkpoints/test_fp8_release.py)."""
    _edit(single, lambda t: t.update({key: (t[key] > 0).astype(dtype)}))
    _fails(single, cfg2, f"'{key}'", f"dtype {np.dtype(dtype)}", "floating point", SINGLE)
