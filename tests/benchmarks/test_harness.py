"""benchmarks.harness: the timer's arithmetic (on a scripted clock), budgeted sweeps, device peaks, records."""

import datetime
import json
import os
import subprocess

import jax
import numpy as np
import pytest

from benchmarks import harness

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(harness.time, "perf_counter", c)
    return c


def test_median_seconds_after_warmup(clock):
    durations = iter([100.0, 3.0, 1.0, 4.0, 1.0, 5.0])  # the first is the warm-up call's (compile) and is dropped

    def call():
        clock.t += next(durations)
        return jax.numpy.zeros(2)
    assert harness.median_seconds(call, warmup=1, reps=5) == 3.0
    with pytest.raises(StopIteration):  # exactly warmup + reps calls were made
        next(durations)


def test_median_seconds_calls_per_rep(clock):
    durations = iter([9.0, 9.0, 1.0, 3.0, 2.0, 2.0, 10.0, 0.0])  # warm-up 2, then samples (1+3)/2, (2+2)/2, 10/2
    calls = []

    def call():
        calls.append(1)
        clock.t += next(durations)
    assert harness.median_seconds(call, warmup=2, reps=3, calls_per_rep=2) == 2.0
    assert len(calls) == 8
    with pytest.raises(ValueError, match="calls_per_rep"):
        harness.median_seconds(call, calls_per_rep=0)
    with pytest.raises(ValueError, match="reps"):
        harness.median_seconds(call, reps=0)


def test_per_op_time_cancels_the_fixed_cost(clock):
    made = []

    def make(n):  # an executable of n ops: 7 s fixed (dispatch, sync) + 2 s per op
        made.append(n)

        def run(*args):
            assert args == ("a", "b")
            clock.t += 7.0 + 2.0 * n
        return run
    per_op, amortised = harness.per_op_time(make, ("a", "b"), 8, iters=3)
    assert per_op == 2.0 and amortised == (7.0 + 16.0) / 8 and made == [8, 1]
    assert harness.per_op_time(make, ("a", "b"), 6, iters=2, lo=2)[0] == 2.0
    with pytest.raises(ValueError, match="must exceed lo"):
        harness.per_op_time(make, (), 1, iters=2)


class _Ev:
    def __init__(self, ns, start=0, program=None):
        self.duration_ns, self.start_ns = ns, start
        self.stats = [] if program is None else [("correlation_id", 1), ("program_id", program)]


class _Line:
    def __init__(self, name, *ns):
        self.name, self.events = name, [n if isinstance(n, _Ev) else _Ev(n) for n in ns]


class _Plane:
    def __init__(self, name, *lines):
        self.name, self.lines = name, list(lines)


def test_kernel_seconds_sums_stream_lines_of_gpu_planes():
    """Hand-made planes: the stream lines of every GPU plane add up; XLA's derived lines and host planes do not."""
    planes = [_Plane("/host:CPU", _Line("python", 5_000)),
              _Plane("/device:GPU:0", _Line("Stream #13(Compute)", 1_000, 2_500), _Line("XLA Ops", 3_500),
                     _Line("XLA Modules", 3_500), _Line("Stream #14(MemcpyD2H)", 500)),
              _Plane("/device:GPU:1", _Line("Stream #13(Compute)", 250))]
    assert harness.kernel_seconds(planes) == pytest.approx(4_250e-9)
    assert harness.kernel_seconds([_Plane("/host:CPU", _Line("python", 5))]) is None
    assert harness.kernel_seconds([_Plane("/device:GPU:0")]) == 0.0


