"""Orbax checkpoints of converted parameters: round trips, restore onto other meshes (TP / DCP / QREP) with
resharding, atomic saves under SIGKILL, and clear errors for interrupted, incomplete or mismatched directories."""

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding

import glm_dsa
from checkpoints import CheckpointError, committed_checkpoint, is_orbax_checkpoint, load_orbax_params
from checkpoints import load_hf_params, orbax_io, save_orbax_params
from checkpoints.layout import param_specs
from checkpoints.random import write_random_checkpoint
from glm_dsa.model.param_tree import nest_params
from glm_dsa.model.step import resolve_parallel
from sharding import ParallelConfig, make_mesh, param_spec

ROOT = Path(__file__).resolve().parents[2]
CFG = glm_dsa.configs.tiny  # 4 layers: dense, MoE; full and shared indexer layers; 4 heads
CFG2 = CFG.replace(num_hidden_layers=2, indexer_types=("full", "shared"))  # for engine runs: half the compile


def _random(cfg, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {p: rng.standard_normal(s.shape, dtype=np.float32).astype(np.float32 if s.fp32 else dtype)
            for p, s in param_specs(cfg).items()}


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for p in want:
        np.testing.assert_array_equal(np.asarray(got[p]), np.asarray(want[p]), err_msg=p)


def test_roundtrip_flat_and_nested(tmp_path):
    flat = _random(CFG, 0, ml_dtypes.bfloat16)
    v1 = save_orbax_params(flat, CFG, tmp_path)
    assert os.path.basename(v1) == "checkpoint-000001" and is_orbax_checkpoint(tmp_path)
    _assert_same(load_orbax_params(tmp_path, CFG, dtype=None, progress=False), flat)
    meta = orbax_io.read_orbax_metadata(tmp_path)
    assert meta["format"] == "glm_dsa.orbax" and meta["dtype"] == "bfloat16" and meta["layout"] == "flat"
    assert meta["params"]["layers.0.attn.q_b_proj"] == {"shape": [48, 4, 32], "dtype": "bfloat16"}
    # the nested pytree saves the same; the new version replaces the old one once committed
    v2 = save_orbax_params(nest_params(_random(CFG, 1)), CFG, tmp_path)
    assert committed_checkpoint(tmp_path) == v2
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-000002", "config.json"]
    got = load_orbax_params(tmp_path, CFG, dtype="bfloat16", progress=False)  # cast on restore
    specs = param_specs(CFG)
    for p, a in got.items():
        assert a.dtype == (np.float32 if specs[p].fp32 else ml_dtypes.bfloat16), p
    assert glm_dsa.GlmDsaConfig.from_pretrained(tmp_path) == CFG  # the root config.json copy


@pytest.fixture(scope="module")
def hf_and_orbax(tmp_path_factory):
    """A random HF checkpoint, loaded on a TP=2 mesh and saved from there (sharded arrays) as orbax."""
    root = tmp_path_factory.mktemp("orbax_mesh")
    write_random_checkpoint(CFG2, root / "hf", seed=5, dtype="float32", progress=False)
    eng = glm_dsa.load(root / "hf", parallel=ParallelConfig(2, 1), dtype="float32", max_model_len=64, progress=False)
    save_orbax_params(eng.params, CFG2, root / "orbax")
    return root / "hf", root / "orbax"


@pytest.mark.parametrize("par", [ParallelConfig(1), ParallelConfig(4, 4, dcp_q_replicate=True),
                                 ParallelConfig(4, 2, dcp_q_replicate=False), ParallelConfig(2, 2)],
                         ids=["tp1", "tp4-dcp4-qrep", "tp4-dcp2-gather", "tp2-dcp2-default"])
def test_restore_onto_other_meshes(hf_and_orbax, par):
    """Saved from TP=2; restored onto other meshes with the partition table's shardings, values unchanged."""
    hf, orbax = hf_and_orbax
    par = resolve_parallel(par, CFG2)
    mesh = make_mesh(par)
    got = load_orbax_params(orbax, CFG2, dtype="float32", progress=False,
                            sharding_for=lambda p, s: NamedSharding(mesh, param_spec(p, par.q_replicate)))
    from checkpoints import load_hf_params
    _assert_same(got, load_hf_params(hf, CFG2, dtype="float32", progress=False))
    for p, a in got.items():
        want = NamedSharding(mesh, param_spec(p, par.q_replicate))
        assert a.sharding.is_equivalent_to(want, a.ndim), (p, a.sharding)


def test_engine_logits_from_orbax_on_dcp_mesh(hf_and_orbax):
    """glm_dsa.load takes the orbax directory: TP4/DCP4 with QREP gives the DCP=1 logits of the HF directory."""
    hf, orbax = hf_and_orbax
    ids = np.arange(5, 29)[None]
    want = glm_dsa.load(hf, dtype="float32", max_model_len=64, progress=False).logits(ids)
    eng = glm_dsa.load(orbax, parallel=ParallelConfig(4, 4, dcp_q_replicate=True), dtype="float32",
                       max_model_len=64, progress=False)
    np.testing.assert_allclose(eng.logits(ids), want, atol=1e-5, rtol=0)


_SAVER = textwrap.dedent("""
    import os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import numpy as np
    from checkpoints import orbax_io
    from checkpoints.layout import param_specs
    from glm_dsa import configs
    cfg = configs.tiny
    rng = np.random.default_rng(1)
    params = {p: rng.standard_normal(s.shape).astype(np.float32) for p, s in param_specs(cfg).items()}
    if sys.argv[2] == "before-commit":  # stall with everything staged but the metadata (the commit marker)
        def stall(directory, meta):
            print("STAGED", flush=True)
            time.sleep(120)
        orbax_io._write_metadata = stall
    print("SAVING", flush=True)
    orbax_io.save_orbax_params(params, cfg, sys.argv[1])
    print("DONE", flush=True)
""")


def _start_saver(root, mode):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen([sys.executable, "-c", _SAVER, str(root), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, text=True, cwd=str(ROOT))


def _kill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.parametrize("mode", ["during-write", "before-commit"])
def test_sigkill_midway_leaves_last_good_checkpoint(tmp_path, mode):
    good = _random(CFG, 0)
    save_orbax_params(good, CFG, tmp_path)
    proc = _start_saver(tmp_path, mode)
    try:
        if mode == "during-write":  # kill as soon as the new version's stage appears: orbax is writing params
            deadline = time.monotonic() + 60
            while not any(n.startswith(".checkpoint-000002.tmp-") for n in os.listdir(tmp_path)):
                assert proc.poll() is None and time.monotonic() < deadline, "the saver never started its save"
                time.sleep(0.001)
        else:
            for line in proc.stdout:
                if line.startswith("STAGED"):
                    break
        _kill(proc)
    finally:
        if proc.poll() is None:
            _kill(proc)
    names = os.listdir(tmp_path)
    assert "checkpoint-000002" not in names and any(n.startswith(".checkpoint-000002.tmp-") for n in names), names
    assert committed_checkpoint(tmp_path).endswith("checkpoint-000001")
    _assert_same(load_orbax_params(tmp_path, CFG, dtype=None, progress=False), good)  # the whole last good one

    # with the good version gone, only the interrupted save is left: a clear error, no model
    shutil.rmtree(tmp_path / "checkpoint-000001")
    with pytest.raises(CheckpointError, match=r"no committed checkpoint, only the unfinished save "
                                              r"\.checkpoint-000002\.tmp-\d+ \(interrupted"):
        load_orbax_params(tmp_path, CFG, dtype=None, progress=False)
    with pytest.raises(CheckpointError, match="interrupted"):
        glm_dsa.load(tmp_path, progress=False)
    # the next save commits and clears the dead stage
    save_orbax_params(good, CFG, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-000001", "config.json"]


# orbax leaves a callback for its closed event loop after a failed restore
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_or_mismatched_versions_are_refused(tmp_path):
    save_orbax_params(_random(CFG, 0), CFG, tmp_path)
    version = Path(committed_checkpoint(tmp_path))
    meta_file = version / "glm_dsa.json"
    meta = json.loads(meta_file.read_text())

    bad = dict(meta, params=dict(meta["params"]))
    bad["params"]["layers.0.attn.q_b_proj"] = {"shape": [48, 4, 16], "dtype": "float32"}
    meta_file.write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match=r"parameter 'layers.0.attn.q_b_proj' has shape \[48, 4, 16\]"):
        load_orbax_params(tmp_path, CFG, dtype=None, progress=False)
    meta_file.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"glm_dsa.json is corrupt"):
        load_orbax_params(tmp_path, CFG, dtype=None, progress=False)
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"checkpoint-000001 is missing parameter 'layers\.\d"):
        load_orbax_params(tmp_path, CFG.replace(num_hidden_layers=5, indexer_types=CFG.indexer_types + ("shared",)),
                          dtype=None, progress=False)

    # a data file of the committed version removed behind our back: an error naming the version, no model
    data = [p for p in (version / "params").rglob("*") if p.is_file() and p.parent.name == "d"]  # OCDBT data files
    assert data, list((version / "params").rglob("*"))
    for p in data:
        p.unlink()
    with pytest.raises(CheckpointError, match=rf"orbax checkpoint {version} could not be restored"):
        load_orbax_params(tmp_path, CFG, dtype=None, progress=False)
    shutil.rmtree(version / "params")
    with pytest.raises(CheckpointError, match=r"incomplete: 'params' is missing"):
        load_orbax_params(tmp_path, CFG, dtype=None, progress=False)
    gc.collect()  # let orbax's abandoned futures go while the warning filter above applies


