#!/usr/bin/env bash
# Session 21's device steps (issue 17, the fp8_ds_mla sparse MLA line): bash benchmarks/gpu_session21.sh STEP...
#   fp8_diag   the bf16 kernel's default (the line's reference, same run), then the fp8 kernel's forms
#              (benchmarks/probe_sparse_mla_mosaic.py: VARIANTS, BATCHES; timing-only forms need no oracle)
#   mla_tests  the Mosaic sparse MLA GPU tests (TESTS_K: a pytest -k expression; default every gpu test)
#   attn       bench_attention.py --ops sparse_mla_mosaic (mosaic default, triton, xla), merged into a copy of
#              results/attention.json
#   ncu_mla    Nsight Compute sections and tensor-pipe metrics of the Mosaic sparse MLA kernel at B = 128, both caches
#              (benchmarks/profile_kernels.py; the indexer's: benchmarks/gpu_session19.sh ncu)
# Every step under its own timeout; logs and JSON under $OUT/r, packed into one tarball.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"  # cd to the repository, OUT, R, the exports, step()

for what in "$@"; do case $what in
fp8_diag)
  step bf16_ref ${T_BF16:-90} python3 benchmarks/probe_sparse_mla_mosaic.py --caches bf16 --batches ${BATCHES:-128,32} \
    --variants slots_gmem --baselines "" --splits default --out "$R/bf16_ref.json"
  grep "PROBE time" "$R/bf16_ref.log" | cut -c1-170
  step fp8_diag ${T_DIAG:-330} python3 benchmarks/probe_sparse_mla_mosaic.py --caches fp8 --batches ${BATCHES:-128,32} \
    --variants ${VARIANTS:-slots_smem,slots_gmem,diag_compute_only,diag_compute_only_r232,diag_no_load,diag_gather_only} \
    --baselines "" --splits default --out "$R/fp8_diag.json"
  grep "PROBE" "$R/fp8_diag.log" | grep -v "PASS" | cut -c1-170
  ;;
mla_tests)
  GLM_DSA_TEST_GPU=1 step mla_tests ${T_TESTS:-300} python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_sparse_mla_mosaic.py -k "${TESTS_K:-gpu}"
  tail -4 "$R/mla_tests.log"
  ;;
attn)  # ATTN_MERGE=0: a file of its own (a run on another card than results/attention.json's)
  [ "${ATTN_MERGE:-1}" = 1 ] && cp benchmarks/results/attention.json "$R/attention.json"
  step attn ${T_ATTN:-260} python3 benchmarks/bench_attention.py --ops sparse_mla_mosaic \
    $([ "${ATTN_MERGE:-1}" = 1 ] && echo --merge) --timeout_s 250 \
    --extra "sparse_mla_mosaic=--variants cp_async --baselines xla,triton --splits default" --out "$R/attention.json"
  grep "PROBE time" "$R/attn.log" | cut -c1-170; tail -3 "$R/attn.log"
  ;;
ncu_mla)  # the indexer's profile is benchmarks/gpu_session19.sh's ncu step
  step ncu_mla ${T_NCU:-300} ncu --clock-control none --kernel-name regex:mosaic --launch-count 2 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy \
    --section WarpStateStats --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.sum \
    python3 benchmarks/profile_kernels.py --ops mla --mla-impls mosaic
  grep -E "anonymous|Duration|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occ|tensor|Warp Cycles Per Issued|Dynamic Shared|Issue Slots Busy" "$R/ncu_mla.log" | head -40
  ;;
*) echo "unknown step $what"; exit 2 ;;
esac; done
tar czf "$OUT/session21_$(echo "$@" | tr ' ' _).tgz" -C "$OUT" r && rm -rf "$R"
