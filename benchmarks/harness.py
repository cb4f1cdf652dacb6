"""The benchmark harness every script uses: one timer, one table of device peaks, budgeted sweeps, JSON records.

Timing (DESIGN.md, Benchmarks): warm up, then the median of many `jax.block_until_ready` timings. Kernel tables
take the device time of one op as the difference of two executables that run it n_hi and n_lo times
(`per_op_time`; `device_time` builds them as `fori_loop`s), so the fixed cost of dispatching an executable cancels.
Where the two executables differ in the arrays they take or return (one per op, `per_rep`), a host clock also counts
the host's work per array (on the GPU machine here about 25 us each, BENCHMARKS.md session 13); the device times of a
profiler trace (`per_op_traced_times`: kernel time and the device's span) do not.
Records: `{"date", "commit", "device", "command", "rows": [...]}` plus any keys a script adds.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import functools
import glob
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------------------------
# device peaks


@dataclasses.dataclass(frozen=True)
class DevicePeaks:
    """Roofline figures of a device kind: HBM bytes/s and dense bf16 FLOP/s (datasheet values).

    `known` is False when the device is not in `PEAKS`: the figures are then the reference device's, and `name`
    says so, so that a percentage computed from them is read as "of the H200's roofline", not of this device's."""

    name: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    known: bool = True


#: datasheet peaks by `jax.Device.device_kind`
PEAKS = {"NVIDIA H200": DevicePeaks("NVIDIA H200", hbm_bytes_per_s=4.8e12, bf16_flops_per_s=989e12)}
#: the device whose roofline stands in for an unknown one (DESIGN.md reports percentages of the H200 roofline)
REFERENCE_DEVICE = "NVIDIA H200"


def device_kind(device=None) -> str:
    """The kind of `device` (a `jax.Device`, a kind string, or None for the first device), e.g. 'NVIDIA H200'."""
    if isinstance(device, str):
        return device
    device = jax.devices()[0] if device is None else device
    return getattr(device, "device_kind", str(device))


def device_peaks(device=None) -> DevicePeaks:
    """The peaks of `device` (see `device_kind`); an unknown kind gets the reference device's figures with
    `known=False` and a name that says 'unknown device'."""
    kind = device_kind(device)
    if kind in PEAKS:
        return PEAKS[kind]
    return dataclasses.replace(PEAKS[REFERENCE_DEVICE], known=False,
                               name=f"unknown device {kind!r}: the {REFERENCE_DEVICE} roofline as a reference")


