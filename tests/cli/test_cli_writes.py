"""Commands that write never destroy what they did not write, run as the real `python -m glm_dsa` (subprocesses):
`random-checkpoint --out DIR` and `convert --to DIR` into a non-empty directory that is not a checkpoint of the
kind they write is an error (exit 2, naming DIR and --overwrite) that leaves DIR byte for byte as it was; with
--overwrite they write into it and keep its other files; over a checkpoint of their own kind they replace it
(atomically, as before) and say so on stdout. Oracle: the directory's files read back before and after."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import glm_dsa
from checkpoints import committed_checkpoint
from checkpoints.random import write_random_checkpoint
from checkpoints.writer import write_hf_tensors

ROOT = Path(__file__).resolve().parents[2]
CFG = glm_dsa.configs.tiny.replace(num_hidden_layers=2, indexer_types=("full", "shared"))


def _cli(*args, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "glm_dsa", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def _tree(path: Path) -> dict:
    """{relative file path: sha256} of every file under `path`."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _random(out, *extra):
    return _cli("random-checkpoint", "--preset", "tiny", "--num-layers", "2", "--dtype", "float32", "--out",
                str(out), *extra)


def _user_dir(path: Path) -> Path:
    """A directory of someone's files, two of them with names a checkpoint has."""
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    (path / "config.json").write_text('{"mine": true}')
    (path / "tokenizer.json").write_text('{"mine": true}')
    return path


def test_random_checkpoint_into_a_non_empty_directory(tmp_path):
    d = _user_dir(tmp_path / "d")
    before = _tree(d)
    r = _random(d)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert str(d) in r.stderr and "--overwrite" in r.stderr and "notes.txt" in r.stderr, r.stderr
    assert _tree(d) == before  # nothing written, nothing removed
    # --overwrite: written into it, its other files kept, and said so
    r = _random(d, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert "--overwrite" in r.stdout and "wrote a random" in r.stdout
    assert (d / "notes.txt").read_text() == "mine" and (d / "tokenizer.json").read_text() == '{"mine": true}'
    assert (d / "model.safetensors").exists() and '"mine"' not in (d / "config.json").read_text()


def test_random_checkpoint_replaces_its_own_checkpoint_and_says_so(tmp_path):
    d = tmp_path / "ck"
    assert _random(d).returncode == 0
    before = _tree(d)
    r = _random(d, "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert f"replacing the random checkpoint in {d}" in r.stdout and "atomically" in r.stdout, r.stdout
    after = _tree(d)
    assert set(after) == set(before) and after["model.safetensors"] != before["model.safetensors"]


def test_random_checkpoint_does_not_replace_another_hf_checkpoint(tmp_path):
    """An HF checkpoint it did not write (a downloaded release, say) needs --overwrite."""
    d = tmp_path / "release"
    write_hf_tensors(d, [("w", np.float32, (2,))], iter([("w", np.ones(2, np.float32))]),
                     extra=lambda stage: Path(stage, "config.json").write_text('{"model_type": "theirs"}'))
    before = _tree(d)
    r = _random(d)
    assert r.returncode == 2 and "not a random checkpoint" in r.stderr, (r.stdout, r.stderr)
    assert _tree(d) == before


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_writes") / "hf"
    write_random_checkpoint(CFG, path, seed=2, dtype="float32", progress=False)
    return path


def _convert(src, dst, *extra):
    return _cli("convert", "--from", str(src), "--to", str(dst), "--dtype", "float32", "--no-progress", *extra)


def test_convert_into_a_non_empty_directory_then_over_its_own_checkpoint(hf, tmp_path):
    d = _user_dir(tmp_path / "d")
    before = _tree(d)
    r = _convert(hf, d)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert str(d) in r.stderr and "--overwrite" in r.stderr and "config.json" in r.stderr, r.stderr
    assert _tree(d) == before  # the user's config.json and tokenizer.json are as they were
    # --overwrite: the orbax checkpoint is written beside the user's other files
    r = _convert(hf, d, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert "--overwrite" in r.stdout and (d / "notes.txt").read_text() == "mine"
    assert committed_checkpoint(d).endswith("checkpoint-000001")
    # over its own checkpoint: replaced by a new committed version, and said so
    r = _convert(hf, d)
    assert r.returncode == 0, r.stderr
    assert f"replacing the glm-dsa orbax checkpoint in {d}" in r.stdout, r.stdout
    assert committed_checkpoint(d).endswith("checkpoint-000002") and not (d / "checkpoint-000001").exists()
