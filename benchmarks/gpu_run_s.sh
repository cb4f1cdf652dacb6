#!/usr/bin/env bash
# Session 9, call S: Mosaic sparse MLA (bf16 + fp8_ds_mla producers, share_p) beside xla and Triton; the reworked
# fused norm/RoPE/cache write at T=65536; the Mosaic GPU oracle tests. Every step under its own timeout.
cd "$(dirname "$0")/.."
export PYTHONPATH=.
P=benchmarks/probe_sparse_mla_mosaic.py
timeout 90 python3 $P --out $OUT/mla_bf16.json --caches bf16 --variants cp_async,diag_gather_only --batches 128,32,1 > $OUT/mla_bf16.log 2>&1; echo "bf16 rc=$?"
timeout 60 python3 $P --out $OUT/mla_fp8.json --caches fp8 --variants cp_async,diag_gather_only --batches 128,32,1 > $OUT/mla_fp8.log 2>&1; echo "fp8 rc=$?"
# share_p: not run in call S (device budget)
grep -h PROBE $OUT/mla_*.log | cut -c1-300
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 python3 benchmarks/bench_fused_norm_rope.py --out $OUT/fused.json --ceilings --iters 6 --budget 35 > $OUT/fused.log 2>&1; echo "fused rc=$?"
tail -30 $OUT/fused.log | cut -c1-200
GLM_DSA_TEST_GPU=1 timeout 60 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_sparse_mla_mosaic.py -k "gpu and plain and (128-64-2048 or 33-16-2000)" > $OUT/tests.log 2>&1; echo "tests rc=$?"
tail -5 $OUT/tests.log | cut -c1-300
cd $OUT && tar czf all.tgz *.json *.log && ls