def test_span_seconds_follows_the_last_executable():
    """Hand-made stream events: two runs of program 7, each after a flush (program 3), the second with an idle gap
    between its kernels; the span is first kernel to last per run (gap included), the flushes left out, events
    without a program_id ignored, derived lines and host planes too."""
    ev = _Ev
    stream = _Line("Stream #14(Compute)",
                   ev(100, 0, 3),                 # flush
                   ev(10, 200, 7), ev(20, 215, 7),  # run 1: 200 .. 235
                   ev(5, 300, None),              # a memcpy without program_id
                   ev(100, 400, 3),               # flush
                   ev(10, 600, 7), ev(10, 650, 7))  # run 2: 600 .. 660, a 40 ns gap inside
    planes = [_Plane("/host:CPU", _Line("python", ev(5_000, 0, 7))),
              _Plane("/device:GPU:0", stream, _Line("XLA Modules", ev(9_999, 0, 7)))]
    assert harness.span_seconds(planes) == pytest.approx((35 + 60) * 1e-9)
    assert harness.kernel_seconds(planes) == pytest.approx((100 + 10 + 20 + 5 + 100 + 10 + 10) * 1e-9)
    assert harness.span_seconds([_Plane("/host:CPU")]) is None
    assert harness.span_seconds([_Plane("/device:GPU:0", _Line("Stream #1", 40))]) == 0.0


def test_traced_times_needs_a_gpu():
    """On the CPU the trace has no GPU plane: a RuntimeError that says so, not a zero."""
    f = jax.jit(lambda x: x * 2)
    with pytest.raises(RuntimeError, match="no GPU plane"):
        harness.traced_times(lambda: f(jax.numpy.ones(4)), runs=1)


def test_per_op_traced_times_takes_the_difference(monkeypatch):
    """(X(reps) - X(lo)) / (reps - lo) for both figures over scripted times (kernels 3 + 2 n, span 5 + 4 n);
    `before` reaches the tracer, `keep` only the `reps` executable's trace."""
    seen = []

    def fake(call, runs, before, keep=None):
        seen.append((runs, before, keep))
        n = call()
        return harness.TraceTimes(3.0 + 2.0 * n, 5.0 + 4.0 * n)
    monkeypatch.setattr(harness, "traced_times", fake)

    def make(n):
        return lambda *args: n if args == ("a",) else None
    flush = object()
    got = harness.per_op_traced_times(make, ("a",), 8, lo=2, runs=4, before=flush)
    assert got.kernel == pytest.approx(2.0) and got.span == pytest.approx(4.0)
    assert seen == [(4, flush, None), (4, flush, None)]
    seen.clear()
    harness.per_op_traced_times(make, ("a",), 8, lo=2, runs=4, before=flush, keep="hi.xplane.pb")
    assert seen == [(4, flush, "hi.xplane.pb"), (4, flush, None)]
    with pytest.raises(ValueError, match="must exceed lo"):
        harness.per_op_traced_times(make, ("a",), 2, lo=2)


def test_traced_times_or_none(monkeypatch):
    """The times when the trace works; None and one log line naming the error when it fails (on the CPU: no
    GPU plane), with the arguments passed through; `trace_micros` turns either into a row's fields."""
    seen, logged = [], []
    times = harness.TraceTimes(2.5e-6, 3.5e-6)

    def fake(make, args, reps, lo, runs, before):
        seen.append((args, reps, lo, runs, before))
        return times
    monkeypatch.setattr(harness, "per_op_traced_times", fake)
    assert harness.traced_times_or_none(None, ("a",), 8, lo=2, before=print) is times
    assert seen == [(("a",), 8, 2, 3, print)]
    monkeypatch.undo()
    f = jax.jit(lambda x: x * 2)
    x = jax.numpy.ones(4)
    assert harness.traced_times_or_none(lambda n: f, (x,), 3, runs=1, log=logged.append) is None
    assert len(logged) == 1 and logged[0].startswith("trace times failed: RuntimeError") and "no GPU plane" in logged[0]
    assert harness.trace_micros(None) == {"kernel_us": None, "device_us": None}
    got = harness.trace_micros(times)
    assert got["kernel_us"] == pytest.approx(2.5) and got["device_us"] == pytest.approx(3.5)
    assert harness.micros(None) is None and harness.micros(2.5e-6) == pytest.approx(2.5)


def test_per_rep_splits_the_leading_axis():
    x = jax.numpy.arange(24).reshape(3, 2, 4)
    parts = harness.per_rep(x)
    assert isinstance(parts, tuple) and len(parts) == 3
    for i, p in enumerate(parts):
        np.testing.assert_array_equal(np.asarray(p), np.arange(24).reshape(3, 2, 4)[i])


