"""Random checkpoints: deterministic per (seed, key), sane init statistics, any file layout, and the CLI."""

from __future__ import annotations

import json
import os
import zlib

import ml_dtypes
import numpy as np
import pytest

import checkpoints.random as ckrandom
from glm_dsa.cli import main as cli_main
from checkpoints import load_hf_params, param_specs, write_random_checkpoint
from checkpoints.safetensors_io import SafetensorsFile
from glm_dsa.model.config import GlmDsaConfig
from glm_dsa import configs


def _load(path, cfg, dtype=np.float32):
    return {p: np.asarray(a) for p, a in load_hf_params(path, cfg, dtype=dtype, progress=False).items()}


def test_loads_and_stores_fp32_params_as_float32(tmp_path, cfg2):
    names = write_random_checkpoint(cfg2, tmp_path, progress=False)
    assert names == ["model.safetensors"]
    f = SafetensorsFile(tmp_path / "model.safetensors")
    for p, s in param_specs(cfg2).items():
        for k in s.hf_keys:
            assert f.dtype(k) == (np.float32 if s.fp32 else ml_dtypes.bfloat16), k
    assert GlmDsaConfig.from_pretrained(tmp_path) == cfg2
    params = _load(tmp_path, cfg2)
    assert set(params) == set(param_specs(cfg2))
    assert all(np.isfinite(a).all() for a in params.values())


def test_init_statistics(tmp_path):
    cfg = configs.tiny
    write_random_checkpoint(cfg, tmp_path, dtype="float32", progress=False)
    params = _load(tmp_path, cfg)
    for p, a in params.items():
        name = p.rsplit(".", 1)[-1]
        if name == "embed":
            assert abs(a.std() - 1.0) < 0.05 and abs(a.mean()) < 0.05, p
        elif name.endswith("norm") or name == "k_norm_w":
            assert abs(a.mean() - 1.0) < 0.02 and a.std() < 0.05, p
        else:  # linear weights, the k_norm bias, the router's correction bias
            assert abs(a.mean()) < 0.02 and a.std() < 0.05, p
            if a.size >= 1000:
                assert 0.015 < a.std() < 0.025, p


def test_deterministic_and_layout_independent(tmp_path, cfg2):
    write_random_checkpoint(cfg2, tmp_path / "a", seed=3, progress=False)
    write_random_checkpoint(cfg2, tmp_path / "b", seed=3, max_shard_bytes=30_000, progress=False)
    write_random_checkpoint(cfg2, tmp_path / "c", seed=4, progress=False)
    assert os.path.exists(tmp_path / "b" / "model.safetensors.index.json")
    a, b, c = (_load(tmp_path / d, cfg2, "bfloat16") for d in "abc")
    for p in a:
        np.testing.assert_array_equal(a[p], b[p], err_msg=p)
    assert not np.array_equal(a["layers.0.attn.q_b_proj"], c["layers.0.attn.q_b_proj"])


@pytest.mark.parametrize("threads", [1, 3])
def test_chunked_drawing_is_reproducible(monkeypatch, threads):
    """Chunks of the draw (here 10 values) are seeded by their index: any thread count gives the same tensor."""
    monkeypatch.setattr(ckrandom, "_CHUNK", 10)
    monkeypatch.setattr(ckrandom, "_THREADS", threads)
    a = ckrandom.random_tensor("k", (7, 11), 0.5, 2.0, np.float32, seed=1)
    want = np.concatenate([np.random.default_rng([1, zlib.crc32(b"k"), i]).standard_normal(10, np.float32)
                           for i in range(8)])[:77].reshape(7, 11) * np.float32(2.0) + np.float32(0.5)
    np.testing.assert_array_equal(a, want)
    assert not np.array_equal(ckrandom.random_tensor("j", (7, 11), 0.5, 2.0, np.float32, seed=1), a)
    assert ckrandom.random_tensor("k", (0, 3), 0.0, 1.0, ml_dtypes.bfloat16).shape == (0, 3)


def test_cli(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert cli_main(["random-checkpoint", "--preset", "tiny", "--out", str(out), "--num-layers", "2",
                     "--dtype", "float32", "--max-shard-mb", "0.05", "--seed", "7"]) == 0
    assert "wrote a random tiny checkpoint (2 layers)" in capsys.readouterr().out
    cfg = GlmDsaConfig.from_pretrained(out)
    assert cfg == configs.tiny.replace(num_hidden_layers=2)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    params = _load(out, cfg)
    assert params["embed"].dtype == np.float32 and params["embed"].shape == (cfg.vocab_size, cfg.hidden_size)


def test_cli_rejects_unknown_preset(tmp_path):
    with pytest.raises(SystemExit):
        cli_main(["random-checkpoint", "--preset", "nope", "--out", str(tmp_path)])
