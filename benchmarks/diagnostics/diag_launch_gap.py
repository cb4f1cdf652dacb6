"""Where the device idles between the custom calls of one executable (BENCHMARKS.md, end to end).

Wall time per op stood well above GPU kernel time for every custom-call op (Triton and Mosaic sparse MLA at any
B), much less so for the xla op. This diagnostic times chains of ops in one executable (op i on its own
inputs, as the benches do) by wall clock and by kernel time, with XLA's command buffers (CUDA graphs) as the
process has them (XLA_FLAGS) and, per executable, switched off through `compiler_options`, and keeps one profiler
trace of each long chain (the host's thunk launches beside the GPU's kernels) under --trace_dir:

    PYTHONPATH=. python3 benchmarks/diagnostics/diag_launch_gap.py --trace_dir $OUT/traces --out $OUT/gap.json

Cases: sparse MLA bf16 (B = 1 and 128; impls mosaic, triton, xla), a tiny Pallas Triton kernel and a tiny XLA
fusion (1 MiB each: launch cost, no work). (A one-program Mosaic GPU kernel with 32 or 128 KiB of shared memory
was tried as a case too; it failed to lower on the GPU, an AssertionError, and was dropped.) Rows: {"case",
"cmdbuf", "us", "kernel_us", "device_us", "gap_us", "t_hi_us", "t_lo_us", "trace"} (device_us: the device's span
per op, first kernel to last, `harness.span_seconds`).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from benchmarks import bench_sparse_mla as bsm
from benchmarks.harness import command_line, micros, per_op_traced_times, per_rep, record, stream_events, write_json

NO_CMDBUF = {"xla_gpu_enable_command_buffer": ""}


def compiled(fn, args, options):
    """`fn` jitted, lowered on `args` and compiled with XLA `options` (None: the process's flags)."""
    return jax.jit(fn).lower(*args).compile(compiler_options=options)


def tiny_triton(x):
    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0
    return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(x.shape[0] // 64,),
                          in_specs=[pl.BlockSpec((64, x.shape[1]), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((64, x.shape[1]), lambda i: (i, 0)),
                          compiler_params=pltriton.CompilerParams(num_warps=4))(x)


def tiny_xla(x):
    return x + 1.0


def chain(op, reps):
    """An executable body running `op` on each of `reps` inputs (a tuple), returning every output."""
    return lambda *xs: [op(xs[i]) for i in range(reps)]


def mla_chain(impl, reps):
    def op(q, cache, idx):
        return bsm.sparse_mla.sparse_mla(q, cache, idx, scale=bsm.SCALE, kv_lora_rank=bsm.R, impl=impl)
    return lambda cache, q, idx: [op(q[i], cache, idx[i]) for i in range(reps)]


def timeline(path):
    """(kernels, host) of a kept trace: the GPU's stream events (`harness.stream_events`) and the host's events,
    each a list of (start_ns, end_ns, name, line) sorted by start."""
    planes = list(jax.profiler.ProfileData.from_file(path).planes)
    kernels = [(e.start_ns, e.start_ns + e.duration_ns, e.name, "") for e in stream_events(planes) or ()]
    host = [(e.start_ns, e.start_ns + e.duration_ns, e.name, line.name)
            for plane in planes if plane.name.startswith("/host:CPU") for line in plane.lines for e in line.events]
    return sorted(kernels), sorted(host)


def summarise(path, min_gap_us=3.0, top=4):
    """Print the device's idle gaps between the kernels of a kept trace, with the host events that overlap
    each gap the most (the host's work while the device waited)."""
    kernels, host = timeline(path)
    print(f"== {path}: {len(kernels)} device events")
    for (s0, e0, n0, _), (s1, e1, n1, _) in zip(kernels, kernels[1:]):
        gap = (s1 - e0) / 1e3
        if gap < min_gap_us:
            continue
        over = sorted(((min(e, s1) - max(s, e0), n, ln) for s, e, n, ln in host if s < s1 and e > e0),
                      reverse=True)[:top]
        print(f"  gap {gap:8.1f} us after {n0[:40]!r} ({(e0 - s0) / 1e3:.1f} us) before {n1[:40]!r}")
        for o, n, ln in over:
            print(f"      host {o / 1e3:8.1f} us  {n[:70]!r}  [{ln[:30]}]")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--batches", default="1,128")
    p.add_argument("--impls", default="mosaic,triton,xla")
    p.add_argument("--trace_dir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--summarise", nargs="*", default=None, help="print the gaps of kept traces and exit")
    a = p.parse_args(argv)
    if a.summarise is not None:
        for path in a.summarise:
            summarise(path)
        return 0
    if a.trace_dir:
        os.makedirs(a.trace_dir, exist_ok=True)
    flush = bsm.make_flush()
    rows = []

    def measure(name, make, args, use_flush):
        for cmdbuf, options in (("process", None), ("off", NO_CMDBUF)):
            try:
                hi, lo = compiled(make(a.reps), args, options), compiled(make(1), args, options)
                before = flush if use_flush else None
                t_hi = bsm.cold_median(hi, args, a.iters, flush if use_flush else (lambda: None))
                t_lo = bsm.cold_median(lo, args, a.iters, flush if use_flush else (lambda: None))
                us = micros(max(t_hi - t_lo, 1e-9) / (a.reps - 1))
                trace = os.path.join(a.trace_dir, f"{name}_{cmdbuf}.xplane.pb") if a.trace_dir else None
                tt = per_op_traced_times({1: lo, a.reps: hi}.get, args, a.reps, before=before, runs=3, keep=trace)
                k, span = micros(tt.kernel), micros(tt.span)
                row = {"case": name, "cmdbuf": cmdbuf, "us": us, "kernel_us": k, "device_us": span, "gap_us": us - k,
                       "t_hi_us": micros(t_hi), "t_lo_us": micros(t_lo), "trace": trace}
            except Exception as e:  # noqa: BLE001 - one failing case leaves the others' rows
                row = {"case": name, "cmdbuf": cmdbuf, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            rows.append(row)
            print("GAP", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)

    x = per_rep(jnp.zeros((a.reps, 4096, 64), jnp.float32))
    for name, op in (("tiny_xla", tiny_xla), ("tiny_triton", tiny_triton)):
        measure(name, lambda n, op=op: chain(op, n), x, use_flush=False)
    for b in (int(s) for s in a.batches.split(",") if s):
        data = bsm.make_case(b, False, a.reps)
        for impl in a.impls.split(","):
            measure(f"mla_bf16_B{b}_{impl}", lambda n, impl=impl: mla_chain(impl, n), data, use_flush=True)
        del data
    if a.out:
        write_json(a.out, record(rows, command=command_line(argv), xla_flags=os.environ.get("XLA_FLAGS", "")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
