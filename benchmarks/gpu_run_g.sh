#!/usr/bin/env bash
# Session 7, device call G (one H200): is the uint16-word form what holds the FP8 experts back? 128 experts of
# 6144 x 2048 (under 2**31 elements: the plain e4m3 form can run) with the word form forced on and off, decode
# (T = 32) and prefill (T = 8192); then the MTP bench with distinct rows. Everything lands in $OUT/g.tgz.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/r"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
for p in 0 1; do
  timeout 150 python3 benchmarks/bench_fp8_gemm.py --linear '' --moe_dims 6144,2048,128 --batches 32,8192 --no_xla \
    --moe_budget_s 15 --iters 3 --moe_packed $p --out "$OUT/r/moe_p$p.json" > "$OUT/r/moe_p$p.log" 2>&1
  echo "moe p$p rc=$?" >> "$OUT/r/rc.txt"
done
timeout 240 python3 -m glm_dsa bench --num-speculative-tokens 1,3,5 --preset bench --decode-batches 1,8,32 \
  --decode-context 2048 --input-len 128 --output-len 64 --impls triton --json-out "$OUT/r/mtp.json" \
  > "$OUT/r/mtp.log" 2>&1; echo "mtp rc=$?" >> "$OUT/r/rc.txt"
tar czf "$OUT/g.tgz" -C "$OUT" r && rm -rf "$OUT/r"
