#!/usr/bin/env bash
# Session 6, device call D (nvidia-h200-x2): GPU 0: MTP draft + verify vs plain decode (#21); GPU 1: the serving loop's
# host time after packing the step inputs (#18); then 2 processes x 1 GPU against 1 process x 2 GPUs (#19); then
# DCP = 1 vs 2 serving on both GPUs (#18). Logs land in $OUT as they finish (a cut-off run keeps what it wrote).
set -uo pipefail
OUT=${OUT:-gpu_out}
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null
(CUDA_VISIBLE_DEVICES=0 timeout 215 python3 -m glm_dsa bench --num-speculative-tokens 1,3,5 --preset bench \
   --decode-batches 1,8,32 --decode-context 2048 --input-len 128 --output-len 64 --impls triton \
   --json-out "$OUT/mtp.json" > "$OUT/mtp.log" 2>&1; echo "mtp rc=$?" >> "$OUT/rc.txt") &
(CUDA_VISIBLE_DEVICES=1 timeout 215 python3 benchmarks/bench_serving.py --preset bench --num-requests 32 \
   --input-len 2048 --output-len 64 --max-num-seqs 32 --modes continuous --host-overhead-batches 1,32,128 \
   --out "$OUT/serving.json" > "$OUT/serving.log" 2>&1; echo "serving rc=$?" >> "$OUT/rc.txt") &
wait
timeout 100 python3 benchmarks/bench_multihost.py --preset heads --tp 2 --batch 8 --input-len 1024 --output-len 32 \
  --out "$OUT/multihost.json" > "$OUT/multihost.log" 2>&1; echo "multihost rc=$?" >> "$OUT/rc.txt"
for d in 1 2; do
  timeout 110 python3 benchmarks/bench_serving.py --preset bench --tp 2 --dcp $d --num-requests 16 --input-len 16384 \
    --output-len 32 --max-num-seqs 16 --num-pages 600 --modes continuous \
    --out "$OUT/dcp$d.json" > "$OUT/dcp$d.log" 2>&1; echo "dcp$d rc=$?" >> "$OUT/rc.txt"
done
