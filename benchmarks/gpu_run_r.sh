#!/usr/bin/env bash
# Session 9, call R: Mosaic sparse MLA consumer schedules (plain / stagger / share_p), the fp8_ds_mla producer,
# and a gather-only diagnostic, beside the Triton kernel (issue 17).
set -x
cd "$(dirname "$0")/.."
export PYTHONPATH=.
timeout 400 python3 benchmarks/probe_sparse_mla_mosaic.py --out $OUT/probe.json --baselines triton \
  --variants cp_async,stagger,share_p,diag_gather_only --batches 128,32 > $OUT/probe.log 2>&1
echo rc=$?
grep PROBE $OUT/probe.log | cut -c1-1500
tail -5 $OUT/probe.log | cut -c1-400
