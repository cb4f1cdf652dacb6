"""The benchmark harness every script uses: one timer, one table of device peaks, budgeted sweeps, JSON records.

Timing (DESIGN.md, Benchmarks): warm up, then the median of many `jax.block_until_ready` timings. Kernel tables
take the device time of one op as the difference of two executables that run it n_hi and n_lo times
(`per_op_time`; `device_time` builds them as `fori_loop`s), so the fixed cost of dispatching an executable cancels.
Where the two executables differ in the arrays they take or return (one per op, `per_rep`), a host clock also counts
the host's work per array (BENCHMARKS.md, attention kernels); the device times of a profiler trace
(`per_op_traced_times`: kernel time and the device's span) do not.
Records: `{"date", "commit", "device", "jax", "command", "rows": [...]}` plus any keys a script adds.

The timer, the device peaks and the record are the package's (`glm_dsa.serving.benchmark`, which `python -m glm_dsa bench`
runs); they are re-exported here so that every benchmark takes them from one place.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import glob
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from glm_dsa.serving.benchmark import (PEAKS, REFERENCE_DEVICE, DevicePeaks, check_count, command_line,  # noqa: F401
                               device_kind, device_peaks, device_time, git_commit, median_seconds, nudge, peak_bytes,
                               per_op_time, record, timeit, write_json)


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
    check_count("runs", runs, 1)
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


def op_device_time(fn, x, *consts, reps: int = 10, iters: int = 5) -> float:
    """Device seconds of one `fn(x, *consts)` call (any output), looped in one executable (`device_time`)."""
    return device_time(lambda c, *k: nudge(c, fn(c, *k)), x, *consts, reps=reps, iters=iters)


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
    check_count("min_measured", min_measured, 0)
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
# a script's platform flags


def apply_platform_flags(cpu: bool, xla_autotune: int | None = None) -> None:
    """Apply a script's `--xla-autotune` (XLA's GPU autotune level) and `--cpu` (8 simulated CPU devices, for smoke
    runs) flags. Call it before anything starts a backend: jax may be imported, but the platform and XLA's flags
    apply only to a backend started after them."""
    if xla_autotune is not None:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_gpu_autotune_level={xla_autotune}"
    if cpu:
        jax.config.update("jax_platforms", "cpu")
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"


# ---------------------------------------------------------------------------------------------------------------
# Nsight Compute


def cu_profiler(start: bool) -> None:
    """Start or stop Nsight Compute's capture (`ncu --profile-from-start off`) through the CUDA driver API.

    The driver library is the one the process already runs on; loading a runtime `libcudart` beside jax's own
    CUDA libraries crashed the process on the H200 image (2026-12-01)."""
    lib = ctypes.CDLL("libcuda.so.1")
    rc = lib.cuProfilerStart() if start else lib.cuProfilerStop()
    if rc:
        raise RuntimeError(f"cuProfiler{'Start' if start else 'Stop'} returned CUDA error {rc}")
