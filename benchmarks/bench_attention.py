"""The attention kernels' GPU benchmark (issue 17): sparse MLA, the indexer and the fused norm/RoPE/cache write,
each timed beside its xla reference in the same run, merged into one `benchmarks/results/attention.json`
(schema: DESIGN.md, Benchmarks).

Runs the three op benchmarks as subprocesses (one process each: their compile caches and device memory do
not add up) with the arguments below, then writes {"date", "commit", "device", "command", "rows"}.
Usage (on the GPU, from the repo root):
    PYTHONPATH=. python3 benchmarks/bench_attention.py --out benchmarks/results/attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OPS = {  # op -> (script, its arguments); each writes rows {"op", "cache", "B" or "T", "impl", "us", "xla_us", "tb_s"}
    "sparse_mla": ("bench_sparse_mla.py", []),
    "indexer": ("bench_indexer.py", []),
    "fused_norm_rope": ("bench_fused_norm_rope.py", []),
}
KEEP = ("op", "cache", "B", "T", "impl", "config", "us", "xla_us", "tb_s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "attention.json"))
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    ap.add_argument("--timeout_s", type=int, default=240, help="per op benchmark")
    ap.add_argument("--extra", action="append", default=[],
                    help="op=ARGS: extra arguments for one op's script (e.g. 'sparse_mla=--batches 1,32,128')")
    args = ap.parse_args(argv)
    extra = {}
    for item in args.extra:
        op, _, rest = item.partition("=")
        extra.setdefault(op, []).extend(rest.split())
    rows, failed = [], []
    for op in args.ops.split(","):
        if op not in OPS:
            raise SystemExit(f"bench_attention: unknown op {op!r} (ops: {', '.join(OPS)})")
        script, base = OPS[op]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, f"{op}.json")
            cmd = [sys.executable, os.path.join(HERE, script), *base, *extra.get(op, []), "--out", out]
            t0 = time.time()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
                sys.stdout.write(proc.stdout[-6000:])
                if proc.returncode != 0 or not os.path.exists(out):
                    failed.append(op)
                    sys.stdout.write(f"bench_attention: {op} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}\n")
                    continue
            except subprocess.TimeoutExpired:
                failed.append(op)
                print(f"bench_attention: {op} ran past {args.timeout_s} s")
                continue
            with open(out) as f:
                got = json.load(f)
            for row in got.get("rows", []):
                if "us" in row and row.get("op", op) == op:
                    rows.append({k: row[k] for k in KEEP if k in row} | {"op": op})
            print(f"bench_attention: {op}: {len(got.get('rows', []))} rows in {time.time() - t0:.0f} s", flush=True)
    rec = harness.record(rows, command=harness.command_line(script=__file__), failed=failed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    harness.write_json(args.out, rec)
    print(f"bench_attention: {len(rows)} rows -> {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
