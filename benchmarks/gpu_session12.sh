#!/usr/bin/env bash
# Session 12 device calls on one H200 (BENCHMARKS.md, session 12):
#   probe   GPU tests of the Mosaic sparse MLA kernel (share_p now fits), then the
#           probe's variants beside xla at B = 128, 32, 1 for both caches, with kernel times from a profiler trace
#   attn1   bench_attention.py's MLA half (writes $OUT/r/attention.json)
#   attn2   its other half (indexer, fused norm/RoPE), merged into the attention.json given as $ATT
#   e2e     the engine decode step (bench preset, impl auto, 32K context), bf16
#   final   the sparse MLA GPU tests (Mosaic and Triton) at the final code, then attn1
# Every step under its own timeout; logs and JSON under $OUT/r, packed into one tarball.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"  # cd to the repository, OUT, R, the exports, step()
VARIANTS=${VARIANTS:-cp_async,no_share_p}

for what in "$@"; do case $what in
probe)
  export GLM_DSA_TEST_GPU=1
  step mosaic_tests 170 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sparse_mla_mosaic.py -k \
    "refus or (gpu_glm5 and (128-64-2048 or 1-64-2048) and share_p and cp_async)"
  tail -4 "$R/mosaic_tests.log"
  unset GLM_DSA_TEST_GPU
  step probe 330 python3 benchmarks/probe_sparse_mla_mosaic.py --caches bf16,fp8 --batches 128,32,1 \
    --variants "$VARIANTS" --baselines xla --splits default --out "$R/probe.json"
  grep -E "PROBE (time|correct.*FAIL|kernel)" "$R/probe.log" | cut -c1-170
  ;;
attn1)
  step attn1 560 python3 benchmarks/bench_attention.py --ops sparse_mla,sparse_mla_mosaic --timeout_s 270 \
    --out "$R/attention.json"
  grep -E "BEST|PROBE time|PROBE correct.*FAIL|bench_attention" "$R/attn1.log" | cut -c1-200
  ;;
attn2)
  cp "${ATT:?ATT=path of the attn1 attention.json}" "$R/attention.json"
  step attn2 330 python3 benchmarks/bench_attention.py --ops indexer,fused_norm_rope --merge --timeout_s 160 \
    --extra "fused_norm_rope=--budget 40" --out "$R/attention.json"
  grep -E "^T=|scores\+topk|bench_attention" "$R/attn2.log" | cut -c1-160 | head -30
  ;;
e2e)
  step e2e_bf16 200 python3 -m glm_dsa bench --preset bench --impls auto --decode-batches 1,32,128 \
    --decode-context 32768 --no-end-to-end --json-out "$R/e2e_bf16.json"
  grep "ms/step" "$R/e2e_bf16.log" | cut -c1-200
  ;;
final)
  export GLM_DSA_TEST_GPU=1
  step gpu_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sparse_mla_mosaic.py \
    tests/kernels/test_sparse_mla.py -k "gpu or refus"
  tail -4 "$R/gpu_tests.log"
  unset GLM_DSA_TEST_GPU
  step attn1 370 python3 benchmarks/bench_attention.py --ops sparse_mla,sparse_mla_mosaic --timeout_s 180 \
    --out "$R/attention.json"
  grep -E "BEST|PROBE time|PROBE correct.*FAIL|bench_attention|kernels" "$R/attn1.log" | cut -c1-200 | head -40
  ;;
*) echo "unknown step $what"; exit 2 ;;
esac; done
tar czf "$OUT/session12_$(echo "$@" | tr ' ' _).tgz" -C "$OUT" r && rm -rf "$R"
