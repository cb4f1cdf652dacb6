#!/usr/bin/env bash
# Session 6, device call C (nvidia-h200-x2): GPU 0: FP8 GEMMs by device time (model layout, config sweep), then the
# serving step with XLA's autotuning on (run B had it off); GPU 1: the FP8 MoE GPU tests (uint16-word form), then
# bf16 vs FP8 weights of the bench-preset model. Everything lands in $OUT/c.tgz.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/r"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
B="--preset bench --impls triton --decode-batches 1,32,128 --decode-context 32768 --input-len 32768 --batch 8 --output-len 16"
(export CUDA_VISIBLE_DEVICES=0
 timeout 260 python3 benchmarks/bench_fp8_gemm.py --budget_s 3 --batches 1,32,128,8192 \
   --out "$OUT/r/fp8_gemm.json" > "$OUT/r/fp8_gemm.log" 2>&1; echo "fp8gemm rc=$?" >> "$OUT/r/rc.txt"
 timeout 200 python3 benchmarks/bench_serving.py --preset bench --num-requests 32 --input-len 2048 --output-len 64 \
   --max-num-seqs 32 --modes continuous --host-overhead-batches 32 --out "$OUT/r/serving.json" \
   > "$OUT/r/serving.log" 2>&1; echo "serving rc=$?" >> "$OUT/r/rc.txt") &
(export CUDA_VISIBLE_DEVICES=1
 GLM_DSA_TEST_GPU=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_moe.py -k fp8 \
   > "$OUT/r/moe_tests.log" 2>&1; echo "moetests rc=$?" >> "$OUT/r/rc.txt"
 timeout 170 python3 -m glm_dsa bench $B --json-out "$OUT/r/bf16.json" > "$OUT/r/bf16.log" 2>&1
 echo "bf16 rc=$?" >> "$OUT/r/rc.txt"
 timeout 200 python3 -m glm_dsa bench $B --quantization fp8 --json-out "$OUT/r/fp8.json" > "$OUT/r/fp8.log" 2>&1
 echo "fp8 rc=$?" >> "$OUT/r/rc.txt") &
wait
tar czf "$OUT/c.tgz" -C "$OUT" r && rm -rf "$OUT/r"
