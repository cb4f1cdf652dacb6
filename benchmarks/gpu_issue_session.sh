#!/usr/bin/env bash
# One nvidia-h200-x2 call for issues 18-20 (2026-11-30): the V3.2 shard's decode step through the kernels (GPU 0)
# beside the serving benchmark (GPU 1), then DCP = 1 vs 2 serving on both GPUs, then 2 processes x 1 GPU against
# 1 process x 2 GPUs. Everything lands in $OUT/issues.tgz (logs and JSON).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/r"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
git rev-parse --short HEAD > "$OUT/r/commit.txt" 2>/dev/null
(CUDA_VISIBLE_DEVICES=0 timeout ${V32_S:-230} python3 -m glm_dsa bench --preset deepseek_v32_tp2_shard --num-layers 4 \
   --impls triton,xla --no-end-to-end --decode-batches 1,32,128 --decode-context 32768 --input-len 8192 --batch 4 \
   --json-out "$OUT/r/v32.json" > "$OUT/r/v32.log" 2>&1; echo "v32 rc=$?" >> "$OUT/r/rc.txt") &
(CUDA_VISIBLE_DEVICES=1 timeout ${SERVE_S:-230} python3 benchmarks/bench_serving.py --preset bench --num-requests 32 \
   --input-len 2048 --output-len 128 --max-num-seqs 32 --host-overhead-batches 1,32,128 --xla-autotune 0 \
   --out "$OUT/r/serving.json" > "$OUT/r/serving.log" 2>&1; echo "serving rc=$?" >> "$OUT/r/rc.txt") &
wait
for d in 1 2; do
  timeout ${DCP_S:-110} python3 benchmarks/bench_serving.py --preset bench --tp 2 --dcp $d --num-requests 32 \
    --input-len 16384 --output-len 64 --max-num-seqs 32 --num-pages 1100 --modes continuous --xla-autotune 0 \
    --out "$OUT/r/dcp$d.json" > "$OUT/r/dcp$d.log" 2>&1; echo "dcp$d rc=$?" >> "$OUT/r/rc.txt"
done
timeout ${MH_S:-90} python3 benchmarks/bench_multihost.py --preset heads --tp 2 --batch 8 --input-len 1024 \
  --output-len 32 --out "$OUT/r/multihost.json" > "$OUT/r/multihost.log" 2>&1; echo "multihost rc=$?" >> "$OUT/r/rc.txt"
tar czf "$OUT/issues.tgz" -C "$OUT" r && rm -rf "$OUT/r"
