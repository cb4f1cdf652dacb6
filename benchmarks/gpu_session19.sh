#!/usr/bin/env bash
# Session 19's device steps (issue 17, the indexer): bash benchmarks/gpu_session19.sh STEP...
#   probe      the Mosaic indexer scores kernel beside the Triton one (benchmarks/probe_indexer_mosaic.py):
#              exactness against xla, scores alone and scores + top-k per config (BATCHES, VARIANTS)
#   idx_tests  the indexer GPU tests and the engine's (TESTS_K: a pytest -k expression; default every gpu test)
#   attn       bench_attention.py --ops indexer, merged into a copy of results/attention.json
#   e2e_decode the engine's decode steps (bench preset, impl auto, 32K context) at B = 1 / 32 / 128
#   e2e_fp8cache the same with the fp8_ds_mla cache (FP8 indexer keys: the Mosaic indexer's), auto beside all-Triton,
#              at B = 32 / 128
#   ncu        Nsight Compute sections of the Mosaic indexer scores kernel at B = 32 (benchmarks/profile_kernels.py)
# Every step under its own timeout; logs and JSON under $OUT/r, packed into one tarball.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"  # cd to the repository, OUT, R, the exports, step()

for what in "$@"; do case $what in
probe)
  step probe ${T_PROBE:-300} python3 benchmarks/probe_indexer_mosaic.py --batches ${BATCHES:-32,128,1} \
    ${VARIANTS:+--variants "$VARIANTS"} ${PROBE_ARGS:-} --out "$R/probe.json"
  grep "PROBE" "$R/probe.log" | cut -c1-400
  ;;
idx_tests)
  GLM_DSA_TEST_GPU=1 step idx_tests ${T_TESTS:-400} python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_indexer_mosaic.py tests/kernels/test_indexer.py tests/kernels/test_indexer_topk.py \
    tests/glm_dsa/test_gpu_engine.py -k "${TESTS_K:-gpu}"
  grep -E "passed|failed|FAILED|Error" "$R/idx_tests.log" | tail -30
  ;;
attn)
  cp benchmarks/results/attention.json "$R/attention.json"
  step attn ${T_ATTN:-200} python3 benchmarks/bench_attention.py --ops indexer --merge --timeout_s 190 \
    --out "$R/attention.json"
  tail -12 "$R/attn.log" | cut -c1-200
  ;;
e2e_decode)
  step e2e_decode ${T_E2E:-250} python3 -m glm_dsa bench --preset bench --impls auto --decode-batches 1,32,128 \
    --decode-context 32768 --no-end-to-end --json-out "$R/e2e_decode.json"
  tail -25 "$R/e2e_decode.log" | cut -c1-170
  ;;
e2e_fp8cache)
  step e2e_fp8cache ${T_E2E:-330} python3 -m glm_dsa bench --preset bench --impls auto,triton --kv-cache-dtype fp8_ds_mla \
    --decode-batches 32,128 --decode-context 32768 --no-end-to-end --json-out "$R/e2e_fp8cache.json"
  grep "ms/step" "$R/e2e_fp8cache.log" | cut -c1-200
  ;;
ncu)
  step ncu ${T_NCU:-150} ncu --clock-control none --kernel-name regex:mosaic --launch-count 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \
    python3 benchmarks/profile_kernels.py --ops indexer --indexer-impls mosaic
  grep -E "anonymous|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Warp Cycles Per Issued|Block Size|Grid Size|Waves|Dynamic Shared" "$R/ncu.log" | head -40
  ;;
*) echo "unknown step $what"; exit 2 ;;
esac; done
tar czf "$OUT/session19_$(echo "$@" | tr ' ' _).tgz" -C "$OUT" r && rm -rf "$R"
