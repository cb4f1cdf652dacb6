"""`--compilation-cache-dir DIR` (generate, serve, trace), as the real `python -m glm_dsa` (subprocesses): the first
run fills DIR (created) with compiled steps, a second run of the same checkpoint and shapes compiles nothing new
(the folder's files byte for byte as before) and gives the same tokens; a folder that cannot be made is one error
line naming the flag (exit 2). Oracle: the folder's files read back, the first run's tokens."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import glm_dsa
from checkpoints.random import write_random_checkpoint

ROOT = Path(__file__).resolve().parents[2]
CFG = glm_dsa.configs.tiny.replace(num_hidden_layers=2, indexer_types=("full", "shared"))


def _generate(ckpt, cache, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return subprocess.run([sys.executable, "-m", "glm_dsa", "generate", "--checkpoint", str(ckpt), "--prompt-ids",
                           "1,2,3", "--max-new-tokens", "4", "--dtype", "float32", "--ignore-eos",
                           "--compilation-cache-dir", str(cache)],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def _files(path: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def _tokens(out: str) -> str:
    return next(line for line in out.splitlines() if "generated" in line)


def test_a_second_run_loads_what_the_first_compiled(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_random_checkpoint(CFG, ckpt, seed=0, dtype="float32", progress=False)
    cache = tmp_path / "new" / "cache"  # two levels that do not exist yet
    first = _generate(ckpt, cache, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    kept = _files(cache)
    assert kept, "nothing was written to the cache"
    second = _generate(ckpt, cache, tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert _files(cache) == kept  # every step it ran was in the cache: nothing compiled, nothing rewritten
    assert _tokens(second.stdout) == _tokens(first.stdout)


def test_a_folder_that_cannot_be_made_is_an_error_naming_the_flag(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    proc = _generate(tmp_path / "ckpt-not-read", blocker / "cache", tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: --compilation-cache-dir {str(blocker / 'cache')!r}: cannot create"), \
        proc.stderr
    assert blocker.read_text() == "not a folder"
