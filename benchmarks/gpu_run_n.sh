#!/usr/bin/env bash
# Session 8, device call N (one H200): GLM-5.2 full-width layers with FP8 weights and the fp8_ds_mla cache (B = 128
# at 32K context does not fit beside 8 full layers with a bf16 cache), then the K-major W8A8 experts' up and down
# kernel blocks swept apart at decode (TP = 1 words, TP = 8 shard) ($OUT/n.tgz).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/r"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
timeout 260 python3 -m glm_dsa bench --preset glm52 --num-layers 8 --quantization fp8 --kv-cache-dtype fp8_ds_mla \
  --impls triton --no-end-to-end --decode-batches 1,32,128 --decode-context 32768 --json-out "$OUT/r/glm52fp8c.json" \
  > "$OUT/r/glm52fp8c.log" 2>&1
echo "glm52fp8c rc=$?" >> "$OUT/r/rc.txt"
timeout 60 python3 benchmarks/bench_fp8_gemm.py --linear '' --moe_dims 6144,2048,256 --batches 32 --no_xla \
  --moe_forms w8a8_nk --moe_untied --moe_budget_s 30 --iters 3 --out "$OUT/r/untied_tp1.json" \
  > "$OUT/r/untied_tp1.log" 2>&1
echo "untied_tp1 rc=$?" >> "$OUT/r/rc.txt"
timeout 60 python3 benchmarks/bench_fp8_gemm.py --linear '' --moe_dims 6144,256,256 --batches 32 --no_xla \
  --moe_forms w8a8_nk --moe_untied --moe_budget_s 30 --iters 3 --out "$OUT/r/untied_tp8.json" \
  > "$OUT/r/untied_tp8.log" 2>&1
echo "untied_tp8 rc=$?" >> "$OUT/r/rc.txt"
tar czf "$OUT/n.tgz" -C "$OUT" r && rm -rf "$OUT/r"
