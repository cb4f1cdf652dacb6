"""Overwriting an HF checkpoint is staged and committed: at every instant the directory holds the complete old
checkpoint or the complete new one, a writer killed midway leaves the old one loading bit for bit, and the next
write clears what the dead writer left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import checkpoints.writer as writer
from checkpoints import CheckpointError, load_hf_params, save_hf_params, write_random_checkpoint
from checkpoints.layout import param_specs
from checkpoints.loader import HFCheckpoint
from checkpoints.safetensors_io import SafetensorsWriter

ROOT = Path(__file__).resolve().parents[2]
SHARD = 60_000  # bytes: the 2-layer float32 test model in several shards


def _hf_tensors(params, cfg) -> dict[str, np.ndarray]:
    """Our parameters as the HF tensors a checkpoint of them holds (the independent expectation)."""
    out = {}
    for p, spec in param_specs(cfg).items():
        out.update(zip(spec.hf_keys, spec.to_hf(params[p])))
    return out


def _state(path, old, new) -> str:
    """'old' or 'new': which complete checkpoint the directory holds now (fails on anything else)."""
    ck = HFCheckpoint(path)
    got = {k: np.array(ck.raw(k)) for k in ck.keys()}
    for name, want in (("old", old), ("new", new)):
        if got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want):
            return name
    raise AssertionError(f"{path} holds neither the old nor the new checkpoint: {sorted(os.listdir(path))}")


def _hidden(path):
    return sorted(n for n in os.listdir(path) if n.startswith("."))


@pytest.mark.parametrize("old_shards,new_shards", [(None, None), (None, SHARD), (SHARD, SHARD), (SHARD, 30_000),
                                                   (SHARD, None)],
                         ids=["one-one", "one-sharded", "sharded-same-names", "sharded-other-count", "sharded-one"])
def test_every_instant_holds_a_complete_checkpoint(tmp_path, cfg2, make_params, monkeypatch, old_shards, new_shards):
    """Before each rename, link or unlink the writer makes, the directory loads as the old or the new checkpoint
    (each of those steps is atomic, so this covers every instant a kill could hit)."""
    a, b = make_params(cfg2, np.float32, seed=1), make_params(cfg2, np.float32, seed=2)
    save_hf_params(a, cfg2, tmp_path, max_shard_bytes=old_shards)
    old, new = _hf_tensors(a, cfg2), _hf_tensors(b, cfg2)
    seen = []

    def checked(fn):
        def run(*args, **kwargs):
            seen.append(_state(tmp_path, old, new))
            return fn(*args, **kwargs)
        return run

    for name in ("replace", "rename", "unlink", "link"):
        monkeypatch.setattr(os, name, checked(getattr(os, name)))
    save_hf_params(b, cfg2, tmp_path, max_shard_bytes=new_shards)
    monkeypatch.undo()
    seen.append(_state(tmp_path, old, new))
    assert seen[0] == "old" and seen[-1] == "new" and seen == sorted(seen, key=["old", "new"].index), seen
    assert _hidden(tmp_path) == []
    written = sorted(n for n in os.listdir(tmp_path) if n.endswith(".safetensors"))
    assert (written == ["model.safetensors"]) == (new_shards is None)


@pytest.mark.parametrize("old_shards", [None, SHARD])
def test_exception_after_the_first_shard_keeps_the_old_checkpoint(tmp_path, cfg2, make_params, monkeypatch,
                                                                  old_shards):
    """A write that fails after its first shard: the old checkpoint loads bit for bit, nothing temporary is
    left, and a later write succeeds."""
    a, b = make_params(cfg2, np.float32, seed=1), make_params(cfg2, np.float32, seed=2)
    save_hf_params(a, cfg2, tmp_path, max_shard_bytes=old_shards)
    files = sorted(os.listdir(tmp_path))
    real_exit = SafetensorsWriter.__exit__
    closed = []

    def exit_then_fail(self, *exc):
        real_exit(self, *exc)
        closed.append(self.path)
        if len(closed) == 1:
            raise OSError("disk full")

    monkeypatch.setattr(SafetensorsWriter, "__exit__", exit_then_fail)
    with pytest.raises(OSError, match="disk full"):
        save_hf_params(b, cfg2, tmp_path, max_shard_bytes=SHARD)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == files
    got = load_hf_params(tmp_path, cfg2, dtype=np.float32, progress=False)
    for p, x in a.items():
        np.testing.assert_array_equal(np.asarray(got[p]), x, err_msg=p)
    save_hf_params(b, cfg2, tmp_path, max_shard_bytes=SHARD)
    got = load_hf_params(tmp_path, cfg2, dtype=np.float32, progress=False)
    for p, x in b.items():
        np.testing.assert_array_equal(np.asarray(got[p]), x, err_msg=p)


_WRITER = textwrap.dedent("""
    import os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import checkpoints.writer as writer
    from glm_dsa import configs
    path, mode = sys.argv[1], sys.argv[2]
    cfg = configs.tiny.replace(num_hidden_layers=2, indexer_types=("full", "shared"))
    real_replace = os.replace

    def stall():
        print("STALL", flush=True)
        time.sleep(300)

    if mode == "staged":  # everything written to the staging directory, nothing committed
        def commit(*args):
            stall()
        writer._commit = commit
    else:  # mid-commit: the first new shard is in place under its final name, the index not yet
        def replace(src, dst):
            real_replace(src, dst)
            if os.path.dirname(dst) == path and os.path.basename(dst).startswith("model-"):
                stall()
        os.replace = replace
    from checkpoints.random import write_random_checkpoint
    write_random_checkpoint(cfg, path, seed=2, dtype="float32", max_shard_bytes=60_000, progress=False)
