"""`python -m glm_dsa bench` across 2 processes x 2 CPU devices on localhost (TP = 4): both processes end with
status 0 (no stall after the end-to-end line: every process makes the same device calls), process 0 prints the
end-to-end and decode lines and writes the JSON record, process 1 prints nothing; a layout whose mesh leaves a
process out is one clear error in every process, at once. A stall fails the test at its timeout."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multihost_processes import free_port, run_processes  # noqa: E402
#: the smallest run that still prefills, generates and times a decode step across the processes
BENCH = ["bench", "--preset", "tiny", "--input-len", "16", "--output-len", "4", "--batch", "2",
         "--decode-batches", "2", "--decode-context", "32"]


def _run_two(args, tmp_path, timeout):
    """Both processes' (status, stdout, stderr) of `python -m glm_dsa *args` on one coordinator."""
    common = ["--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2", "--distributed-timeout",
              "60", "--distributed-heartbeat-timeout", "15"]
    return run_processes([[sys.executable, "-m", "glm_dsa", *args, *common, "--process-id", str(i)] for i in range(2)],
                         tmp_path, timeout, "the two-process bench")


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