def peak_bytes(device) -> int | None:
    """The device allocator's peak bytes in use so far (None where the backend does not say: CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("peak_bytes_in_use")


# ---------------------------------------------------------------------------------------------------------------
# the timer


def _check_count(name: str, value: int, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def median_seconds(call: Callable[[], Any], *, warmup: int = 2, reps: int = 10, calls_per_rep: int = 1) -> float:
    """Median wall seconds of `call()` after `warmup` calls, each blocked until its result is ready.

    A sample is `calls_per_rep` consecutive calls blocked once at the end, divided by `calls_per_rep`: calls that
    depend on each other (a decode loop threading donated caches) then overlap dispatch with execution as they do
    in a real loop. `call` may close over state it updates (donated buffers)."""
    _check_count("warmup", warmup, 0)
    _check_count("reps", reps, 1)
    _check_count("calls_per_rep", calls_per_rep, 1)
    for _ in range(warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls_per_rep):
            out = call()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls_per_rep)
    return statistics.median(times)


def timeit(fn, *args, warmup: int = 2, reps: int = 10) -> float:
    """Median seconds of `fn(*args)` (blocked until ready) after warm-up calls."""
    return median_seconds(lambda: fn(*args), warmup=warmup, reps=reps)


def per_op_time(make: Callable[[int], Callable], args: tuple, reps: int, iters: int, lo: int = 1,
                warmup: int = 1) -> tuple[float, float]:
    """Device seconds of one op and the amortised seconds per op of the `reps`-op executable.

    `make(n)` builds an executable that runs the op n times; the first figure is (T(reps) - T(lo)) / (reps - lo),
    in which the fixed cost of dispatching and synchronising an executable cancels (floored at 1 ns: a quotient
    by it stays finite), the second T(reps) / reps. Each T is `timeit` over `iters` runs."""
    _check_count("iters", iters, 1)
    if reps <= lo:
        raise ValueError(f"reps ({reps}) must exceed lo ({lo}): the difference of the two executables is the time")
    t_hi = timeit(make(reps), *args, warmup=warmup, reps=iters)
    t_lo = timeit(make(lo), *args, warmup=warmup, reps=iters)
    return max(t_hi - t_lo, 1e-9) / (reps - lo), t_hi / reps


# ---------------------------------------------------------------------------------------------------------------
# kernel time from a profile

#: lines of a GPU plane that XLA derives from the kernels (their spans repeat the kernels' own)
DERIVED_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "TensorFlow Ops", "TensorFlow Name Scope",
                 "Framework Name Scope", "Steps", "Source code", "Host Offload Ops")


def stream_events(planes):
    """The events on the stream lines of a profile's GPU planes (XLA's derived lines, `DERIVED_LINES`, left out),
    or None when it has no GPU plane."""
    events, found = [], False
    for plane in planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        found = True
        for line in plane.lines:
            if line.name not in DERIVED_LINES:
                events.extend(line.events)
    return events if found else None


def kernel_seconds(planes) -> float | None:
    """Summed duration in seconds of the events on the stream lines of a profile's GPU planes ("/device:GPU:*"),
    i.e. the kernels (and device memsets/copies) the device ran; XLA's derived lines (`DERIVED_LINES`) are left
    out. None when there is no GPU plane (a CPU run). `planes`: `jax.profiler.ProfileData.planes`, or objects
    with the same `name` / `lines` / `events` / `duration_ns` fields."""
    events = stream_events(planes)
    return None if events is None else sum(e.duration_ns for e in events) * 1e-9


def _program_id(event):
    return next((str(v) for k, v in getattr(event, "stats", ()) if k == "program_id"), None)


def span_seconds(planes) -> float | None:
    """Device seconds from the first kernel to the last of each run of the trace's last executable, summed over
    its runs: its device wall time, idle gaps between its kernels included, the host's work before its first
    kernel (argument handling, launch) not. A run is a stretch of stream events (in time order) of that
    executable's `program_id` stat, other executables' events (an L2 flush between runs) ending it. None when
    there is no GPU plane; 0.0 when it has no event with a `program_id`."""
    events = stream_events(planes)
    if events is None:
        return None
    events = sorted((e for e in events if _program_id(e) is not None), key=lambda e: e.start_ns)
    if not events:
        return 0.0
    last = max(events, key=lambda e: e.start_ns + e.duration_ns)
    total, first, end = 0.0, None, None
    for e in events + [None]:
        if e is not None and _program_id(e) == _program_id(last):
            first = e.start_ns if first is None else first
            end = max(end or 0, e.start_ns + e.duration_ns)
        elif first is not None:
            total, first, end = total + (end - first), None, None
    return total * 1e-9


@dataclasses.dataclass(frozen=True)
class TraceTimes:
    """Device seconds of a call (or of one op, as a difference) read from a profiler trace: `kernel`, the time
    its kernels ran (`kernel_seconds`), and `span`, the device's wall time from its first kernel to its last
    (`span_seconds`): the two differ by the device's idle gaps between the kernels."""

    kernel: float
    span: float


@functools.lru_cache(None)
def _run_marker() -> Callable[[], Any]:
    """A call that runs one tiny kernel: what `traced_times` puts between runs when the caller gives no `before`
    (compiled once per process, not per trace)."""
    marker, one = jax.jit(lambda x: x + 1), jnp.zeros((1,), jnp.int32)
    return lambda: marker(one)


def traced_times(call: Callable[[], Any], runs: int = 5, before: Callable[[], Any] | None = None,
                 keep: str | None = None) -> TraceTimes:
    """`TraceTimes` of one `call()`: `runs` calls (after one untraced warm-up), each after `before()` (traced
    too, e.g. an L2 flush, by default a one-kernel marker that ends a run for `span_seconds`: its kernels count in
    `kernel`, so take differences, as `per_op_traced_times` does; not in `span`, which follows the call's own
    executable), from one `jax.profiler` trace, divided by `runs`. `keep`: a path the trace's .xplane.pb is copied
    to (for `benchmarks/diagnostics/diag_launch_gap.py --summarise`).
    Unlike a host clock, neither figure counts the host's work before the device starts. RuntimeError where the
    trace holds no GPU plane."""
    _check_count("runs", runs, 1)
    before = before or _run_marker()
    jax.block_until_ready(before())
    jax.block_until_ready(call())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(runs):
                jax.block_until_ready(before())
                jax.block_until_ready(call())
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            raise RuntimeError(f"traced_times: the profiler wrote no .xplane.pb under {d}")
        if keep is not None:
            shutil.copy(paths[0], keep)
        profile = jax.profiler.ProfileData.from_file(paths[0])
        planes = list(profile.planes)  # an iterator: both figures read it
        kernel, span = kernel_seconds(planes), span_seconds(planes)
    if kernel is None:
        raise RuntimeError("traced_times: the trace has no GPU plane (kernel time is measured on a GPU)")
    return TraceTimes(kernel / runs, span / runs)


