"""Save -> load round trips, shards, dtypes, FP8 dequantization and placement on a device mesh."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file

from checkpoints import (CheckpointError, SafetensorsWriter, load_hf_params, param_specs, save_hf_params)
from checkpoints.safetensors_io import SafetensorsFile


def _assert_params_equal(loaded, want):
    assert set(loaded) == set(want)
    for p, a in want.items():
        assert loaded[p].dtype == a.dtype, p
        np.testing.assert_array_equal(np.asarray(loaded[p]), a, err_msg=p)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_round_trip_single_file(tmp_path, cfg2, make_params, dtype):
    params = make_params(cfg2, dtype)
    save_hf_params(params, cfg2, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    loaded = load_hf_params(tmp_path, cfg2, dtype=dtype, progress=False)
    _assert_params_equal(loaded, params)
    specs = param_specs(cfg2)
    assert all(loaded[p].dtype == (jnp.float32 if s.fp32 else dtype) for p, s in specs.items())


def test_files_are_plain_safetensors(tmp_path, cfg2, make_params):
    """The safetensors package reads what we write, tensor for tensor (HF [out, in] layout)."""
    params = make_params(cfg2, ml_dtypes.bfloat16)
    save_hf_params(params, cfg2, tmp_path)
    hf = load_file(tmp_path / "model.safetensors")
    specs = param_specs(cfg2)
    assert set(hf) == {k for s in specs.values() for k in s.hf_keys}
    for p, s in specs.items():
        for k, t in zip(s.hf_keys, s.to_hf(params[p])):
            assert hf[k].dtype == t.dtype
            np.testing.assert_array_equal(hf[k], t, err_msg=k)
    assert SafetensorsFile(tmp_path / "model.safetensors").metadata == {"format": "pt"}


def test_cast_on_load_keeps_fp32_params(tmp_path, cfg2, make_params):
    params = make_params(cfg2, np.float32)
    save_hf_params(params, cfg2, tmp_path)
    loaded = load_hf_params(tmp_path, cfg2, dtype=jnp.bfloat16, progress=False)
    for p, s in param_specs(cfg2).items():
        want = params[p].astype(np.float32 if s.fp32 else ml_dtypes.bfloat16)
        assert loaded[p].dtype == want.dtype, p
        np.testing.assert_array_equal(np.asarray(loaded[p]), want, err_msg=p)
    assert loaded["layers.1.moe.router"].dtype == jnp.float32
    assert loaded["layers.0.attn.indexer.weights_proj"].dtype == jnp.float32


def test_index_and_shards(tmp_path, cfg2, make_params):
    params = make_params(cfg2, np.float32)
    limit = 60_000
    save_hf_params(params, cfg2, tmp_path, max_shard_bytes=limit)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors")) == shards
    total = 0
    for name in shards:
        f = SafetensorsFile(tmp_path / name)
        sizes = [f.entries[k][3] - f.entries[k][2] for k in f.keys()]
        assert sum(sizes) <= limit or len(sizes) == 1  # only an oversized tensor overflows, alone
        assert all(index["weight_map"][k] == name for k in f.keys())
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    _assert_params_equal(load_hf_params(tmp_path, cfg2, dtype=np.float32, progress=False), params)


def test_resave_replaces_old_layout(tmp_path, cfg2, make_params):
    """Saving single over sharded (and back) leaves only the new checkpoint's files."""
    a, b = make_params(cfg2, np.float32, seed=1), make_params(cfg2, np.float32, seed=2)
    save_hf_params(a, cfg2, tmp_path, max_shard_bytes=60_000)
    save_hf_params(b, cfg2, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    _assert_params_equal(load_hf_params(tmp_path, cfg2, dtype=np.float32, progress=False), b)
    save_hf_params(a, cfg2, tmp_path, max_shard_bytes=60_000)
    assert "model.safetensors" not in os.listdir(tmp_path)
    _assert_params_equal(load_hf_params(tmp_path, cfg2, dtype=np.float32, progress=False), a)


def test_save_from_jax_arrays(tmp_path, cfg2, make_params):
    params = make_params(cfg2, ml_dtypes.bfloat16)
    save_hf_params({p: jnp.asarray(a) for p, a in params.items()}, cfg2, tmp_path)
    _assert_params_equal(load_hf_params(tmp_path, cfg2, dtype=jnp.bfloat16, progress=False), params)


def test_tied_embeddings_share_one_tensor(tmp_path, cfg2, make_params):
    cfg = cfg2.replace(tie_word_embeddings=True)
    params = make_params(cfg, np.float32)
    params["lm_head"] = params["embed"].T.copy()
    save_hf_params(params, cfg, tmp_path)
    assert "lm_head.weight" not in SafetensorsFile(tmp_path / "model.safetensors").keys()
    _assert_params_equal(load_hf_params(tmp_path, cfg, dtype=np.float32, progress=False), params)


def test_mtp_layers_are_skipped(tmp_path, cfg2, make_params):
    params = make_params(cfg2, np.float32)
    save_hf_params(params, cfg2, tmp_path)
    hf = load_file(tmp_path / "model.safetensors")
    hf |= {"model.layers.2.eh_proj.weight": np.ones((64, 128), np.float32),
           "model.layers.2.self_attn.q_a_proj.weight": np.ones((48, 64), np.float32),
           "model.layers.2.shared_head.norm.weight": np.ones(64, np.float32)}
    from safetensors.numpy import save_file
    save_file(hf, tmp_path / "model.safetensors")
    _assert_params_equal(load_hf_params(tmp_path, cfg2, dtype=np.float32, progress=False), params)


@pytest.mark.parametrize("stored", [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn])
def test_reads_stored_dtypes(tmp_path, stored):
    a = np.linspace(-2, 2, 24, dtype=np.float32).reshape(2, 3, 4).astype(stored)
    with SafetensorsWriter(tmp_path / "x.safetensors", [("a", a.dtype, a.shape)]) as w:
        w.write("a", a)
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.dtype("a") == np.dtype(stored)
    np.testing.assert_array_equal(f.get("a"), a)


def test_fp8_block_scaled_weights_are_dequantized(tmp_path, cfg2, make_params):
    """An e4m3 weight with a `weight_scale_inv` (one fp32 scale per 128 x 128 block) loads as w * scale."""
    params = make_params(cfg2, np.float32)
    save_hf_params(params, cfg2, tmp_path)
    src = SafetensorsFile(tmp_path / "model.safetensors")
    key = "model.layers.0.self_attn.indexer.wq_b.weight"  # [512, 48] -> 4 x 1 blocks
    w8 = src.get(key).astype(ml_dtypes.float8_e4m3fn)
    scale = np.array([[0.5], [1.0], [2.0], [4.0]], np.float32)
    entries = [(k, src.dtype(k), src.shape(k)) for k in src.keys()]
    entries = [(k, w8.dtype, s) if k == key else (k, d, s) for k, d, s in entries] + [(key + "_scale_inv",
                                                                                       scale.dtype, scale.shape)]
    tensors = {k: (w8 if k == key else np.array(src.get(k))) for k in src.keys()} | {key + "_scale_inv": scale}
    del src
    with SafetensorsWriter(tmp_path / "model.safetensors", entries) as w:
        for k, _, _ in entries:
            w.write(k, tensors[k])
    loaded = load_hf_params(tmp_path, cfg2, dtype=np.float32, progress=False, quantization="none")
    spec = param_specs(cfg2)["layers.0.attn.indexer.wq_b"]
    want = spec.from_hf(w8.astype(np.float32) * np.repeat(scale, 128, axis=0))
    np.testing.assert_array_equal(np.asarray(loaded["layers.0.attn.indexer.wq_b"]), want)


def test_placement_on_a_mesh(tmp_path, cfg2, make_params):
    """Each device receives only its shard: q_b_proj over heads (tp), experts over all 8 devices."""
    if jax.device_count() < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/conftest.py)")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("tp", "dcp"))
    params = make_params(cfg2, ml_dtypes.bfloat16)
    save_hf_params(params, cfg2, tmp_path, max_shard_bytes=100_000)
    asked = []

    def sharding_for(path, shape):
        asked.append((path, shape))
        if path.endswith("q_b_proj"):
            return NamedSharding(mesh, P(None, "tp", None))
        if "experts_" in path:
            return NamedSharding(mesh, P(("tp", "dcp")))
        return None

    loaded = load_hf_params(tmp_path, cfg2, dtype=jnp.bfloat16, sharding_for=sharding_for, progress=False)
    specs = param_specs(cfg2)
    assert asked == [(p, s.shape) for p, s in specs.items()]
    _assert_params_equal(loaded, params)
    q = loaded["layers.1.attn.q_b_proj"]
    assert q.sharding == NamedSharding(mesh, P(None, "tp", None))
    assert len(q.addressable_shards) == 8
    for shard in q.addressable_shards:
        assert shard.data.shape == (48, 1, 32)
        np.testing.assert_array_equal(np.asarray(shard.data), params["layers.1.attn.q_b_proj"][shard.index])
    e = loaded["layers.1.moe.experts_up"]
    assert {s.data.shape for s in e.addressable_shards} == {(1, 64, 32)}
    assert {s.device for s in e.addressable_shards} == set(jax.devices()[:8])
    assert loaded["embed"].sharding.device_set == {jax.devices()[0]}


