#!/usr/bin/env bash
# Session 7, device call I (one H200): FP8 weights of the bench-preset model end to end again, after the prefill
# dequantisation was tied to its layer (call H ran out of memory: XLA dequantised every layer's experts at once).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/r"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
B="--preset bench --impls triton --decode-batches 1,32,128 --decode-context 32768 --input-len 32768 --batch 8 --output-len 16"
timeout 250 python3 -m glm_dsa bench $B --quantization fp8 --json-out "$OUT/r/fp8.json" > "$OUT/r/fp8.log" 2>&1
echo "fp8 rc=$?" >> "$OUT/r/rc.txt"
tar czf "$OUT/i.tgz" -C "$OUT" r && rm -rf "$OUT/r"