def test_device_time_of_a_loop_body():
    """On CPU the loop of 11 adds must not be cheaper than the loop of 1: a non-negative, finite figure."""
    t = harness.device_time(lambda c, k: c + k, jax.numpy.ones(4), jax.numpy.ones(4), reps=10, iters=2)
    assert np.isfinite(t) and t >= 0


def test_budgeted_sweep_stops_when_the_budget_is_spent():
    clock = FakeClock()
    budget = harness.Budget(10.0, clock=clock)
    lines = []

    def measure(cfg):
        clock.t += 4.0
        if cfg == "bad":
            raise RuntimeError("out of shared memory")
        return {"a": 3.0, "b": 1.0, "c": 2.0}[cfg]
    res = harness.budgeted_sweep(["a", "bad", "b", "c", "d"], measure, budget, label="B=8", log=lines.append)
    # a at t=0, bad at 4, b at 8 (not yet past 10); at 12 the rest is skipped
    assert res.measured == [("a", 3.0), ("b", 1.0)] and res.skipped == ["c", "d"]
    assert res.failed == [("bad", "RuntimeError: out of shared memory")]
    assert res.best() == ("b", 1.0)
    assert lines == ["  B=8 bad: RuntimeError: out of shared memory", "  B=8 budget of 10 s spent: skipped 2 config(s)"]
    assert res.report() == {"measured": 2, "failed": [{"config": "bad", "error": "RuntimeError: out of shared memory"}],
                            "skipped": ["c", "d"]}


def test_budgeted_sweep_minimum_and_a_shared_budget():
    clock = FakeClock()
    budget = harness.Budget(1.0, clock=clock)
    clock.t = 5.0  # spent before the sweep starts (an earlier sweep of the same run used it up)
    res = harness.budgeted_sweep(["x", "y"], lambda cfg: 1.0, budget, log=lambda s: None)
    assert res.measured == [("x", 1.0)] and res.skipped == ["y"]  # at least one is measured
    res = harness.budgeted_sweep(iter(["x", "y"]), lambda cfg: 1.0, budget, min_measured=0, log=lambda s: None)
    assert res.measured == [] and res.skipped == ["x", "y"] and res.best() is None
    with pytest.raises(ValueError, match="budget seconds"):
        harness.Budget(-1)


def test_device_peaks():
    h200 = harness.device_peaks("NVIDIA H200")
    assert (h200.hbm_bytes_per_s, h200.bf16_flops_per_s, h200.fp8_flops_per_s, h200.known) == \
        (4.8e12, 989e12, 1979e12, True)
    cpu = harness.device_peaks(jax.devices()[0])
    assert not cpu.known and cpu.name.startswith("unknown device 'cpu'")
    assert (cpu.hbm_bytes_per_s, cpu.bf16_flops_per_s) == (4.8e12, 989e12)  # the reference roofline, said so


def test_peak_bytes_on_cpu_is_unknown():
    assert harness.peak_bytes(jax.devices()[0]) is None


def test_record_and_json(tmp_path):
    rec = harness.record([{"B": 1, "us": np.float32(2.5)}], command="python x.py --b 1", roofline="NVIDIA H200")
    assert list(rec) == ["date", "commit", "device", "jax", "command", "rows", "roofline"]
    assert datetime.datetime.fromisoformat(rec["date"]).tzinfo is not None
    assert rec["device"] == "cpu" and rec["command"] == "python x.py --b 1" and rec["jax"] == jax.__version__
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert rec["commit"].split("+")[0] == head.stdout.strip()
    path = tmp_path / "r.json"
    harness.write_json(str(path), rec)
    back = json.loads(path.read_text())
    assert back["rows"] == [{"B": 1, "us": 2.5}] and back["roofline"] == "NVIDIA H200"
    with pytest.raises(ValueError, match="overwrite"):
        harness.record([], device="cpu", rows=[1])
    with pytest.raises(ValueError, match="overwrite"):
        harness.record([], commit="abc")


def test_command_line():
    script = os.path.join(REPO, "benchmarks", "bench_moe.py")
    want = "python benchmarks/bench_moe.py --out 'a b.json'"
    assert harness.command_line(["--out", "a b.json"], script=script) == want
