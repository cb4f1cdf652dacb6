#!/usr/bin/env bash
# Session 7, device call F (one H200): the FP8 MoE kernel's W8A8 form on the GPU (oracle tests), then a launch
# config sweep of both FP8 forms (W8A16, W8A8) at GLM-5.2 expert widths (256 x 6144 x 2048, uint16-word form)
# against the bf16 kernel. Everything lands in $OUT/f.tgz.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/r"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/r/gpu.txt" 2>&1
GLM_DSA_TEST_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_moe.py -k "fp8" \
  > "$OUT/r/moe_tests.log" 2>&1; echo "moetests rc=$?" >> "$OUT/r/rc.txt"
timeout 330 python3 benchmarks/bench_fp8_gemm.py --linear '' --batches 1,32,128 --no_xla --moe_budget_s 40 \
  --out "$OUT/r/moe_decode.json" > "$OUT/r/moe_decode.log" 2>&1; echo "decode rc=$?" >> "$OUT/r/rc.txt"
timeout 100 python3 benchmarks/bench_fp8_gemm.py --linear '' --batches 8192 --no_xla --moe_budget_s 25 --iters 3 \
  --out "$OUT/r/moe_prefill.json" > "$OUT/r/moe_prefill.log" 2>&1; echo "prefill rc=$?" >> "$OUT/r/rc.txt"
tar czf "$OUT/f.tgz" -C "$OUT" r && rm -rf "$OUT/r"