def test_save_refuses_bad_params_and_hf_directories(tmp_path):
    params = _random(CFG, 0)
    params["layers.0.attn.q_b_proj"] = params["layers.0.attn.q_b_proj"][:, :2]
    with pytest.raises(CheckpointError, match=r"parameter 'layers.0.attn.q_b_proj'.*\[48, 2, 32\]"):
        save_orbax_params(params, CFG, tmp_path / "o")
    write_random_checkpoint(CFG, tmp_path / "hf", progress=False)
    with pytest.raises(CheckpointError, match="holds an HF safetensors checkpoint"):
        save_orbax_params(_random(CFG, 0), CFG, tmp_path / "hf")
    assert not is_orbax_checkpoint(tmp_path / "hf")


def test_relative_paths(tmp_path, monkeypatch):
    """Every public function takes a path relative to the working directory (orbax itself needs absolute ones)."""
    monkeypatch.chdir(tmp_path)
    good = _random(CFG, 0)
    orbax_io.check_save_target("orb")
    v1 = save_orbax_params(good, CFG, "orb")
    assert v1 == str(tmp_path / "orb" / "checkpoint-000001")
    assert is_orbax_checkpoint("orb") and not is_orbax_checkpoint("elsewhere")
    assert committed_checkpoint("orb") == v1
    assert committed_checkpoint(os.path.join("orb", "checkpoint-000001")) == v1
    assert orbax_io.read_orbax_metadata("orb")["directory"] == v1
    _assert_same(load_orbax_params("orb", CFG, dtype=None, progress=False), good)
    v2 = save_orbax_params(_random(CFG, 1), CFG, Path("orb"))  # a second version, relative too
    assert sorted(os.listdir("orb")) == ["checkpoint-000002", "config.json"] and committed_checkpoint("orb") == v2
    assert [n for n in os.listdir(tmp_path) if n != "orb"] == []


