"""Starting several local processes for the multi-process tests (tests/multihost): a free coordinator port, and a
run of one command per process that fails the test, naming the stalled process, past a timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def xla_flags(devices: int, flags: str | None = None) -> str:
    """XLA_FLAGS for a CPU process of `devices` simulated devices: `flags` (default: this process's XLA_FLAGS, e.g.
    the test run's compile settings from scripts/test.sh) with any device count replaced by this one."""
    kept = [f for f in (os.environ.get("XLA_FLAGS", "") if flags is None else flags).split()
            if not f.startswith(DEVICE_COUNT_FLAG)]
    return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={devices}"])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a coordinator or a server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(devices_per_process: int) -> dict:
    """The environment of one CPU process with `devices_per_process` simulated devices, the repository and this
    directory importable, unbuffered output and no debug tracebacks."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices_per_process))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")])
    env.pop("GLM_DSA_DEBUG", None)
    return env


def run_processes(cmds: list[list[str]], cwd, timeout: float, what: str, devices_per_process: int = 2):
    """Each process's (status, stdout, stderr) of cmds[i] run at once in `cwd`; past `timeout` s in all, every
    process is killed and the test fails naming the stalled one (`what`: the run, for the message) with the tail
    of each process's output."""
    env = cpu_env(devices_per_process)
    procs = [subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    deadline = time.monotonic() + timeout
    outs = []
    for i, p in enumerate(procs):
        try:
            outs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs = [[s[-2000:] for s in q.communicate()] for q in procs]
            import pytest  # here, not at the top: the worker processes import this module for xla_flags
            pytest.fail(f"process {i} of {what} did not finish within {timeout} s (a stall); stdout and stderr of "
                        f"each: {logs}")
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
