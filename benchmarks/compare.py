"""Two runs of one area side by side: the same rows of a results file before and after a change.

    python -m benchmarks compare BEFORE.json [BEFORE2.json ...] --after AFTER.json --out FILE [--commit-before C]
        [--commit-after C]

Rows are paired by what they measure (op, stage, cache, B, T, impl, config; repeated keys in order), and only
where both runs timed the row on the device (`device_us`: the profiler's span, which host noise does not move):
wall-clock rows are left out. The output is a results file (DESIGN.md, Benchmarks) whose `sources` are the runs
(before ones first, the after run last) and whose rows are one summary per op ({"check": "compare", "op", "pairs",
"median_ratio", "min_ratio", "max_ratio", "largest_change", "source": the runs its pairs come from}: ratio = after / before device µs) followed by every
pair ({"check": "compare_pair", ..., "before_device_us", "after_device_us", "ratio"}). BENCHMARKS.md renders the
summaries (`attention_move`). `--commit-before` / `--commit-after` name the commit of each side where a run's own
record cannot (a tree copied to the GPU machine outside its git checkout records the checkout's commit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

from benchmarks.suite import SCHEMA_KEYS

PAIR_KEYS = ("op", "stage", "cache", "B", "T", "impl")
SOURCE_KEYS = tuple(k for k in SCHEMA_KEYS if k != "rows")  # what a source of a results file says


def row_key(r: dict) -> tuple:
    """What a row measures: its op, stage, cache, size, impl and config."""
    return tuple(r.get(k) for k in PAIR_KEYS) + (json.dumps(r.get("config"), sort_keys=True),)


def pair_rows(before: list[dict], after: list[dict]) -> list[tuple[dict, dict]]:
    """(before, after) rows measuring the same thing, both timed on the device; rows of one key pair in order."""
    queue = defaultdict(list)
    for r in before:
        if r.get("device_us"):
            queue[row_key(r)].append(r)
    pairs = []
    for r in after:
        q = queue.get(row_key(r))
        if r.get("device_us") and q:
            pairs.append((q.pop(0), r))
    return pairs


def _source(rec: dict, commit: str | None) -> dict:
    """What a results file says of its run (`SOURCE_KEYS`), its commit replaced by `commit` where given."""
    return {**{k: rec.get(k) for k in SOURCE_KEYS}, **({"commit": commit} if commit else {})}


def compare(befores: list[dict], after: dict, commit_before: str | None = None,
            commit_after: str | None = None) -> dict:
    """The comparison record of `befores` (records of the runs before, their rows taken together) and `after`."""
    if not befores:
        raise ValueError("compare: no run before the change given")
    sources = [_source(rec, commit_before) for rec in befores] + [_source(after, commit_after)]
    before_rows = [dict(r, source=i) for i, rec in enumerate(befores) for r in rec["rows"]]
    pairs = pair_rows(before_rows, after["rows"])
    if not pairs:
        raise ValueError("compare: no row of the run after was timed on the device in a run before")
    by_op = defaultdict(list)
    for b, a in pairs:
        by_op[a["op"]].append({**{k: a.get(k) for k in PAIR_KEYS}, "config": a.get("config"),
                               "before_device_us": b["device_us"], "after_device_us": a["device_us"],
                               "ratio": a["device_us"] / b["device_us"], "before_source": b["source"]})
    rows = []
    for op, ps in by_op.items():
        ratios = [p["ratio"] for p in ps]
        far = max(ps, key=lambda p: abs(p["ratio"] - 1))
        where = ", ".join(f"{k} {far[k]}" for k in ("stage", "cache", "B", "T", "impl") if far.get(k) is not None)
        rows.append({"check": "compare", "op": op, "pairs": len(ps), "median_ratio": statistics.median(ratios),
                     "min_ratio": min(ratios), "max_ratio": max(ratios),
                     "largest_change": f"{where}: {far['before_device_us']:.1f} -> {far['after_device_us']:.1f} µs",
                     "source": sorted({p["before_source"] for p in ps} | {len(befores)})})
    rows += [{"check": "compare_pair", **p, "source": len(befores)} for ps in by_op.values() for p in ps]
    return {**sources[-1], "command": "python -m benchmarks compare", "rows": rows, "sources": sources}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's flags (see the module docstring)."""
    p.add_argument("before", nargs="+", help="results file(s) of the run(s) before the change")
    p.add_argument("--after", required=True, help="results file of the run after it")
    p.add_argument("--out", required=True, help="write the comparison record here")
    p.add_argument("--commit-before", default=None, help="the commit of the runs before (where their records err)")
    p.add_argument("--commit-after", default=None, help="the commit of the run after (where its record errs)")


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"compare: cannot read {path}: {e}") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("rows"), list):
        raise SystemExit(f"compare: {path} is not a results file (no 'rows' list)")
    return rec


def run(args) -> int:
    """Compare the parsed flags' files, write the record to --out and print one line per op."""
    from benchmarks.harness import write_json
    try:
        out = compare([_load(p) for p in args.before], _load(args.after), args.commit_before, args.commit_after)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    commits = "".join(f" --commit-{k} {v}" for k, v in (("before", args.commit_before),
                                                         ("after", args.commit_after)) if v)
    out["command"] = (f"python -m benchmarks compare {' '.join(args.before)} --after {args.after} --out {args.out}"
                      + commits)
    write_json(args.out, out)
    for r in out["rows"]:
        if r["check"] == "compare":
            print(f"{r['op']}: {r['pairs']} rows, after / before median {r['median_ratio']:.3f} "
                  f"({r['min_ratio']:.3f} .. {r['max_ratio']:.3f}); largest change {r['largest_change']}")
    return 0


def main(argv=None) -> int:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks compare", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