def test_cli_convert_and_generate_with_relative_paths(tmp_path):
    """`python -m glm_dsa convert --from hf --to orb` then `generate --checkpoint orb`, run from the directory that
    holds them, in fresh processes: no absl tracebacks, a committed orbax checkpoint, tokens generated."""
    write_random_checkpoint(CFG2, tmp_path / "hf", seed=5, dtype="float32", progress=False)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)

    def run(*args):
        r = subprocess.run([sys.executable, "-m", "glm_dsa", *args], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stdout, r.stderr)
        return r

    run("convert", "--from", "hf", "--to", "orb", "--dtype", "float32", "--no-progress")
    assert committed_checkpoint(tmp_path / "orb") == str(tmp_path / "orb" / "checkpoint-000001")
    _assert_same(load_orbax_params(tmp_path / "orb", CFG2, dtype="float32", progress=False),
                 load_hf_params(tmp_path / "hf", CFG2, dtype="float32", progress=False))
    out = run("generate", "--checkpoint", "orb", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--dtype",
              "float32").stdout
    hf_out = run("generate", "--checkpoint", "hf", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--dtype",
                 "float32").stdout
    tokens = [line for line in out.splitlines() if "generated" in line]
    assert tokens and tokens == [line for line in hf_out.splitlines() if "generated" in line], (out, hf_out)
