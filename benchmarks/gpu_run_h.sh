#!/usr/bin/env bash
# Session 7, device call H (one H200): the FP8 MoE GPU tests (W8A8 form and the per-shape dispatch), then bf16 vs
# FP8 weights of the same random bench-preset model end to end. Everything lands in $OUT/h.tgz.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/r"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
B="--preset bench --impls triton --decode-batches 1,32,128 --decode-context 32768 --input-len 32768 --batch 8 --output-len 16"
GLM_DSA_TEST_GPU=1 timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_moe.py -k fp8 \
  > "$OUT/r/moe_tests.log" 2>&1; echo "moetests rc=$?" >> "$OUT/r/rc.txt"
timeout 200 python3 -m glm_dsa bench $B --quantization fp8 --json-out "$OUT/r/fp8.json" > "$OUT/r/fp8.log" 2>&1
echo "fp8 rc=$?" >> "$OUT/r/rc.txt"
timeout 170 python3 -m glm_dsa bench $B --json-out "$OUT/r/bf16.json" > "$OUT/r/bf16.log" 2>&1
echo "bf16 rc=$?" >> "$OUT/r/rc.txt"
tar czf "$OUT/h.tgz" -C "$OUT" r && rm -rf "$OUT/r"
