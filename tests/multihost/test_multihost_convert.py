"""`python -m glm_dsa convert` across 2 processes x 4 CPU devices (TP = 8 staging mesh) into one shared directory:
one committed version, no stage left behind, and restored in this process (another mesh) it equals the HF
checkpoint's parameters exactly (float32). Run twice, the second save is version 2 and the first is removed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import glm_dsa
from checkpoints.random import write_random_checkpoint
from glm_dsa import ParallelConfig, configs
from glm_dsa.model.param_tree import flatten_params

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from multihost_processes import free_port, xla_flags  # noqa: E402
CFG = configs.tiny.replace(num_attention_heads=8)


def _convert(src, dst, cwd):
    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4),
               PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-m", "glm_dsa", "convert", "--from", str(src), "--to", str(dst),
                               "--dtype", "float32", "--no-progress", "-tp", "8", "--coordinator-address", coordinator,
                               "--num-processes", "2", "--process-id", str(i), "--distributed-timeout", "60"],
                              cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} (exit {p.returncode}):\n{err[-3000:]}"
    return [o for o, _ in outs]


def test_convert_across_processes_then_restore(tmp_path):
    hf = tmp_path / "hf"
    write_random_checkpoint(CFG, hf, seed=5, dtype="float32", progress=False)
    dst = tmp_path / "orbax"
    outs = _convert(hf, dst, tmp_path)
    assert "converted" in outs[0] and "checkpoint-000001" in outs[0], outs[0]
    assert outs[1] == ""  # only process 0 reports
    assert sorted(os.listdir(dst)) == ["checkpoint-000001", "config.json"]  # committed once, no stage left
    want = flatten_params(glm_dsa.load(hf, dtype="float32", progress=False).params)
    got = flatten_params(glm_dsa.load(dst, parallel=ParallelConfig(tensor_parallel_size=2), dtype="float32",
                                      progress=False).params)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
    _convert(hf, dst, tmp_path)  # a second save: a new version, the old one removed after the commit
    assert sorted(os.listdir(dst)) == ["checkpoint-000002", "config.json"]