def test_save_rejects_wrong_params(tmp_path, cfg2, make_params):
    params = make_params(cfg2, np.float32)
    with pytest.raises(CheckpointError, match="layers.1.moe.router"):
        save_hf_params({p: a for p, a in params.items() if p != "layers.1.moe.router"}, cfg2, tmp_path)
    with pytest.raises(CheckpointError, match="layers.0.attn.o_proj.*\\[4, 24, 64\\]"):
        save_hf_params(params | {"layers.0.attn.o_proj": np.zeros((4, 64, 24), np.float32)}, cfg2, tmp_path)
    assert not os.listdir(tmp_path)


class _Exploding:
    """An array-like whose data cannot be read: saving crashes midway through the file."""

    def __init__(self, like):
        self.shape, self.dtype = like.shape, like.dtype

    def __array__(self, *args, **kwargs):
        raise RuntimeError("boom")


@pytest.mark.parametrize("max_shard_bytes", [None, 60_000])
def test_crashed_save_leaves_no_partial_file(tmp_path, cfg2, make_params, max_shard_bytes):
    old = make_params(cfg2, np.float32, seed=1)
    save_hf_params(old, cfg2, tmp_path)
    new = make_params(cfg2, np.float32, seed=2)
    new["layers.1.moe.experts_down"] = _Exploding(old["layers.1.moe.experts_down"])
    with pytest.raises(RuntimeError, match="boom"):
        save_hf_params(new, cfg2, tmp_path, max_shard_bytes=max_shard_bytes)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no temporary files left behind
    # The old single-file checkpoint is intact and is still what loads (no index was committed).
    assert "model.safetensors.index.json" not in os.listdir(tmp_path)
    _assert_params_equal(load_hf_params(tmp_path, cfg2, dtype=np.float32, progress=False), old)
