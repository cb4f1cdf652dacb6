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

PAIR_KEYS = ("op", "stage", "cache", "B", "T", "impl")
SOURCE_KEYS = ("date", "commit", "device", "jax", "command")


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


def compare(befores: list[dict], after: dict, commit_before: str | None = None,
            commit_after: str | None = None) -> dict:
    """The comparison record of `befores` (records of the runs before, their rows taken together) and `after`."""
    if not befores:
        raise ValueError("compare: no run before the change given")
    sources = []
    before_rows = []
    for i, rec in enumerate(befores):
        src = {k: rec.get(k) for k in SOURCE_KEYS}
        if commit_before:
            src["commit"] = commit_before
        sources.append(src)
        before_rows += [dict(r, source=i) for r in rec["rows"]]
    src = {k: after.get(k) for k in SOURCE_KEYS}
    if commit_after:
        src["commit"] = commit_after
    sources.append(src)
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
    return {**{k: after.get(k) for k in SOURCE_KEYS}, **({"commit": commit_after} if commit_after else {}),
            "command": "python -m benchmarks compare", "rows": rows, "sources": sources}


def main(argv=None) -> int:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks compare", description=__doc__.split("\n")[0])
    ap.add_argument("before", nargs="+", help="results file(s) of the run(s) before the change")
    ap.add_argument("--after", required=True, help="results file of the run after it")
    ap.add_argument("--out", required=True, help="write the comparison record here")
    ap.add_argument("--commit-before", default=None)
    ap.add_argument("--commit-after", default=None)
    args = ap.parse_args(argv)

    def load(path):
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"compare: cannot read {path}: {e}") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("rows"), list):
            raise SystemExit(f"compare: {path} is not a results file (no 'rows' list)")
        return rec
    try:
        out = compare([load(p) for p in args.before], load(args.after), args.commit_before, args.commit_after)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    out["command"] = "python -m benchmarks compare " + " ".join(argv if argv is not None else sys.argv[1:])
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    for r in out["rows"]:
        if r["check"] == "compare":
            print(f"{r['op']}: {r['pairs']} rows, after / before median {r['median_ratio']:.3f} "
                  f"({r['min_ratio']:.3f} .. {r['max_ratio']:.3f}); largest change {r['largest_change']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
