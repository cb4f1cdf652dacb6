#!/usr/bin/env bash
# Session 13 device calls on one H200 (BENCHMARKS.md, session 13):
#   gap      benchmarks/diag_launch_gap.py: wall vs kernel time of op chains, command buffers on and off, traces kept
#   e2e      the engine decode step (bench preset, impl auto, 32K context, bf16) as the process has XLA's flags
#   e2e_off  the same with XLA's command buffers off (XLA_FLAGS=--xla_gpu_enable_command_buffer=)
#   small    the Mosaic probe at 1-16 rows beside xla and triton (the auto rule's threshold)
#   tests    the Mosaic sparse MLA GPU tests
#   ncu      Nsight Compute sections of the Mosaic sparse MLA kernel at B = 128, bf16 then fp8_ds_mla
#   attn     bench_attention.py: the Mosaic probe (default variant, xla and triton beside it), the indexer and the
#            fused norm/RoPE, each row with kernel time and device span (writes $OUT/r/attention.json)
# Every step under its own timeout; logs, JSON and traces under $OUT/r, packed into one tarball.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"  # cd to the repository, OUT, R, the exports, step()
E2E="python3 -m glm_dsa bench --preset bench --impls auto --decode-batches ${BATCHES:-1,32,128} --decode-context 32768 --no-end-to-end"

for what in "$@"; do case $what in
gap)
  step gap 260 python3 benchmarks/diag_launch_gap.py --trace_dir "$R/traces" --out "$R/gap.json"
  grep GAP "$R/gap.log" | cut -c1-220
  ;;
e2e)
  step e2e 220 $E2E --json-out "$R/e2e.json"
  grep "ms/step" "$R/e2e.log" | cut -c1-200
  ;;
e2e_off)
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" step e2e_off 220 $E2E --json-out "$R/e2e_off.json"
  grep "ms/step" "$R/e2e_off.log" | cut -c1-200
  ;;
attn)
  step attn 540 python3 benchmarks/bench_attention.py --ops sparse_mla_mosaic,indexer,fused_norm_rope --timeout_s 170 \
    --extra "sparse_mla_mosaic=--variants cp_async --baselines xla,triton --splits default" \
    --extra "fused_norm_rope=--budget 30 --tokens 65536,4096,1" --out "$R/attention.json"
  grep -E "PROBE time|PROBE correct.*FAIL|scores\+topk|T= *65536|BEST|bench_attention" "$R/attn.log" | cut -c1-200 | head -60
  ;;
small)
  step small 200 python3 benchmarks/probe_sparse_mla_mosaic.py --caches bf16,fp8 --batches 1,2,4,8,16 \
    --variants cp_async --baselines xla,triton --splits default --out "$R/probe_small.json"
  grep -E "PROBE (time|correct.*FAIL)" "$R/small.log" | cut -c1-170
  ;;
tests)
  export GLM_DSA_TEST_GPU=1
  step gpu_tests 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sparse_mla_mosaic.py -k "gpu or refus"
  tail -3 "$R/gpu_tests.log"
  unset GLM_DSA_TEST_GPU
  ;;
ncu)
  step ncu 300 ncu --clock-control none --kernel-name regex:mosaic --launch-count 2 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \
    python3 benchmarks/profile_kernels.py --ops mla --mla-impls mosaic
  grep -E "anonymous|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Stall|Shared Memory Config|Dynamic Shared" "$R/ncu.log" | head -60
  ;;
*) echo "unknown step $what"; exit 2 ;;
esac; done
tar czf "$OUT/session13_$(echo "$@" | tr ' ' _).tgz" -C "$OUT" r && rm -rf "$R"
