"""The real `python -m glm_dsa serve` as a subprocess, for the server's tests: `ServeProcess` (start, wait up,
post, read /metrics, stop), `serve_process` (a started one as a context manager) and `wait_for` (a bounded poll).
Every wait is bounded."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key"
MODEL = "tiny-test"


def free_port() -> int:
    """A loopback port free at the time of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`python -m glm_dsa serve` of `ckpt` as a real subprocess on a free loopback port (float32, CPU, `--api-key
    KEY`, `--served-model-name MODEL`, then `args`), its output in `log_path`. `base` is its URL."""

    def __init__(self, ckpt, log_path, *args: str, max_len: int = 512):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": str(ROOT),
               "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "glm_dsa", "serve", "--checkpoint", str(ckpt), "--dtype", "float32",
               "--max-model-len", str(max_len), "--port", str(self.port), "--api-key", KEY,
               "--served-model-name", MODEL, *args]
        with open(log_path, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    @property
    def log(self) -> str:
        return Path(self.log_path).read_text()

    def wait_up(self, timeout: float = 180) -> "ServeProcess":
        """Wait (bounded) until /health answers; RuntimeError with the log if the process ends or time runs out."""
        import httpx
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not come up (exit {self.proc.returncode}):\n{self.log[-4000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.3)

    def wait_exit(self, timeout: float) -> int | None:
        """The exit status, or None if the process is still running after `timeout` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not ended within 30 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            if self.wait_exit(30) is None:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def post(self, path: str, body, timeout: float = 60, **kw):
        """POST `body` (an object as JSON, or bytes as they are) with the API key."""
        import httpx
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **kw.pop("headers", {})}
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.base + path, content=data, headers=headers, timeout=timeout, **kw)

    def metrics(self) -> dict:
        """/metrics as {name: value}."""
        import httpx
        body = httpx.get(self.base + "/metrics", timeout=10).text
        return {k.split(":", 1)[1]: float(v) for k, v in (ln.split() for ln in body.splitlines()
                                                          if not ln.startswith("#"))}


@contextlib.contextmanager
def serve_process(ckpt, tmp_path_factory, *args: str, max_len: int = 512):
    """A started `ServeProcess` (waited up), stopped on exit."""
    server = ServeProcess(ckpt, tmp_path_factory.mktemp("serve") / "serve.log", *args, max_len=max_len)
    try:
        yield server.wait_up()
    finally:
        server.stop()


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    """Poll `predicate()` until it returns something truthy (returned); AssertionError naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(poll)
