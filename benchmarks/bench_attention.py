"""The attention kernels' GPU benchmark (issue 17): sparse MLA, the indexer and the fused norm/RoPE/cache write,
each timed beside its xla reference in the same run, merged into one `benchmarks/results/attention.json`
(schema: DESIGN.md, Benchmarks).

Runs the op benchmarks (sparse MLA's xla and Triton impls, the Mosaic sparse MLA probe, the indexer, the fused
norm/RoPE/cache write) as subprocesses (one process each: their compile caches and device memory do not add up)
with the arguments in OPS, then writes {"date", "commit", "device", "command", "commands" (op -> its command),
"failed", "rows"}; each row names the op benchmark it came from ("source"). Usage (on the GPU, from the repo
root; the four ops take about 8 minutes, so a device call of 10 minutes runs them in two halves, `--merge`
keeping the first half's rows):
    PYTHONPATH=. python3 benchmarks/bench_attention.py --ops sparse_mla,sparse_mla_mosaic --out attention.json
    PYTHONPATH=. python3 benchmarks/bench_attention.py --ops indexer,fused_norm_rope --merge --out attention.json
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
# op -> (script, its default arguments, the op name of its rows). The benches write rows {"op", "cache", "B" or
# "T", "impl", "us", "xla_us", "tb_s"}; the Mosaic probe writes {"step": "time", "cache", "B", "impl", "us",
# "tb_s"} rows, which `_probe_rows` turns into sparse_mla rows with the xla time of the same run.
OPS = {
    "sparse_mla": ("bench_sparse_mla.py", ["--batches", "1,32,128", "--one_launch", "0", "--budget_s", "60"],
                   "sparse_mla"),
    "sparse_mla_mosaic": ("diagnostics/probe_sparse_mla_mosaic.py",
                          ["--batches", "128,32,1", "--variants", "cp_async,cp_async_xla_merge", "--baselines", "xla"],
                          "sparse_mla"),
    "indexer": ("bench_indexer.py", ["--batches", "32,128,1", "--sweep", "0", "--old", "0"], "indexer"),
    "fused_norm_rope": ("bench_fused_norm_rope.py", ["--budget", "60"], "fused_norm_rope"),
}
KEEP = ("op", "stage", "cache", "B", "T", "impl", "config", "us", "xla_us", "tb_s", "kernel_us", "xla_kernel_us",
        "device_us", "xla_device_us")
PROBE_CACHE = {"bf16": "bf16", "fp8": "fp8_ds_mla"}


def _probe_rows(rows: list[dict]) -> list[dict]:
    """The Mosaic probe's timing rows as sparse_mla rows: cache named as bench_sparse_mla names it, xla_us from the
    probe's own xla row of the same (cache, B); its correctness rows are dropped (a failed variant is not timed)."""
    timed = [r for r in rows if r.get("step") == "time" and "us" in r]
    xla = {(r["cache"], r["B"]): r for r in timed if r["impl"] == "xla"}
    return [dict(op="sparse_mla", cache=PROBE_CACHE.get(r["cache"], r["cache"]), B=r["B"], impl=r["impl"],
                 us=r["us"], xla_us=xla.get((r["cache"], r["B"]), {}).get("us"), tb_s=r.get("tb_s"),
                 kernel_us=r.get("kernel_us"), xla_kernel_us=xla.get((r["cache"], r["B"]), {}).get("kernel_us"),
                 device_us=r.get("device_us"), xla_device_us=xla.get((r["cache"], r["B"]), {}).get("device_us"))
            for r in timed if r["impl"] != "xla"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "attention.json"))
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    ap.add_argument("--timeout_s", type=int, default=240, help="per op benchmark")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows (and failures) of ops not run now from an existing --out "
                         "(several device calls, one file)")
    ap.add_argument("--extra", action="append", default=[],
                    help="op=ARGS: extra arguments for one op's script (e.g. 'sparse_mla=--batches 1,32,128')")
    args = ap.parse_args(argv)
    extra = {}
    for item in args.extra:
        op, _, rest = item.partition("=")
        extra.setdefault(op, []).extend(rest.split())
    ops = args.ops.split(",")
    for op in ops:
        if op not in OPS:
            raise SystemExit(f"bench_attention: unknown op {op!r} (ops: {', '.join(OPS)})")
    rows, failed, kept_failed, commands = [], [], [], {}
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        commands = {k: v for k, v in old.get("commands", {}).items() if k not in ops}
        rows = [r for r in old.get("rows", []) if r.get("source") in commands]
        kept_failed = [op for op in old.get("failed", []) if op in commands]
    for op in ops:
        script, base, row_op = OPS[op]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, f"{op}.json")
            cmd = [sys.executable, os.path.join(HERE, script), *base, *extra.get(op, []), "--out", out]
            commands[op] = harness.command_line(cmd[2:], script=cmd[1])
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
            got_rows = _probe_rows(got.get("rows", [])) if op == "sparse_mla_mosaic" else got.get("rows", [])
            for row in got_rows:
                if "us" in row and row.get("op", row_op) == row_op:
                    rows.append({k: row[k] for k in KEEP if k in row} | {"op": row_op, "source": op})
            print(f"bench_attention: {op}: {len(got.get('rows', []))} rows in {time.time() - t0:.0f} s", flush=True)
    rec = harness.record(rows, command=harness.command_line(script=__file__), commands=commands,
                         failed=kept_failed + failed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    harness.write_json(args.out, rec)
    print(f"bench_attention: {len(rows)} rows -> {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0  # this call's ops; a kept failure was reported by its own call


if __name__ == "__main__":
    sys.exit(main())
