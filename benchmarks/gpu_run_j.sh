#!/usr/bin/env bash
# Session 7, device call J (one H200): W8A8 experts over K-major stacks (the release's [out, in]) against the
# [E, K, N] stacks, 128 experts of 6144 x 2048 (plain e4m3 form), decode T = 32 and prefill T = 8192.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/r"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
GLM_DSA_TEST_GPU=1 timeout 50 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe.py -k k_major \
  > "$OUT/r/tests.log" 2>&1; echo "tests rc=$?" >> "$OUT/r/rc.txt"
timeout 150 python3 benchmarks/bench_fp8_gemm.py --linear '' --moe_dims 6144,2048,128 --batches 32,8192 --no_xla \
  --moe_forms w8a8_nk,w8a8 --moe_packed 0 --moe_budget_s 12 --iters 3 --out "$OUT/r/nk.json" > "$OUT/r/nk.log" 2>&1
echo "nk rc=$?" >> "$OUT/r/rc.txt"
tar czf "$OUT/j.tgz" -C "$OUT" r && rm -rf "$OUT/r"