def per_op_traced_times(make: Callable[[int], Callable], args: tuple, reps: int, lo: int = 1, runs: int = 5,
                        before: Callable[[], Any] | None = None, keep: str | None = None) -> TraceTimes:
    """`TraceTimes` of one op: (X(reps) - X(lo)) / (reps - lo) for both figures, X the `traced_times` of the
    executables `make(reps)` and `make(lo)` on `args` (what both run once, and `before`, cancels); `keep`: where
    to copy the `reps` executable's trace."""
    if reps <= lo:
        raise ValueError(f"reps ({reps}) must exceed lo ({lo}): the difference of the two executables is the time")
    hi_fn, lo_fn = make(reps), make(lo)
    hi = traced_times(lambda: hi_fn(*args), runs, before, keep)
    low = traced_times(lambda: lo_fn(*args), runs, before)
    return TraceTimes(max(hi.kernel - low.kernel, 1e-9) / (reps - lo), max(hi.span - low.span, 1e-9) / (reps - lo))


def traced_times_or_none(make: Callable[[int], Callable], args: tuple, reps: int, lo: int = 1, runs: int = 3,
                         before: Callable[[], Any] | None = None,
                         log: Callable[[str], Any] | None = None) -> TraceTimes | None:
    """`per_op_traced_times`, or None when the trace fails (no GPU, no profiler plugin): a bench's wall-clock row
    stands without its device times. The failure is told to `log` (default stderr)."""
    try:
        return per_op_traced_times(make, args, reps, lo=lo, runs=runs, before=before)
    except Exception as e:  # noqa: BLE001 - any failure of the trace leaves the row without the figures
        (log or (lambda s: print(s, file=sys.stderr, flush=True)))(
            f"trace times failed: {type(e).__name__}: {str(e)[:300]}")
        return None


def micros(seconds: float | None) -> float | None:
    """Seconds as microseconds; None stays None (a figure that was not measured)."""
    return None if seconds is None else seconds * 1e6


def trace_micros(times: TraceTimes | None, prefix: str = "") -> dict:
    """{prefix + "kernel_us", prefix + "device_us"} of a `TraceTimes` (both None when it was not measured), for a
    bench's row ("xla_" for the xla op's figures beside an op's)."""
    return {f"{prefix}kernel_us": micros(times and times.kernel), f"{prefix}device_us": micros(times and times.span)}


def per_rep(x) -> tuple:
    """The slices x[0], x[1], ... of x's leading axis as separate device arrays. A benchmark that runs op i of an
    executable on inputs[i] then passes these, so the timed executable reads each op's inputs as they are instead
    of slicing them first (a copy kernel per input per op, not part of the op)."""
    out = tuple(x[i] for i in range(x.shape[0]))
    jax.block_until_ready(out)
    return out


def nudge(x, y):
    """x plus a tiny multiple of y: a data dependency between loop iterations that XLA cannot remove."""
    return x + (jnp.sum(y.astype(jnp.float32)) * 1e-9).astype(x.dtype)


def op_device_time(fn, x, *consts, reps: int = 10, iters: int = 5) -> float:
    """Device seconds of one `fn(x, *consts)` call (any output), looped in one executable (`device_time`)."""
    return device_time(lambda c, *k: nudge(c, fn(c, *k)), x, *consts, reps=reps, iters=iters)


def device_time(body, carry, *consts, reps: int = 10, iters: int = 5) -> float:
    """Device seconds of one `body(carry, *consts) -> carry`, from executables that loop it in a fori_loop:
    (T(1 + reps) - T(1)) / reps (`per_op_time`)."""
    def looped(n):
        return jax.jit(lambda c, *k: jax.lax.fori_loop(0, n, lambda i, c: body(c, *k), c))
    return per_op_time(looped, (carry, *consts), 1 + reps, iters, lo=1, warmup=2)[0]


# ---------------------------------------------------------------------------------------------------------------
# budgeted sweeps


class Budget:
    """A wall-clock budget that starts when it is made; one budget may span several sweeps."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.perf_counter):
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or math.isnan(seconds) or seconds < 0:
            raise ValueError(f"budget seconds must be a number >= 0, got {seconds!r}")
        self.seconds, self._clock, self._start = float(seconds), clock, clock()

    def elapsed(self) -> float:
        """Seconds since the budget started."""
        return self._clock() - self._start

    def spent(self) -> bool:
        """Whether the budget's seconds have passed."""
        return self.elapsed() > self.seconds


