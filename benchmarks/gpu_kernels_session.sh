#!/usr/bin/env bash
# One device call: the gpu-marked tests, the kernel benchmarks (MoE grouped GEMMs, indexer prefill, sparse MLA
# and indexer decode tables), the engine's decode step (Triton and xla) and an Nsight Compute profile of each
# kernel. STEPS picks and orders them (default: all). Writes logs and JSON under $OUT (or ./gpu_out).
#   STEPS="tests decode moe ncu" bash benchmarks/gpu_kernels_session.sh
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=. GLM_DSA_TEST_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
B=benchmarks
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
step() { local name=$1 limit=$2; shift 2; echo "== $name ($(date +%T))"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1;
         echo "rc $?" >> "$OUT/$name.log"; tail -${TAIL:-6} "$OUT/$name.log"; }
for s in ${STEPS:-tests moe idx_prefill mla idx decode ncu}; do case $s in
  tests) step gpu_tests ${TEST_S:-200} python3 -m pytest -m gpu -q -n 4 -p no:cacheprovider ${TESTS:-tests/kernels tests/glm_dsa};;
  moe) step moe ${MOE_S:-110} python3 $B/bench_moe.py --batches ${MOE_B:-1,8,32,128,8192} --sweep ${MOE_SWEEP:-1} \
         --budget_s 12 --iters 5 --xla_modes tiles,dense --out "$OUT/moe.json";;
  idx_prefill) step idx_prefill ${IDXP_S:-70} python3 $B/bench_indexer_prefill.py --rows ${IDXP_ROWS:-1024,8192} \
         --iters 3 --out "$OUT/idx_prefill.json";;
  mla) step mla 90 python3 $B/bench_sparse_mla.py --batches 128,32,8,1 --formats bf16,fp8 --reps 6 --iters 3 \
         --out "$OUT/mla.json";;
  idx) step idx 70 python3 $B/bench_indexer.py --batches 1,8,32,128 --formats fp8,bf16 --reps 6 --iters 3 \
         --out "$OUT/idx.json";;
  decode) XLA_PYTHON_CLIENT_PREALLOCATE=true step decode ${DECODE_S:-200} python3 -m glm_dsa bench --preset bench \
         --impls triton,xla --no-end-to-end --decode-batches ${DECODE_B:-32} --decode-context 32768 \
         --json-out "$OUT/decode.json";;
  ncu) step ncu ${NCU_S:-90} ncu --clock-control none --kernel-name regex:'sparse_mla|indexer|moe' \
         --launch-count ${NCU_N:-8} --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
         --section WarpStateStats --section LaunchStats python3 $B/profile_kernels.py;;
esac; done