""")


@pytest.mark.parametrize("mode", ["staged", "mid-commit"])
def test_sigkill_midway_keeps_the_old_checkpoint_and_next_write_cleans_up(tmp_path, cfg2, mode):
    """SIGKILL a writer replacing a sharded checkpoint by one with the same shard names: the old checkpoint
    still loads bit for bit; its leftovers are removed by the next successful write."""
    path = tmp_path / "ckpt"
    names = write_random_checkpoint(cfg2, path, seed=1, dtype="float32", max_shard_bytes=SHARD, progress=False)
    assert len(names) > 2  # the writer below writes the same shard names
    old = load_hf_params(path, cfg2, dtype=np.float32, progress=False)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True, cwd=str(ROOT))
    try:
        line = proc.stdout.readline()
        assert line.startswith("STALL"), (line, proc.stderr.read() if proc.poll() is not None else "")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    left = _hidden(path)
    assert any(n.startswith(f".staging-{proc.pid}") for n in left), left
    got = load_hf_params(path, cfg2, dtype=np.float32, progress=False)
    for p, x in old.items():
        np.testing.assert_array_equal(np.asarray(got[p]), np.asarray(x), err_msg=p)

    write_random_checkpoint(cfg2, path, seed=3, dtype="float32", max_shard_bytes=SHARD, progress=False)
    assert _hidden(path) == []
    write_random_checkpoint(cfg2, tmp_path / "fresh", seed=3, dtype="float32", max_shard_bytes=SHARD, progress=False)
    got, want = (load_hf_params(d, cfg2, dtype=np.float32, progress=False) for d in (path, tmp_path / "fresh"))
    for p, x in want.items():
        np.testing.assert_array_equal(np.asarray(got[p]), np.asarray(x), err_msg=p)
    assert sorted(os.listdir(path)) == sorted(os.listdir(tmp_path / "fresh"))


def test_leftovers_of_live_writers_are_kept(tmp_path, cfg2):
    """Only dead writers' leftovers are removed: a staging directory of a live process stays."""
    write_random_checkpoint(cfg2, tmp_path, progress=False)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / f".staging-{sleeper.pid}").mkdir()
        (tmp_path / f".model.safetensors.tmp-{sleeper.pid}").write_bytes(b"x")
        write_random_checkpoint(cfg2, tmp_path, seed=1, progress=False)
        assert _hidden(tmp_path) == sorted([f".model.safetensors.tmp-{sleeper.pid}", f".staging-{sleeper.pid}"])
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)
    write_random_checkpoint(cfg2, tmp_path, seed=2, progress=False)
    assert _hidden(tmp_path) == []


def test_a_file_is_not_a_checkpoint_directory(tmp_path, cfg2, make_params, capsys):
    """Writing to an existing file: a CheckpointError naming it (the CLIs print `error: ...`), the file untouched."""
    target = tmp_path / "f"
    target.write_text("keep")
    with pytest.raises(CheckpointError, match=re.escape(f"{target} is a file, not a checkpoint directory")):
        write_random_checkpoint(cfg2, target, progress=False)
    with pytest.raises(CheckpointError, match=re.escape(f"{target} is a file")):
        save_hf_params(make_params(cfg2), cfg2, target)
    with pytest.raises(CheckpointError, match=re.escape(f"{target} is a file")):
        writer.write_hf_tensors(target, [("a", np.float32, (1,))], iter([("a", np.zeros(1, np.float32))]))
    assert target.read_text() == "keep"


def test_cli_random_checkpoint_into_a_file(tmp_path):
    """`python -m glm_dsa random-checkpoint --out FILE`: one `error:` line naming the file, no traceback."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    (tmp_path / "f").write_text("keep")
    r = subprocess.run([sys.executable, "-m", "glm_dsa", "random-checkpoint", "--preset", "tiny", "--out", "f"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "error: f is a file, not a checkpoint directory" in r.stderr, r.stderr
    assert (tmp_path / "f").read_text() == "keep"

