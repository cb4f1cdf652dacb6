"""`python -m glm_dsa serve` across 2 processes x 4 CPU devices on localhost (TP = 8, DCP = 4): process 0 answers
HTTP with the tokens of the single-process 8-device engine (greedy, and sampled with a seed: the sampling
parameters reach every process), stops the other process when it stops, and ends with an error within bounded
time when the other process is killed mid-request. Oracle: `Engine.generate` in this process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import glm_dsa
from checkpoints.random import write_random_checkpoint
from glm_dsa import ParallelConfig, configs

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from multihost_processes import free_port, xla_flags  # noqa: E402

CFG = configs.tiny.replace(num_attention_heads=8)  # TP = 8 splits the heads
LAYOUT = ["-tp", "8", "-dcp", "4"]
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
MAX_LEN = 256


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_mh") / "hf"
    write_random_checkpoint(CFG, path, seed=3, dtype="float32", progress=False)
    return path


@pytest.fixture(scope="module")
def eng(ckpt):
    """The single-process reference on this process's 8 devices."""
    return glm_dsa.load(ckpt, parallel=ParallelConfig(tensor_parallel_size=8, decode_context_parallel_size=4),
                        dtype="float32", max_model_len=MAX_LEN, progress=False)


class Servers:
    """Two serve processes (process 0 on an HTTP port), their logs, and a bounded wait for /health."""

    def __init__(self, ckpt, tmp_path, heartbeat_s=10):
        self.base = f"http://127.0.0.1:{free_port()}"
        coordinator = f"127.0.0.1:{free_port()}"
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4),
                   PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        self.logs = [tmp_path / f"serve{i}.log" for i in range(2)]
        self.procs = []
        for i in range(2):
            cmd = [sys.executable, "-m", "glm_dsa", "serve", "--checkpoint", str(ckpt), "--dtype", "float32",
                   *LAYOUT, "--max-model-len", str(MAX_LEN), "--port", self.base.rsplit(":", 1)[1],
                   "--max-num-seqs", "4", "--coordinator-address", coordinator, "--num-processes", "2",
                   "--process-id", str(i), "--distributed-timeout", "60",
                   "--distributed-heartbeat-timeout", str(heartbeat_s)]
            with open(self.logs[i], "w") as out:
                self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=env))

    def log(self, i) -> str:
        return self.logs[i].read_text()

    def wait_up(self, timeout=120):
        deadline = time.monotonic() + timeout
        while True:
            dead = [i for i, p in enumerate(self.procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not come up (exited: {dead}):\n{self.log(0)[-3000:]}\n"
                                   f"{self.log(1)[-3000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.3)

    def wait_exit(self, i, timeout):
        try:
            return self.procs[i].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def _complete(base, **body):
    r = httpx.post(base + "/v1/completions", json={"return_token_ids": True, "ignore_eos": True, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    return [c["token_ids"] for c in r.json()["choices"]]


def test_serve_across_processes_answers_like_one_process(ckpt, eng, tmp_path):
    servers = Servers(ckpt, tmp_path)
    try:
        servers.wait_up()
        greedy = _complete(servers.base, prompt=PROMPTS, max_tokens=6, temperature=0)
        sampled = _complete(servers.base, prompt=PROMPTS, max_tokens=6, temperature=0.9, top_p=0.95, seed=11)
        # two concurrent requests: their submits reach the engine in whatever order, every process follows it
        got = {}
        threads = [threading.Thread(target=lambda k=k: got.__setitem__(k, _complete(
            servers.base, prompt=PROMPTS[k], max_tokens=5, temperature=0))) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert "serving" in servers.log(0)
        servers.procs[0].send_signal(signal.SIGTERM)  # process 0 stops: the other one follows
        codes = [servers.wait_exit(0, 60), servers.wait_exit(1, 60)]
    finally:
        servers.kill_all()
    assert codes == [0, 0], (codes, servers.log(0)[-3000:], servers.log(1)[-3000:])
    assert "process 0 stopped serving" in servers.log(1)
    want = eng.generate(PROMPTS, max_new_tokens=6, stop_token_ids=[])
    assert greedy == want
    assert sampled == eng.generate(PROMPTS, max_new_tokens=6, temperature=0.9, top_p=0.95, seed=11,
                                   stop_token_ids=[])
    assert sampled != greedy  # the sampling parameters were applied, not dropped
    assert [got[0][0], got[1][0]] == [w[:5] for w in want]


def test_a_follower_killed_mid_request_ends_process_0(ckpt, tmp_path):
    servers = Servers(ckpt, tmp_path, heartbeat_s=4)
    try:
        servers.wait_up()
        first = threading.Event()

        def stream():  # a long request, still running when process 1 goes
            try:
                with httpx.stream("POST", servers.base + "/v1/completions", timeout=120, json={
                        "prompt": PROMPTS[0], "max_tokens": MAX_LEN - 8, "temperature": 0, "ignore_eos": True,
                        "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            json.loads(line[6:])
                            first.set()
            except httpx.HTTPError:
                pass  # the server went away mid-stream: expected
        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert first.wait(60), servers.log(0)[-3000:]
        servers.procs[1].kill()
        t0 = time.monotonic()
        code = servers.wait_exit(0, 60)
        elapsed = time.monotonic() - t0
    finally:
        servers.kill_all()
    log = servers.log(0)
    assert code not in (None, 0), log[-3000:]
    assert elapsed < 60
    assert ("unhealthy" in log or "another task died" in log or "serving across processes stopped" in log), \
        log[-3000:]
