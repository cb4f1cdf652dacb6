"""What parts a batch-invariant serving decode step's programs at two row buckets (traced for a GPU on this
machine; nothing runs).

A decode step of batch-invariant mode is padded to the power-of-two bucket of its rows, and a row must come out
bitwise the same at every bucket. This prints, for each two neighbouring buckets of --rows,
`glm_dsa.serving.invariant_audit.differences` of the traced serving steps: rule decisions and launch configs, kernel
bodies (masked against plain loads, block shapes, compiler params), the XLA program around the kernels (its
optimisation barriers), products or reductions across rows at the bucket's rows, and order-dependent reductions of
a row there (an RMSNorm's sum over the hidden width); then, with --row-reductions, every per-row reduction outside
the kernels whose shapes follow the bucket (the exact ones, max and min, are allowed by the check):

    PYTHONPATH=. python3 benchmarks/diagnostics/invariant_xla_audit.py --preset heads --rows 32,64,128,256

--default traces the default mode's steps instead (its products and configs follow the rows: the check's
negative control). Exit status 1 when some pair differs. tests/model/test_invariant_buckets.py runs the same check
on the heads preset at every bucket.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="heads")
    ap.add_argument("--rows", default="8,16,32,64,128,256",
                    help="the decode steps' padded rows, compared two neighbours at a time")
    ap.add_argument("--decode-rows", type=int, default=None, help="the decode kind's most rows (default 256)")
    ap.add_argument("--requests", type=int, default=8, help="block-table rows (the engine's max_num_seqs bucket)")
    ap.add_argument("--context", type=int, default=2048, help="tokens of room per request (the block-table width)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--quantization", default="fp8", choices=["fp8", "none"])
    ap.add_argument("--kv-cache-dtype", default="fp8_ds_mla")
    ap.add_argument("--all-layers", action="store_true", help="every layer (default: one of each kind)")
    ap.add_argument("--default", action="store_true", help="the default mode's decode steps (negative control)")
    ap.add_argument("--row-reductions", action="store_true",
                    help="also list the per-row reductions outside the kernels whose shapes follow the bucket")
    args = ap.parse_args(argv)
    rows = [int(x) for x in args.rows.split(",") if x]
    if len(rows) < 2 or min(rows) < 1:
        ap.error(f"--rows: two or more row counts >= 1, got {args.rows!r}")

    from glm_dsa import configs
    from glm_dsa.serving import invariant_audit

    cfg = configs.get(args.preset)
    programs = {t: invariant_audit.trace_decode_step(
        cfg, t, requests=args.requests, context=args.context, block_size=args.block_size,
        decode_rows=args.decode_rows, quantization=None if args.quantization == "none" else args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, batch_invariant=not args.default, trim=not args.all_layers)
        for t in rows}
    first = programs[rows[0]]
    print(f"{args.preset}, {'default' if args.default else 'batch-invariant'} mode: {len(first.parts[1])} kernel "
          f"calls, {invariant_audit.barriers(first)} optimisation barriers at {rows[0]} rows")
    differ = False
    for a, b in zip(rows, rows[1:]):
        lines = invariant_audit.differences(programs[a], programs[b])
        differ |= bool(lines)
        print(f"{a} -> {b}: {'one program' if not lines else f'{len(lines)} differences'}")
        for line in lines:
            print(f"  {line}")
        if args.row_reductions:
            for line in invariant_audit.row_reductions(programs[a], programs[b]):
                print(f"  per-row: {line}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
