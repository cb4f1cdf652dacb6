#!/usr/bin/env bash
# One device call on a two-GPU machine (nvidia-h200-x2): first the DCP = 2 GPU test on both GPUs, then two
# chains side by side, each on one GPU:
#   GPU 0: the gpu-marked tests (kernels, engine), the sparse MLA and indexer tables (bench_sparse_mla.py,
#          bench_indexer.py), decode at B = 1 and 128 (Triton and xla, no stage breakdown);
#   GPU 1: the end-to-end bench at the seeds' shape (8 x 32K in, 128 out) with decode at B = 32 and its
#          stage breakdown, Triton then xla.
# Logs and JSON go to $LOGS (default /tmp/gpu_pair), packed into $OUT/logs.tgz at the end (the device tool
# returns only a few files from $OUT). Limits (s): DCP_S, TEST_S, E2E_S, XLA_S, DEC_S.
set -uo pipefail
FINAL=${OUT:-gpu_out}; OUT=${LOGS:-/tmp/gpu_pair}; mkdir -p "$OUT" "$FINAL"
export PYTHONPATH=. GLM_DSA_TEST_GPU=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
step() { local name=$1 limit=$2; shift 2; echo "== $name ($(date +%T))"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1;
         echo "rc $? ($(date +%T))" >> "$OUT/$name.log"; tail -${TAIL:-8} "$OUT/$name.log"; }
BENCH="python3 -m glm_dsa bench --preset bench --decode-context 32768"
# GEMM autotuning off for the float32 DCP test: it only shortens the compiles (their minutes were the float32
# indexer tiles, fixed in 6612a8f; 95 s for the module since)
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" XLA_PYTHON_CLIENT_PREALLOCATE=false step dcp_tests ${DCP_S:-300} python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/glm_dsa/test_gpu_dcp.py
(
  export CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
  step gpu_tests ${TEST_S:-400} python3 -m pytest -m gpu -q -n 4 -p no:cacheprovider tests/kernels tests/glm_dsa
  step mla 90 python3 benchmarks/bench_sparse_mla.py --batches 128,32,8,1 --formats bf16,fp8 --reps 6 --iters 3 \
    --out "$OUT/mla.json"
  step idx 70 python3 benchmarks/bench_indexer.py --batches 1,8,32,128 --formats fp8,bf16 --reps 6 --iters 3 \
    --out "$OUT/idx.json"
  XLA_PYTHON_CLIENT_PREALLOCATE=true step decode_1_128 ${DEC_S:-150} $BENCH --impls triton,xla --no-end-to-end \
    --no-stages --decode-batches 1,128 --json-out "$OUT/decode_1_128.json"
) > "$OUT/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1 XLA_PYTHON_CLIENT_PREALLOCATE=true
  step e2e_triton ${E2E_S:-240} $BENCH --impls triton --input-len 32768 --output-len 128 --batch 8 \
    --decode-batches 32 --json-out "$OUT/e2e_triton.json"
  step e2e_xla ${XLA_S:-200} $BENCH --impls xla --input-len 32768 --output-len 128 --batch 8 \
    --decode-batches 32 --json-out "$OUT/e2e_xla.json"
) > "$OUT/gpu1.txt" 2>&1 &
wait
tar czf "$FINAL/logs.tgz" -C "$OUT" .
cat "$OUT/gpu0.txt" "$OUT/gpu1.txt"
