#!/usr/bin/env bash
# Session 8, device call L (one H200): K-major FP8 experts as uint16 words interleaved back into K order in registers
# (moe_triton._kmajor_words; call K measured the even/odd split form). GPU tests, the kernel against bf16 on the
# whole TP = 1 stack (256 x 6144 x 2048, word form), then the FP8 bench-preset model end to end ($OUT/l.tgz).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/r"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
B="--preset bench --impls triton --decode-batches 1,32,128 --decode-context 32768 --input-len 32768 --batch 8 --output-len 16"
GLM_DSA_TEST_GPU=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_moe.py -k "fp8 or k_major" \
  > "$OUT/r/moe_tests.log" 2>&1; echo "moetests rc=$?" >> "$OUT/r/rc.txt"
timeout 120 python3 benchmarks/bench_fp8_gemm.py --linear '' --moe_dims 6144,2048,256 --batches 1,32,128 --no_xla \
  --moe_forms w8a8_nk --moe_budget_s 8 --iters 3 --out "$OUT/r/nk_tp1.json" > "$OUT/r/nk_tp1.log" 2>&1
echo "nk_tp1 rc=$?" >> "$OUT/r/rc.txt"
timeout 200 python3 -m glm_dsa bench $B --quantization fp8 --json-out "$OUT/r/fp8.json" > "$OUT/r/fp8.log" 2>&1
echo "fp8 rc=$?" >> "$OUT/r/rc.txt"
tar czf "$OUT/l.tgz" -C "$OUT" r && rm -rf "$OUT/r"
