#!/usr/bin/env bash
# Session 8, device call K (one H200): FP8 experts kept K-major on the devices (checkpoints.layout.kept_fp8_spec).
# The FP8 MoE GPU tests, the K-major W8A8 kernel against bf16 at the TP = 8 shard (256 x 6144 x 256) and the whole
# TP = 1 stack (256 x 6144 x 2048: uint16-word form), then bf16 vs FP8 weights of the same random bench-preset
# model end to end. Everything lands in $OUT/k.tgz.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/r"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
B="--preset bench --impls triton --decode-batches 1,32,128 --decode-context 32768 --input-len 32768 --batch 8 --output-len 16"
GLM_DSA_TEST_GPU=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_moe.py -k "fp8 or k_major" \
  > "$OUT/r/moe_tests.log" 2>&1; echo "moetests rc=$?" >> "$OUT/r/rc.txt"
timeout 110 python3 benchmarks/bench_fp8_gemm.py --linear '' --moe_dims 6144,256,256 --batches 1,32,128 --no_xla \
  --moe_forms w8a8_nk --moe_budget_s 6 --iters 3 --out "$OUT/r/nk_tp8.json" > "$OUT/r/nk_tp8.log" 2>&1
echo "nk_tp8 rc=$?" >> "$OUT/r/rc.txt"
timeout 200 python3 -m glm_dsa bench $B --quantization fp8 --json-out "$OUT/r/fp8.json" > "$OUT/r/fp8.log" 2>&1
echo "fp8 rc=$?" >> "$OUT/r/rc.txt"
timeout 170 python3 -m glm_dsa bench $B --json-out "$OUT/r/bf16.json" > "$OUT/r/bf16.log" 2>&1
echo "bf16 rc=$?" >> "$OUT/r/rc.txt"
tar czf "$OUT/k.tgz" -C "$OUT" r && rm -rf "$OUT/r"
