#!/usr/bin/env bash
# Session 11 device calls on one H200 (BENCHMARKS.md, session 11):
#   attn1   bench_attention.py's MLA half: sparse MLA xla / Triton at B = 1, 32, 128, the Mosaic probe (cp_async,
#           share_p) beside xla (writes $OUT/r/attention.json)
#   attn2   its other half (indexer, fused norm/RoPE/cache write), merged into the same attention.json given as $ATT;
#           ncu kernel lists of sparse MLA at B = 1 and the indexer at B = 32
#   diag    ncu kernel lists (sparse MLA at B = 1, the indexer at B = 32), the indexer top-k at small B, and which
#           fp8 fused norm/RoPE launch crashes the sweep (one process per candidate)
#   merge   after the Pallas Triton merge launch: its GPU tests and sparse MLA's, the fused norm/RoPE GPU tests and
#           fp8 defaults at small T (the 1-row fp8 launches crashed in diag), bench_attention's MLA half again
#   final   GPU tests of the fused norm/RoPE kernel (FP8 1-row blocks now refused) and of the merge, the indexer and
#           fused norm/RoPE half of attention.json merged into $ATT, the engine decode step (bf16, impl auto)
#   e2e     the engine decode step (bench preset, impl auto, 32K context) bf16 and FP8
# Every step under its own timeout; logs and JSON under $OUT/r, packed into one tarball.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"  # cd to the repository, OUT, R, the exports, step()
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,launch__grid_size,launch__registers_per_thread
# ncu_list NAME FROM_START(on|off) ARGS...: off captures between the script's cuProfilerStart / Stop only
ncu_list() { local name=$1 from=$2; shift 2
  step "$name" 150 ncu --clock-control none --profile-from-start "$from" --csv --metrics $M "$@"
  grep -E '^"[0-9]' "$R/$name.log" | awk -F'","' '{print $5" | "$(NF-2)" | "$NF}' | cut -c1-160 | head -60; }

for what in "$@"; do case $what in
attn1)
  step attn1 560 python3 benchmarks/bench_attention.py --ops sparse_mla,sparse_mla_mosaic --timeout_s 270 \
    --out "$R/attention.json"
  grep -E "BEST|PROBE time|PROBE correct|bench_attention" "$R/attn1.log" | cut -c1-200
  ;;
attn2)
  cp "${ATT:?ATT=path of the attn1 attention.json}" "$R/attention.json"
  step attn2 400 python3 benchmarks/bench_attention.py --ops indexer,fused_norm_rope --merge --timeout_s 190 \
    --out "$R/attention.json"
  grep -E "T= *[0-9]+ .*best|check|scores|topk|bench_attention" "$R/attn2.log" | cut -c1-200 | head -30
  ncu_list ncu_mla_b1 off python3 benchmarks/bench_sparse_mla.py --profile 1 --batches 1 --one_launch 0
  ;;
diag)
  ncu_list ncu_mla_b1 off python3 benchmarks/bench_sparse_mla.py --profile 1 --batches 1 --one_launch 0
  step idx_small 150 python3 benchmarks/bench_indexer.py --batches 1,4,8,16 --sweep 0 --old 0 --xla 0 \
    --out "$R/idx_small.json"
  grep -E "^  (scores|topk) " "$R/idx_small.log" | cut -c1-120
  for i in 1 2 3 4 5; do
    step fnr_fp8_$i 60 python3 benchmarks/bench_fused_norm_rope.py --tokens 4096 --caches fp8_ds_mla --configs $i \
      --iters 2 --out "$R/fnr_fp8_$i.json"
    grep -E "T= *4096" "$R/fnr_fp8_$i.log" | head -2 | cut -c1-120
  done
  ncu_list ncu_idx on --kernel-name regex:"indexer|topk|select" --launch-count 8 python3 benchmarks/bench_indexer.py \
    --batches 32 --sweep 0 --old 0 --xla 0 --reps 2 --iters 1 --out "$R/ncu_idx.json"
  ;;
merge)
  export GLM_DSA_TEST_GPU=1
  step gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_lse_merge_triton.py \
    tests/kernels/test_sparse_mla.py tests/kernels/test_sparse_mla_mosaic.py -k \
    "lse_merge or (gpu_glm5 and (1-64-2048 or 32-64-2048 or 33-16-2000) and (cp_async or not producer))"
  tail -3 "$R/gpu_tests.log"
  step fnr_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_norm_rope.py
  tail -4 "$R/fnr_tests.log"
  step fnr_small 90 python3 benchmarks/bench_fused_norm_rope.py --tokens 1,64,4096 --caches fp8_ds_mla \
    --default-only --iters 5 --out "$R/fnr_small.json"
  grep -E "^T=" "$R/fnr_small.log" | cut -c1-140
  unset GLM_DSA_TEST_GPU
  step attn1 330 python3 benchmarks/bench_attention.py --ops sparse_mla,sparse_mla_mosaic --timeout_s 160 \
    --out "$R/attention.json"
  grep -E "BEST|PROBE time|PROBE correct.*FAIL|bench_attention" "$R/attn1.log" | cut -c1-160
  ;;
final)
  export GLM_DSA_TEST_GPU=1
  step gpu_tests 220 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_norm_rope.py \
    tests/kernels/test_lse_merge_triton.py tests/kernels/test_sparse_mla_mosaic.py -k \
    "not sparse_mla_mosaic or (gpu_glm5 and 1-64-2048 and cp_async)"
  tail -4 "$R/gpu_tests.log"
  unset GLM_DSA_TEST_GPU
  cp "${ATT:?ATT=path of the attn1 attention.json}" "$R/attention.json"
  step attn2 230 python3 benchmarks/bench_attention.py --ops indexer,fused_norm_rope --merge --timeout_s 110 \
    --extra "fused_norm_rope=--budget 40" --out "$R/attention.json"
  grep -E "^T=|scores\+topk|bench_attention" "$R/attn2.log" | cut -c1-160 | head -30
  step e2e_bf16 170 python3 -m glm_dsa bench --preset bench --impls auto --decode-batches 1,32,128 \
    --decode-context 32768 --no-end-to-end --json-out "$R/e2e_bf16.json"
  grep "ms/step" "$R/e2e_bf16.log" | cut -c1-200
  ;;
e2e)
  for q in fp8 none; do
    step e2e_$q 200 python3 -m glm_dsa bench --preset bench --impls auto --decode-batches 1,32,128 \
      --decode-context 32768 --no-end-to-end --quantization $q --json-out "$R/e2e_$q.json"
    grep "ms/step" "$R/e2e_$q.log" | cut -c1-200
  done
  ;;
*) echo "unknown step $what"; exit 2 ;;
esac; done
tar czf "$OUT/session11_$(echo "$@" | tr ' ' _).tgz" -C "$OUT" r && rm -rf "$R"
