"""Several processes on localhost as several hosts (JAX's multi-controller runtime over gloo): 2 processes x 4
CPU devices and 4 processes x 2 give the single-process 8-device run's float32 logits (<= 1e-5) and greedy
tokens for TP = 8 with DCP = 1, 4 and 8, QREP on and off, both merge backends; the 4 x 2 run restores an orbax
checkpoint saved on another layout; a peer that never joins or dies ends the others with a clear error."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import glm_dsa
from checkpoints import save_orbax_params
from checkpoints.fp8_blocks import write_fp8_release
from checkpoints.random import write_random_checkpoint
from glm_dsa import ParallelConfig, configs
from glm_dsa.model.param_tree import flatten_params

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from multihost_cases import GEN_PROMPTS, LOGIT_IDS, NEW_TOKENS  # noqa: E402
from multihost_processes import free_port, xla_flags  # noqa: E402

#: tiny's structure (dense + MoE, full and shared indexer layers) with 8 heads, so TP = 8 splits them
CFG = configs.tiny.replace(num_attention_heads=8)
#: TP = 8 layouts "tp,dcp,qrep,backend". Each process layout runs DCP = 1, 4 and 8 with QREP on and off and both
#: backends, and the two together run every DCP x QREP x backend combination (all of them twice would double
#: the minutes this costs CI's two cores).
HALVES = [
    ["8,1,0,a2a", "8,4,1,a2a", "8,4,0,ag_rs", "8,8,1,ag_rs", "8,8,0,a2a"],
    ["8,1,0,a2a", "8,4,1,ag_rs", "8,4,0,a2a", "8,8,1,a2a", "8,8,0,ag_rs"],
]
LAYOUTS = sorted(set(HALVES[0]) | set(HALVES[1]))
assert len(LAYOUTS) == 1 + 2 * 2 * 2  # every combination


def _env():
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")])
    # XLA_FLAGS as this run has them: each worker replaces the device count with its own (`xla_flags`)
    return env


def _launch(n, k, ckpt, out, layouts, timeout=600):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "worker.py"), str(port), str(n), str(i), str(k),
                               str(ckpt), str(out), *layouts], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(n)]
    deadline = time.monotonic() + timeout
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"multi-process run did not finish in {timeout} s")
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0 and "done" in log, f"process {i} (exit {p.returncode}):\n{log[-4000:]}"
    return np.load(out)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(HF checkpoint, orbax checkpoint of the same weights saved from a TP = 2 mesh)."""
    root = tmp_path_factory.mktemp("multihost")
    hf = root / "hf"
    write_random_checkpoint(CFG, hf, seed=3, dtype="float32", progress=False)
    eng = glm_dsa.load(hf, parallel=ParallelConfig(tensor_parallel_size=2), dtype="float32", progress=False)
    save_orbax_params(flatten_params(eng.params), eng.config, root / "orbax", progress=False)
    return hf, root / "orbax"


@pytest.fixture(scope="module")
def reference(ckpts):
    """The single-process 8-device results of every layout."""
    out = {}
    for layout in LAYOUTS:
        tp, dcp, qrep, backend = layout.split(",")
        par = ParallelConfig(tensor_parallel_size=int(tp), decode_context_parallel_size=int(dcp),
                             dcp_q_replicate=qrep == "1", dcp_comm_backend=backend)
        eng = glm_dsa.load(ckpts[0], parallel=par, dtype="float32", max_model_len=64, progress=False)
        out[f"{layout}/logits"] = eng.logits(np.asarray(LOGIT_IDS))
        out[f"{layout}/tokens"] = np.asarray(eng.generate(GEN_PROMPTS, max_new_tokens=NEW_TOKENS,
                                                          stop_token_ids=[]))
    return out


@pytest.mark.parametrize("n, k, source, layouts", [(2, 4, 0, HALVES[0]), (4, 2, 1, HALVES[1])],
                         ids=["2x4-hf", "4x2-orbax"])
def test_processes_match_one_process(n, k, source, layouts, ckpts, reference, tmp_path):
    got = _launch(n, k, ckpts[source], tmp_path / "out.npz", layouts)
    for layout in layouts:
        np.testing.assert_allclose(got[f"{layout}/logits"], reference[f"{layout}/logits"], atol=1e-5, rtol=0,
                                   err_msg=layout)
        np.testing.assert_array_equal(got[f"{layout}/tokens"], reference[f"{layout}/tokens"], err_msg=layout)


