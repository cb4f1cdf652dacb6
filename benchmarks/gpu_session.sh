#!/usr/bin/env bash
# One device session: the gpu-marked tests, then the end-to-end benchmark at the seeds' shape (8 x 32K in,
# 128 out; decode at B = 1, 32, 128), Triton then the xla path (two calls of ~300 s each if run apart). Writes logs and JSON under $OUT (or ./gpu_out). Usage: bash benchmarks/gpu_session.sh
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=. GLM_DSA_TEST_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
timeout ${TEST_S:-200} python3 -m pytest -m gpu -q -n 4 -p no:cacheprovider tests/kernels tests/glm_dsa \
  2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
export XLA_PYTHON_CLIENT_PREALLOCATE=true
timeout ${BENCH_S:-300} python3 -m glm_dsa bench --preset bench --impls triton --input-len ${INPUT_LEN:-32768} \
  --output-len ${OUTPUT_LEN:-128} --batch 8 --decode-batches ${DECODE_BATCHES:-1,32,128} --decode-context 32768 \
  --json-out "$OUT/bench_triton.json" 2>&1 | tail -8 | tee "$OUT/bench.log"
timeout ${XLA_S:-300} python3 -m glm_dsa bench --preset bench --impls xla --input-len ${XLA_INPUT_LEN:-32768} \
  --output-len ${OUTPUT_LEN:-128} --batch 8 --decode-batches ${DECODE_BATCHES:-1,32,128} --decode-context 32768 \
  --json-out "$OUT/bench_xla.json" 2>&1 \
  | tail -8 | tee -a "$OUT/bench.log"
