#!/usr/bin/env bash
# Session 6, device call B (nvidia-h200-x2): bf16 vs FP8 weights of the same random bench-preset model (GPU 0 / GPU 1,
# same flags), the FP8 MoE diagnostic and GLM-5.2 widths in FP8 (GPU 0), the serving loop's host time after the
# static sampler / indexer choices and the FP8 GPU tests (GPU 1). Everything lands in $OUT/b.tgz.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/r"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
B="--preset bench --impls triton --decode-batches 1,32,128 --decode-context 32768 --input-len 32768 --batch 8 --output-len 16"
(export CUDA_VISIBLE_DEVICES=0
 timeout 60 python3 scripts/diag_moe_fp8.py > "$OUT/r/diag.log" 2>&1; echo "diag rc=$?" >> "$OUT/r/rc.txt"
 timeout 220 python3 -m glm_dsa bench $B --json-out "$OUT/r/bf16.json" > "$OUT/r/bf16.log" 2>&1
 echo "bf16 rc=$?" >> "$OUT/r/rc.txt"
 timeout 220 python3 -m glm_dsa bench --preset glm52 --num-layers 8 --quantization fp8 --impls triton --no-end-to-end \
   --decode-batches 1,32,128 --decode-context 32768 --json-out "$OUT/r/glm52fp8.json" > "$OUT/r/glm52fp8.log" 2>&1
 echo "glm52fp8 rc=$?" >> "$OUT/r/rc.txt") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 220 python3 -m glm_dsa bench $B --quantization fp8 --json-out "$OUT/r/fp8.json" > "$OUT/r/fp8.log" 2>&1
 echo "fp8 rc=$?" >> "$OUT/r/rc.txt"
 timeout 200 python3 benchmarks/bench_serving.py --preset bench --num-requests 32 --input-len 2048 --output-len 128 \
   --max-num-seqs 32 --modes continuous --host-overhead-batches 1,32,128 --xla-autotune 0 \
   --out "$OUT/r/serving.json" > "$OUT/r/serving.log" 2>&1; echo "serving rc=$?" >> "$OUT/r/rc.txt"
 GLM_DSA_TEST_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fp8_linear.py \
   tests/kernels/test_moe.py -k "fp8 or glm52" > "$OUT/r/fp8_tests.log" 2>&1; echo "fp8tests rc=$?" >> "$OUT/r/rc.txt") &
wait
tar czf "$OUT/b.tgz" -C "$OUT" r && rm -rf "$OUT/r"
