#!/usr/bin/env bash
# Session 6, device call A (nvidia-h200-x2): GPU 0: the DeepSeek-V3.2 TP=8 shard through the kernels (#20), then the
# FP8 GEMM GPU tests and benchmark (#16); GPU 1: the serving loop's host time split at B = 1/32/128 (#18).
# Everything lands in $OUT/a.tgz.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/r"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
(export CUDA_VISIBLE_DEVICES=0
 timeout 240 python3 -m glm_dsa bench --preset deepseek_v32_tp8_shard --num-layers 4 --impls triton,xla \
   --no-end-to-end --decode-batches 1,32,128 --decode-context 32768 --input-len 8192 --batch 4 \
   --json-out "$OUT/r/v32tp8.json" > "$OUT/r/v32tp8.log" 2>&1; echo "v32tp8 rc=$?" >> "$OUT/r/rc.txt"
 GLM_DSA_TEST_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fp8_linear.py \
   tests/kernels/test_moe.py > "$OUT/r/fp8_tests.log" 2>&1; echo "fp8tests rc=$?" >> "$OUT/r/rc.txt"
 timeout 170 python3 benchmarks/bench_fp8_gemm.py --budget_s 4 --out "$OUT/r/fp8_gemm.json" > "$OUT/r/fp8_gemm.log" 2>&1
 echo "fp8gemm rc=$?" >> "$OUT/r/rc.txt") &
(export CUDA_VISIBLE_DEVICES=1
 timeout 540 python3 benchmarks/bench_serving.py --preset bench --num-requests 32 --input-len 2048 --output-len 128 \
   --max-num-seqs 32 --modes continuous --host-overhead-batches 1,32,128 --xla-autotune 0 \
   --out "$OUT/r/serving.json" > "$OUT/r/serving.log" 2>&1; echo "serving rc=$?" >> "$OUT/r/rc.txt"
 nvidia-smi > "$OUT/r/smi.txt" 2>&1) &
wait
tar czf "$OUT/a.tgz" -C "$OUT" r && rm -rf "$OUT/r"
