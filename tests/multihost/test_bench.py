"""`python -m glm_dsa bench` across 2 processes x 2 CPU devices on localhost (TP = 4): both processes end with
status 0 (no stall after the end-to-end line: every process makes the same device calls), process 0 prints the
end-to-end and decode lines and writes the JSON record, process 1 prints nothing; a layout whose mesh leaves a
process out is one clear error in every process, at once. A stall fails the test at its timeout."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the smallest run that still prefills, generates and times a decode step across the processes
BENCH = ["bench", "--preset", "tiny", "--input-len", "16", "--output-len", "4", "--batch", "2",
         "--decode-batches", "2", "--decode-context", "32"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two(args, tmp_path, timeout):
    """Both processes' (status, stdout, stderr); the test fails if they are not done within `timeout` s."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("GLM_DSA_DEBUG", None)
    port = _port()
    common = ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--distributed-timeout", "60",
              "--distributed-heartbeat-timeout", "15"]
    procs = [subprocess.Popen([sys.executable, "-m", "glm_dsa", *args, *common, "--process-id", str(i)],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    deadline = time.monotonic() + timeout
    outs = []
    for i, p in enumerate(procs):
        try:
            outs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs = [q.communicate()[0][-2000:] for q in procs]
            pytest.fail(f"process {i} of the two-process bench did not finish within {timeout} s (a stall); "
                        f"stdout of each: {logs}")
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def test_cli_bench_across_processes(tmp_path):
    res = _run_two([*BENCH, "-tp", "4", "--json-out", "bench.json"], tmp_path, timeout=150)
    for i, (rc, _, err) in enumerate(res):
        assert rc == 0, f"process {i} exited {rc}:\n{err[-3000:]}"
    out0 = res[0][1]
    assert "[xla] end-to-end: " in out0, out0
    decode = [line for line in out0.splitlines() if line.startswith("[xla] decode B=2: {")]
    assert len(decode) == 1, out0
    row = json.loads(decode[0].split(": ", 1)[1])
    assert math.isfinite(row["ms_per_step"]) and row["ms_per_step"] > 0, row
    assert "stages_ms" not in row  # one device's op times: skipped across processes
    assert "[xla] decode B=2: " in out0.splitlines()[-1]  # the table, after the decode runs
    assert res[1][1] == "", res[1][1]  # only process 0 reports
    rec = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["phase"], r.get("B")) for r in rec["rows"]] == [("end_to_end", None), ("decode", 2)], rec["rows"]


def test_cli_bench_mesh_leaving_out_a_process_is_an_error(tmp_path):
    """-tp 2 takes process 0's two devices only: process 1 would hold no part of the model."""
    t0 = time.monotonic()
    res = _run_two([*BENCH, "-tp", "2", "--no-end-to-end"], tmp_path, timeout=90)
    for i, (rc, _, err) in enumerate(res):
        assert rc == 2, f"process {i} exited {rc}:\n{err[-3000:]}"
        assert "leaves out processes [1] of 2" in err and "-tp 4" in err, err[-3000:]
    assert time.monotonic() - t0 < 60
