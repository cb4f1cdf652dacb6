#!/usr/bin/env bash
# Session 14 device calls on one H200 (BENCHMARKS.md, session 14):
#   parts     benchmarks/diag_indexer_parts.py at B = 32, FP8 cache: the op's kernels by device time, scores launch
#             configs and top-k variants by device span
#   parts_bf16  the same op on a bf16 cache (default configs): the FP8 rows' 132-byte stride against 256-byte rows
#   topk      the whole op with the chunked select (TopkConfig(chunks=4)) beside the default, and top-k variants
#   pad       the scores kernel on FP8 rows padded to 144 bytes (an experiment: 16-byte aligned rows)
#   verify    B = 32 / 128 / 1: the op's kernels at the defaults, the top-k in one and in two passes beside
#             lax.top_k
#   tests     the indexer and top-k GPU tests
#   ncu_idx   Nsight Compute sections of the indexer's scores and select kernels at B = 32 (FP8 cache)
# Every step under its own timeout; logs and JSON under $OUT/r, packed into one tarball.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"  # cd to the repository, OUT, R, the exports, step()

for what in "$@"; do case $what in
parts)
  step parts 300 python3 benchmarks/diag_indexer_parts.py --batches 32 --formats fp8 ${PARTS_ARGS:-} \
    --out "$R/parts.json"
  grep PARTS "$R/parts.log" | cut -c1-200
  ;;
parts_bf16)
  step parts_bf16 100 python3 benchmarks/diag_indexer_parts.py --batches 32 --formats bf16 --scores '[{}]' \
    --topk '[]' --out "$R/parts_bf16.json"
  grep PARTS "$R/parts_bf16.log" | cut -c1-200
  ;;
topk)
  list='[{"chunks": 4}, {"chunks": 4, "sort": "none"}, {"chunks": 2}, {"chunks": 8}, {"chunks": 4, "num_warps": 16}, {"chunks": 4, "num_warps": 8}, {"chunks": 4, "sort": "kernel"}]'
  step topk 330 python3 benchmarks/diag_indexer_parts.py --batches 32 --formats fp8 --scores '[]' \
    --op '[{}, {"topk_config": {"chunks": 4}}]' --topk "${TOPK_LIST:-$list}" --out "$R/topk.json"
  grep PARTS "$R/topk.log" | cut -c1-200
  ;;
pad)
  step pad 150 python3 benchmarks/diag_indexer_parts.py --batches 32 --formats fp8 --row-pad 12 --topk '[]' --op '[]' \
    --scores '[{}, {"block_n": 512}, {"num_stages": 3}, {"block_s": 64}]' --out "$R/pad.json"
  grep PARTS "$R/pad.log" | cut -c1-200
  ;;
verify)
  # (as run in session 14 it also timed TopkConfig(sort="rank") and IndexerConfig(prefetch=True), both slower
  # than the defaults and removed in session 15: BENCHMARKS.md)
  P="python3 benchmarks/diag_indexer_parts.py --formats fp8"
  step verify_b32 230 $P --batches 32 --out "$R/verify_b32.json" --op '[{}]' --scores '[{}]' \
    --topk '[{"impl": "xla"}, {}, {"chunks": 1}, {"sort": "none"}]'
  step verify_b128 110 $P --batches 128 --out "$R/verify_b128.json" --op '[{}]' --scores '[{}]' \
    --topk '[{}, {"chunks": 1}]'
  step verify_b1 90 $P --batches 1 --out "$R/verify_b1.json" --scores '[]' --op '[{}, {"topk_impl": "select"}]' \
    --topk '[{"impl": "xla"}, {}]'
  for b in 32 128 1; do grep PARTS "$R/verify_b$b.log" | grep -v "kernel .* us  [a-z_]*fusion" | cut -c1-200; done
  ;;
tests)
  export GLM_DSA_TEST_GPU=1
  step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_indexer_topk.py tests/kernels/test_indexer.py
  tail -3 "$R/gpu_tests.log"
  unset GLM_DSA_TEST_GPU
  ;;
ncu_idx)
  step ncu_idx 150 ncu --clock-control none --kernel-name regex:'indexer' --launch-count 2 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \
    python3 benchmarks/profile_kernels.py --ops indexer
  grep -E "indexer|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Warp Cycles Per Issued|Block Size|Grid Size|Waves|Dynamic Shared|Static Shared" "$R/ncu_idx.log" | head -60
  ;;
*) echo "unknown step $what"; exit 2 ;;
esac; done
tar czf "$OUT/session14_$(echo "$@" | tr ' ' _).tgz" -C "$OUT" r && rm -rf "$R"
