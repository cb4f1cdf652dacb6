"""The Mosaic GPU indexer scores kernel (`kernels.indexer.mosaic`) on the GPU, beside the Triton one: exactness
against the xla scores, then device time of the scores alone and of scores + top-k (the select kernel, entries as a
set: how the model calls the op), per launch config. Shapes of `benchmarks/bench_indexer.py` (32 heads of 128, 32K
context, top-k 2048, FP8 cache, pages of 64).

Exactness, per B: the largest |mosaic - xla| over the largest |xla| of the row (float32 scores; both use e4m3
products, so only the summation order differs), equal -inf masks; also on rows of 0, 1, 63, 64, 65, 1000 and
32767 visible keys. Rows: {"part": "check" | "scores" | "op", "B", "impl", "config", "device_us", "kernel_us",
"tb_s"}; no assertion (the GPU tests assert), figures only.

    PYTHONPATH=. python3 benchmarks/diagnostics/probe_indexer_mosaic.py --batches 1,32,128 \
        --out $OUT/probe_indexer_mosaic.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_indexer
from benchmarks.bench_indexer import CTX, PAGE
from benchmarks.diagnostics.diag_indexer_parts import kernel_breakdown
from benchmarks.harness import command_line, per_op_traced_times, record, trace_micros, write_json
from kernels import indexer

DEFAULT_VARIANTS = ('[{}, {"copy": "rows"}, {"in_flight": 6}, {"stages": 2, "in_flight": 2}, '
                    '{"stages": 2, "in_flight": 4}, {"ctas": 528}, {"ctas": 132}, {"copy": "rows", "ctas": 528}, '
                    '{"copy": "rows", "ctas": 132}]')


def runner(reps, impl, opts, with_topk):
    """`bench_indexer`'s jitted runners: the scores kernel of `impl` alone, or the whole op as the model calls it
    (the entries as a set)."""
    if with_topk:
        return bench_indexer.total_runner(reps, impl, {"ordered": False, **opts})
    return bench_indexer.scores_runner(reps, opts, impl)


def check(data, b, opts):
    cache, bt, q, w, req, lens = data
    res = {}
    for name, n in (("full", lens[0]), ("short", jnp.asarray(([0, 1, 63, 64, 65, 1000, 32767] * b)[:b], jnp.int32))):
        qq, ww = indexer.prepare_queries(q[0], w[0], cache)
        want = np.asarray(jax.jit(lambda *a: indexer.indexer_scores_xla(*a, block_size=PAGE))(
            qq, ww, cache, req[0], n, bt))
        got = np.asarray(runner(1, "mosaic", opts, False)(cache, bt, q, w, req, (n,))[0])[:, :CTX]
        fin = np.isfinite(want)
        scale = np.maximum(np.max(np.where(fin, np.abs(want), 0), axis=1, keepdims=True), 1e-30)
        res[name] = {"mask_equal": bool(np.array_equal(fin, np.isfinite(got)) and np.all(got[~fin] == -np.inf)),
                     "max_rel": float(np.max(np.where(fin, np.abs(got - want), 0) / scale)),
                     "nan": int(np.isnan(got).sum())}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="JSON list of MosaicIndexerConfig overrides")
    ap.add_argument("--no-op", action="store_true", help="scores only, no scores + top-k rows")
    ap.add_argument("--out", default="probe_indexer_mosaic.json")
    args = ap.parse_args(argv)
    rows = []

    def save():
        write_json(args.out, record(rows, command=command_line(argv, script=__file__)))

    for b in [int(x) for x in args.batches.split(",")]:
        data = bench_indexer.make_case(b, True, args.reps)
        gb = bench_indexer.bytes_moved(b, True) / 1e9
        try:
            res = check(data, b, {})
        except Exception as e:  # noqa: BLE001 - reported, the timings still run
            res = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        rows.append(dict(part="check", B=b, **res))
        print(f"PROBE check B={b}: {json.dumps(res)}", flush=True)
        save()
        cases = [("triton", {})] + [("mosaic", v) for v in json.loads(args.variants)]
        for with_topk in ([False] if args.no_op else [False, True]):
            part = "op" if with_topk else "scores"
            for impl, opts in cases:
                keep = tempfile.NamedTemporaryFile(suffix=".xplane.pb", delete=False).name
                try:
                    times = per_op_traced_times(lambda n, impl=impl, opts=opts: runner(n, impl, opts, with_topk),
                                                data, args.reps, runs=args.runs, keep=keep)
                except Exception as e:  # noqa: BLE001 - a config that fails to lower is reported
                    rows.append(dict(part=part, B=b, impl=impl, config=opts, error=f"{type(e).__name__}: {e}"[:2000]))
                    print(f"PROBE {part} B={b} {impl} {json.dumps(opts)} FAILED: {str(e)[:1500]}", flush=True)
                    continue
                row = dict(part=part, B=b, impl=impl, config=opts, **trace_micros(times))
                row["tb_s"] = gb / (row["device_us"] * 1e-6) / 1e3 if row.get("device_us") else None
                rows.append(row)
                print(f"PROBE {part:6s} B={b:4d} {impl:7s} device {row['device_us']:8.1f} us  kernels "
                      f"{row['kernel_us']:8.1f} us  {row['tb_s'] or 0:5.2f} TB/s  {json.dumps(opts)}", flush=True)
                if with_topk and (impl == "triton" or opts == json.loads(args.variants)[0]):
                    for name, us in kernel_breakdown(keep, args.reps * args.runs).items():
                        rows.append(dict(part="kernel", B=b, impl=impl, config=opts, name=name, us=us))
                        print(f"PROBE kernel {us:8.1f} us  {name[:110]}", flush=True)
                os.unlink(keep)
                save()
        del data
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
