"""Where the indexer's decode time goes on the GPU, by device time (B = 32 first).

For each cache format and B (the shapes of `benchmarks/bench_indexer.py`: 32 indexer heads of 128, 32K context,
top-k 2048), from `jax.profiler` traces (`benchmarks.harness.per_op_traced_times`: the device span and kernel time
of one op as a difference of two executables):

1. the whole op (`indexer.indexer_topk`, impl "triton") and, from one kept trace of it, the device time of each
   kernel by name, per op (what part the query quantisation, the scores kernel, the select kernel and the sort
   after it take);
2. the scores kernel alone under each launch config of `--scores` (JSON list of `indexer_scores_triton` options;
   `{}` is the shape default);
3. the top-k alone on the kernel's scores under each variant of `--topk` (JSON list of `select_topk` options, with
   "impl": "xla" for `lax.top_k`).

One row per measurement: {"part": "op" | "kernel" | "scores" | "topk", "cache", "B", "config", "device_us",
"kernel_us"} ("kernel" rows: "name", "us"); no assertion, figures only.

    PYTHONPATH=. python3 benchmarks/diagnostics/diag_indexer_parts.py --batches 32 --out $OUT/indexer_parts.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

from benchmarks import bench_indexer
from benchmarks.harness import command_line, per_op_traced_times, record, stream_events, trace_micros, write_json
from kernels.indexer import topk_triton

DEFAULT_SCORES = '[{}, {"num_stages": 3}, {"num_stages": 4}, {"num_warps": 8}, {"num_warps": 8, "num_stages": 3}, ' \
                 '{"block_s": 64, "num_stages": 3}, {"block_s": 256, "num_warps": 8, "num_stages": 2}, {"block_n": 2048}, ' \
                 '{"block_n": 512}]'
DEFAULT_TOPK = '[{"impl": "xla"}, {}, {"sort": "none"}, {"chunks": 4}, {"chunks": 4, "sort": "none"}, ' \
               '{"chunks": 2}, {"chunks": 8}, {"chunks": 4, "num_warps": 16}, {"chunks": 4, "num_warps": 8}]'


def kernel_breakdown(trace_path: str, ops: int) -> dict[str, float]:
    """Microseconds per op of each kernel name in a kept trace that ran the op `ops` times in all (runs x ops per
    executable), largest first; the run marker's kernel shows up as a tiny entry of its own."""
    profile = jax.profiler.ProfileData.from_file(trace_path)
    totals: dict[str, float] = collections.defaultdict(float)
    for e in stream_events(list(profile.planes)) or ():
        totals[e.name] += e.duration_ns * 1e-3 / ops
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main(argv=None):
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="32")
    ap.add_argument("--formats", default="fp8")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3, help="traced runs of each executable")
    ap.add_argument("--scores", default=DEFAULT_SCORES)
    ap.add_argument("--topk", default=DEFAULT_TOPK)
    ap.add_argument("--op", default="[{}]", help="JSON list of whole-op kernel options (`indexer_topk`; a "
                    "\"topk_config\" entry is a dict of `TopkConfig` fields)")
    ap.add_argument("--row-pad", type=int, default=0,
                    help="an experiment: FP8 cache rows padded with this many zero bytes (132 + pad bytes a row)")
    ap.add_argument("--out", default="indexer_parts.json")
    args = ap.parse_args(argv)
    rows = []

    def emit(part, fmt, b, cfg, times, **extra):
        row = dict(part=part, cache=fmt, B=b, config=cfg, row_pad=args.row_pad, **trace_micros(times), **extra)
        rows.append(row)
        print(f"PARTS {part:6s} {fmt:4s} B={b:4d} device {row['device_us']:8.1f} us  kernels {row['kernel_us']:8.1f}"
              f"  {json.dumps(cfg)}", flush=True)

    def save():
        write_json(args.out, record(rows, command=command_line(argv, script=__file__)))

    def measure(part, fmt, b, cfg, make, data, keep=None):
        try:
            return per_op_traced_times(make, data, args.reps, runs=args.runs, keep=keep)
        except Exception as e:  # noqa: BLE001 - a config that fails to lower is reported, the rest still run
            rows.append(dict(part=part, cache=fmt, B=b, config=cfg, error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(f"PARTS {part:6s} {fmt:4s} B={b:4d} FAILED {json.dumps(cfg)}: {str(e)[:200]}", flush=True)
            return None

    for fmt in args.formats.split(","):
        fp8 = fmt == "fp8"
        for b in [int(x) for x in args.batches.split(",")]:
            data = bench_indexer.make_case(b, fp8, args.reps)
            if fp8 and args.row_pad:
                data = (jnp.pad(data[0], ((0, 0), (0, args.row_pad))), *data[1:])
            for cfg in json.loads(args.op):
                with tempfile.TemporaryDirectory() as d:
                    path = os.path.join(d, "op.xplane.pb")
                    opts = dict(cfg)
                    if "topk_config" in opts:
                        opts["topk_config"] = topk_triton.TopkConfig(**opts["topk_config"])
                    times = measure("op", fmt, b, cfg, lambda n, opts=opts: bench_indexer.total_runner(
                        n, "triton", opts), data, keep=path)
                    if times is None:
                        continue
                    emit("op", fmt, b, cfg, times)
                    for name, us in kernel_breakdown(path, args.reps * args.runs).items():
                        rows.append(dict(part="kernel", cache=fmt, B=b, config=cfg, name=name, us=us))
                        print(f"PARTS kernel {us:8.1f} us  {name[:110]}", flush=True)
            for cfg in json.loads(args.scores):
                times = measure("scores", fmt, b, cfg, lambda n, cfg=cfg: bench_indexer.scores_runner(n, cfg), data)
                if times is not None:
                    emit("scores", fmt, b, cfg, times)
            save()
            lens = data[-1]
            sc = tuple(bench_indexer.scores_runner(args.reps, {})(*data))
            for cfg in json.loads(args.topk):
                opts = dict(cfg)
                impl = opts.pop("impl", "triton")
                times = measure("topk", fmt, b, cfg, lambda n, impl=impl, opts=opts: bench_indexer.topk_runner(
                    n, impl, opts), (sc, lens))
                if times is not None:
                    emit("topk", fmt, b, cfg, times)
                save()
            del data, sc
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