@dataclasses.dataclass
class SweepResult:
    """What a budgeted sweep did with each config: measured (config, seconds), failed (config, error) or
    skipped (config) because the budget was spent."""

    measured: list[tuple[Any, float]] = dataclasses.field(default_factory=list)
    failed: list[tuple[Any, str]] = dataclasses.field(default_factory=list)
    skipped: list[Any] = dataclasses.field(default_factory=list)

    def best(self) -> tuple[Any, float] | None:
        """The measured (config, seconds) with the least seconds (the first of equals), or None."""
        return min(self.measured, key=lambda cs: cs[1]) if self.measured else None

    def report(self) -> dict:
        """A JSON-able summary: how many were measured, the failures and the skipped configs."""
        return {"measured": len(self.measured), "failed": [{"config": c, "error": e} for c, e in self.failed],
                "skipped": list(self.skipped)}


def budgeted_sweep(configs: Iterable, measure: Callable[[Any], float], budget: Budget | float, *,
                   min_measured: int = 1, label: str = "", log=None) -> SweepResult:
    """Measure `configs` in order until `budget` (a `Budget`, or seconds from now) is spent, but at least until
    `min_measured` have been measured. `measure(config)` returns seconds; a config whose `measure` raises (one
    that does not compile: shared memory, registers) is recorded as failed and the sweep goes on. The configs
    left when the budget ran out are listed as skipped, and a line says how many (on `log`, default stderr)."""
    if not isinstance(budget, Budget):
        budget = Budget(budget)
    _check_count("min_measured", min_measured, 0)
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    prefix = f"  {label} " if label else "  "
    res = SweepResult()
    it = iter(configs)
    for cfg in it:
        if budget.spent() and len(res.measured) >= min_measured:
            res.skipped = [cfg, *it]
            break
        try:
            res.measured.append((cfg, measure(cfg)))
        except Exception as e:  # a config that cannot run is a result of the sweep, not an error of the script
            res.failed.append((cfg, f"{type(e).__name__}: {str(e)[:200]}"))
            log(f"{prefix}{cfg}: {res.failed[-1][1][:160]}")
    if res.skipped:
        log(f"{prefix}budget of {budget.seconds:g} s spent: skipped {len(res.skipped)} config(s)")
    return res


# ---------------------------------------------------------------------------------------------------------------
# JSON records


def git_commit(repo: str = _REPO) -> str | None:
    """The short commit of `repo` ('+dirty' when tracked files differ from it), or None outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def command_line(argv: list[str] | None = None, script: str | None = None) -> str:
    """The command that ran: `python PATH` for a `script` file (its path from the repository root), else how this
    process was started (`python -m PACKAGE` or `python PATH`), then `argv` (default: the process's arguments)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if script is not None:
        prog = f"python {os.path.relpath(os.path.abspath(script), _REPO)}"
    else:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        prog = (f"python -m {spec.name.removesuffix('.__main__')}" if spec is not None and spec.name
                else f"python {sys.argv[0]}")
    return f"{prog} {shlex.join(argv)}".strip()


def record(rows: Iterable[dict], /, *, command: str | None = None, device=None, **extra) -> dict:
    """The JSON record of a run: date (UTC), commit, device kind, command and rows, then `extra` keys."""
    head = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "device": device_kind(device),
            "command": command if command is not None else command_line()}
    clash = sorted(set(extra) & (set(head) | {"rows"}))
    if clash:
        raise ValueError(f"record: extra keys {clash} would overwrite the record's own fields")
    return {**head, "rows": list(rows), **extra}


def _jsonable(x):
    if hasattr(x, "tolist"):  # numpy / jax scalars and arrays
        return x.tolist()
    return str(x)


def write_json(path: str, rec: dict) -> None:
    """Write a record (see `record`) as indented JSON."""
    with open(path, "w") as f:
        json.dump(rec, f, indent=1, default=_jsonable)
        f.write("\n")


def cu_profiler(start: bool) -> None:
    """Start or stop Nsight Compute's capture (`ncu --profile-from-start off`) through the CUDA driver API.

    The driver library is the one the process already runs on; loading a runtime `libcudart` beside jax's own
    CUDA libraries crashed the process on the H200 image (session 11)."""
    lib = ctypes.CDLL("libcuda.so.1")
    rc = lib.cuProfilerStart() if start else lib.cuProfilerStop()
    if rc:
        raise RuntimeError(f"cuProfiler{'Start' if start else 'Stop'} returned CUDA error {rc}")
