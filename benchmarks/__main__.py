"""`python -m benchmarks suite ...` runs the benchmark suite (`benchmarks.suite`); `python -m benchmarks render`
rewrites BENCHMARKS.md's tables from benchmarks/results/*.json (`benchmarks.render`); `python -m benchmarks area
NAME` is one area of the suite in this process (what the suite runs each area as); `python -m benchmarks compare
BEFORE.json ... --after AFTER.json --out FILE` pairs two runs' device-timed rows (`benchmarks.compare`)."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    """The command line: `suite`, `render`, `area` or `compare`."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    from benchmarks import compare, render, suite
    s = sub.add_parser("suite", help="run the benchmark areas, one process and one timeout each")
    suite.add_arguments(s)
    r = sub.add_parser("render", help="rewrite BENCHMARKS.md's tables from benchmarks/results/*.json")
    r.add_argument("--check", action="store_true", help="exit 1 if BENCHMARKS.md is out of date (write nothing)")
    a = sub.add_parser("area", help="run one area in this process (the suite runs each area so)")
    a.add_argument("name", choices=list(suite.AREAS))
    a.add_argument("--smoke", action="store_true")
    a.add_argument("--results", default=suite.RESULTS)
    c = sub.add_parser("compare", help="pair two runs' device-timed rows, after / before")
    compare.add_arguments(c)
    args = ap.parse_args(argv)
    if args.cmd == "suite":
        return suite.run_suite(args)
    if args.cmd == "compare":
        return compare.run(args)
    if args.cmd == "area":
        return suite.run_area(args.name, args.smoke, args.results)
    return render.main(check=args.check)


if __name__ == "__main__":
    sys.exit(main())
