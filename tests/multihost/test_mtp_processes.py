"""MTP speculative decoding across 2 processes x 2 CPU devices on localhost (TP = 4): `python -m glm_dsa generate
--num-speculative-tokens 2` prints the greedy tokens of the single-process engine without MTP (process 1 prints
nothing); oracle drafts right up to each draft position give the same tokens with the per-position acceptance
that follows (so accepted drafts, not only rejected ones, keep the processes in step); a mesh that leaves a
process out is one clear error in every process. Oracle: `Engine.generate` without MTP in this process. A stall
fails the test at its timeout."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import glm_dsa
from checkpoints.random import write_random_checkpoint
from glm_dsa import ParallelConfig, configs

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from multihost_cases import GEN_PROMPTS, NEW_TOKENS  # noqa: E402
from multihost_processes import free_port, run_processes  # noqa: E402

K = 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp_mh") / "hf"
    write_random_checkpoint(configs.tiny, path, seed=3, dtype="float32", progress=False, with_mtp=True)
    return path


@pytest.fixture(scope="module")
def reference(ckpt):
    """Greedy tokens of the single-process TP = 4 engine without MTP."""
    eng = glm_dsa.load(ckpt, parallel=ParallelConfig(tensor_parallel_size=4), dtype="float32", max_model_len=64,
                       progress=False)
    return eng.generate(GEN_PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])


def _run_two(cmds, cwd, timeout):
    return run_processes(cmds, cwd, timeout, "the two-process MTP run")


def _generate_cmds(ckpt, layout):
    port = free_port()
    prompts = [a for p in GEN_PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]
    args = ["--checkpoint", str(ckpt), *prompts, "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--dtype",
            "float32", "--max-model-len", "64", "--num-speculative-tokens", str(K), *layout,
            "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--distributed-timeout", "60",
            "--distributed-heartbeat-timeout", "15"]
    return [[sys.executable, "-m", "glm_dsa", "generate", *args, "--process-id", str(i)] for i in range(2)]


def test_cli_generate_with_mtp_across_processes(ckpt, reference, tmp_path):
    res = _run_two(_generate_cmds(ckpt, ["-tp", "4", "-dcp", "2"]), tmp_path, timeout=120)
    for i, (rc, _, err) in enumerate(res):
        assert rc == 0, f"process {i} exited {rc}:\n{err[-3000:]}"
    out0 = res[0][1]
    for want in reference:
        assert f"generated {NEW_TOKENS}: {want}" in out0, out0
    assert f"MTP: {K} drafts per step" in out0, out0
    assert res[1][1] == "", res[1][1]  # only process 0 reports


def test_oracle_drafts_across_processes(ckpt, reference, tmp_path):
    """Drafts right up to draft position m (0..K) and wrong after it: every process accepts the same m drafts
    per verify row (the tokens unchanged), per-position acceptance 1 before m and 0 from m on."""
    port, out = free_port(), tmp_path / "out.npz"
    res = _run_two([[sys.executable, str(HERE / "mtp_worker.py"), str(port), "2", str(i), "2", str(ckpt), str(out),
                     "4,1", str(K)] for i in range(2)], tmp_path, timeout=120)
    for i, (rc, stdout, err) in enumerate(res):
        assert rc == 0 and "done" in stdout, f"process {i} exited {rc}:\n{err[-3000:]}"
    got = np.load(out)
    np.testing.assert_array_equal(got["mtp/tokens"], reference)
    for m in range(K + 1):
        np.testing.assert_array_equal(got[f"oracle{m}/tokens"], reference, err_msg=f"m={m}")
        assert got[f"oracle{m}/acceptance"].tolist() == [1.0] * m + [0.0] * (K - m), f"m={m}"


def test_cli_generate_mesh_leaving_out_a_process_is_an_error(ckpt, tmp_path):
    """-tp 2 -dcp 2 takes process 0's two devices only: every process says so, before loading anything."""
    res = _run_two(_generate_cmds(ckpt, ["-tp", "2", "-dcp", "2"]), tmp_path, timeout=60)
    for i, (rc, _, err) in enumerate(res):
        assert rc == 2, f"process {i} exited {rc}:\n{err[-3000:]}"
        assert "leaves out processes [1] of 2" in err and "-tp 4" in err, f"process {i}:\n{err[-3000:]}"