def test_fp8_release_across_processes(ckpts, tmp_path):
    """An FP8 release (block-scaled e4m3, experts kept K-major) loaded in its own form by 2 processes x 4 devices
    gives the single-process run's float32 logits and greedy tokens, with the same FP8 leaves."""
    fp8 = tmp_path / "fp8"
    write_fp8_release(ckpts[0], fp8)
    layouts = ["8,1,0,a2a", "8,4,1,ag_rs"]
    got = _launch(2, 4, fp8, tmp_path / "out.npz", layouts)
    for layout in layouts:
        tp, dcp, qrep, backend = layout.split(",")
        par = ParallelConfig(tensor_parallel_size=int(tp), decode_context_parallel_size=int(dcp),
                             dcp_q_replicate=qrep == "1", dcp_comm_backend=backend)
        eng = glm_dsa.load(fp8, parallel=par, dtype="float32", max_model_len=64, progress=False)
        kept = sum(str(a.dtype) == "float8_e4m3fn" for a in jax.tree_util.tree_leaves(eng.params))
        assert kept > 10 and int(got[f"{layout}/fp8_leaves"]) == kept, layout
        np.testing.assert_allclose(got[f"{layout}/logits"], eng.logits(np.asarray(LOGIT_IDS)), atol=1e-5, rtol=0,
                                   err_msg=layout)
        want = eng.generate(GEN_PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        np.testing.assert_array_equal(got[f"{layout}/tokens"], np.asarray(want), err_msg=layout)


def _worker_cmd(port, n, i, mode):
    code = (f"import os, sys, time; os.environ['XLA_FLAGS']='--xla_force_host_platform_device_count=2'; "
            f"from glm_dsa import distributed; "
            f"distributed.initialize('127.0.0.1:{port}', {n}, {i}, init_timeout_s=8, heartbeat_timeout_s=5); "
            f"import jax, jax.numpy as jnp; from jax.experimental import multihost_utils as mu; "
            f"mu.process_allgather(jnp.ones(2)); print('joined', flush=True); "
            + ("os._exit(0)" if mode == "die" else
               "[mu.process_allgather(jnp.ones(2)) or time.sleep(0.2) for _ in range(300)]; print('no error')"))
    return [sys.executable, "-c", code]


def test_a_peer_that_never_joins_is_a_clear_error():
    t0 = time.monotonic()
    p = subprocess.run(_worker_cmd(free_port(), 2, 0, "wait"), env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and time.monotonic() - t0 < 60
    assert "not all 2 processes joined the coordinator at 127.0.0.1:" in p.stderr, p.stderr[-2000:]


def test_a_peer_that_dies_ends_the_others():
    port = free_port()
    procs = [subprocess.Popen(_worker_cmd(port, 2, i, "die" if i else "wait"), env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    t0 = time.monotonic()
    out = procs[0].communicate(timeout=120)[0]
    procs[1].wait(timeout=30)
    assert procs[0].returncode != 0 and "no error" not in out and time.monotonic() - t0 < 90
    assert "another task died" in out or "unhealthy" in out, out[-3000:]


def test_cli_generate_across_processes(ckpts, tmp_path):
    """`python -m glm_dsa generate --coordinator-address ... --num-processes 2 --process-id I` in two processes,
    from a temporary directory: process 0 prints the single-process tokens, process 1 prints nothing."""
    port = free_port()
    env = _env()
    env["XLA_FLAGS"] = xla_flags(4)
    args = ["--checkpoint", str(ckpts[0]), "--prompt-ids", "5,6,7", "--max-new-tokens", "5", "--ignore-eos",
            "--dtype", "float32", "-tp", "8", "-dcp", "4", "--coordinator-address", f"127.0.0.1:{port}",
            "--num-processes", "2"]
    procs = [subprocess.Popen([sys.executable, "-m", "glm_dsa", "generate", *args, "--process-id", str(i)],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    eng = glm_dsa.load(ckpts[0], parallel=ParallelConfig(tensor_parallel_size=8, decode_context_parallel_size=4),
                       dtype="float32", max_model_len=64, progress=False)
    want = eng.generate([[5, 6, 7]], max_new_tokens=5, stop_token_ids=[])[0]
    assert f"generated 5: {want}" in outs[0][0], outs[0][0]
    assert outs[1][0] == ""
