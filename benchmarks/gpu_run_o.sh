#!/usr/bin/env bash
# Session 8, device call O (one H200): call N's GLM-5.2 full-width FP8 run again with valid fp8_ds_mla rows in the
# random caches (call N's random bytes decoded to NaN and a degenerate routing), then the same 8 layers with bf16
# weights beside it ($OUT/o.tgz).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/r"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
G="--preset glm52 --num-layers 8 --kv-cache-dtype fp8_ds_mla --impls triton --no-end-to-end --decode-batches 1,32,128 --decode-context 32768"
timeout 200 python3 -m glm_dsa bench $G --quantization fp8 --json-out "$OUT/r/glm52fp8.json" > "$OUT/r/glm52fp8.log" 2>&1
echo "glm52fp8 rc=$?" >> "$OUT/r/rc.txt"
timeout 180 python3 -m glm_dsa bench $G --json-out "$OUT/r/glm52bf16.json" > "$OUT/r/glm52bf16.log" 2>&1
echo "glm52bf16 rc=$?" >> "$OUT/r/rc.txt"
tar czf "$OUT/o.tgz" -C "$OUT" r && rm -rf "$OUT/r"
