"""Prefix caching across 2 processes x 2 CPU devices on localhost (TP = 4, DCP = 2): every process matches the same
pages (lockstep needs the match to be a pure function of the requests) and the tokens are those of the
single-process engine with caching off (the oracle, in this process). A stall fails the test at its timeout."""

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
from multihost_cases import PREFIX_NEW_TOKENS, prefix_turns  # noqa: E402
from multihost_processes import free_port, run_processes  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix_mh") / "hf"
    write_random_checkpoint(configs.tiny, path, seed=4, dtype="float32", progress=False)
    return path


def test_two_processes_match_the_same_pages(ckpt, tmp_path):
    par = ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=2)
    ref = glm_dsa.load(ckpt, parallel=par, dtype="float32", max_model_len=64, block_size=4, progress=False,
                       enable_prefix_caching=False)
    want = prefix_turns(ref, PREFIX_NEW_TOKENS)
    port, out = free_port(), tmp_path / "out"
    res = run_processes([[sys.executable, str(HERE / "prefix_worker.py"), str(port), "2", str(i), "2", str(ckpt),
                          str(out), "4,2"] for i in range(2)], tmp_path, 120, "the two-process prefix-caching run")
    for i, (rc, stdout, err) in enumerate(res):
        assert rc == 0 and "done" in stdout, f"process {i} exited {rc}:\n{err[-3000:]}"
    got = [np.load(f"{out}_{i}.npz", allow_pickle=True) for i in range(2)]
    for g in got:
        assert [list(t) for t in g["tokens"]] == want
    # pages of 4 x 2 ranks = 8 tokens. Turn 1: the second prompt reuses the first's 2 prefix pages (16 tokens),
    # admitted in the same step. Turn 2: each prompt (its turn-1 prompt, answer and 2 tokens) reuses 2 pages
    # of its own turn: the third (positions 16..23) was never complete (its last answer token was not computed)
    q = [19, 18, 19 + 4 + 2, 18 + 4 + 2]
    np.testing.assert_array_equal(got[0]["counters"], got[1]["counters"])
    assert got[0]["counters"][:2].tolist() == [sum(q), 16 + 16 + 16]
