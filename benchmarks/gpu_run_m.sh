#!/usr/bin/env bash
# Session 8, device call M (one H200): launch-config sweeps of the K-major W8A8 experts with every measured config
# recorded (whole TP = 1 stack as words, TP = 8 shard plain), GLM-5.2 full-width layers with FP8 weights
# (8 layers: 3 dense, 5 MoE; full and shared indexer layers), and the FP8 bench-preset model end to end with the
# K-major defaults of this call's commit ($OUT/m.tgz).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/r"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
B="--preset bench --impls triton --decode-batches 1,32,128 --decode-context 32768 --input-len 32768 --batch 8 --output-len 16"
timeout 75 python3 benchmarks/bench_fp8_gemm.py --linear '' --moe_dims 6144,2048,256 --batches 1,32,128 --no_xla \
  --moe_forms w8a8_nk --moe_budget_s 12 --iters 3 --out "$OUT/r/sweep_tp1.json" > "$OUT/r/sweep_tp1.log" 2>&1
echo "sweep_tp1 rc=$?" >> "$OUT/r/rc.txt"
timeout 50 python3 benchmarks/bench_fp8_gemm.py --linear '' --moe_dims 6144,256,256 --batches 32,128 --no_xla \
  --moe_forms w8a8_nk --moe_budget_s 12 --iters 3 --out "$OUT/r/sweep_tp8.json" > "$OUT/r/sweep_tp8.log" 2>&1
echo "sweep_tp8 rc=$?" >> "$OUT/r/rc.txt"
timeout 200 python3 -m glm_dsa bench $B --quantization fp8 --json-out "$OUT/r/fp8.json" > "$OUT/r/fp8.log" 2>&1
echo "fp8 rc=$?" >> "$OUT/r/rc.txt"
timeout 210 python3 -m glm_dsa bench --preset glm52 --num-layers 8 --quantization fp8 --impls triton --no-end-to-end \
  --decode-batches 1,32,128 --decode-context 32768 --json-out "$OUT/r/glm52fp8.json" > "$OUT/r/glm52fp8.log" 2>&1
echo "glm52fp8 rc=$?" >> "$OUT/r/rc.txt"
tar czf "$OUT/m.tgz" -C "$OUT" r && rm -rf "$OUT/r"
