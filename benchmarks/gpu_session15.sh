#!/usr/bin/env bash
# Session 15 device calls on one H200 (BENCHMARKS.md, session 15):
#   tests     the indexer and top-k GPU tests (the select kernel's empty-row fix, the two-pass default)
#   small     the whole op at B = 1 and 2 (FP8 cache, 32K): the default (now the two-pass select) beside lax.top_k
#   b32       the whole op at B = 32 at the defaults, and with the selection left in position order (sort "none")
#   attn      bench_attention.py --ops indexer, merged into a copy of benchmarks/results/attention.json
#   e2e       the engine decode step (bench preset, impl auto, 32K context, bf16) at B = 1 / 32 / 128
#   unordered the whole op at B = 1 / 32 / 128 as the model calls it, `indexer_topk(ordered=False)`, beside the default
#   engine_tests  the engine's GPU tests (the model's indexer call unordered)
# (call 4 ran a `preload` step: IndexerConfig(preload_pages=True), the scores loop reading its program's pages
# before the loop; slower, removed: BENCHMARKS.md, session 15)
# Every step under its own timeout; logs and JSON under $OUT/r, packed into one tarball.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"  # cd to the repository, OUT, R, the exports, step()
P="python3 benchmarks/diag_indexer_parts.py --formats fp8 --scores [] --topk []"

for what in "$@"; do case $what in
tests)
  export GLM_DSA_TEST_GPU=1
  step gpu_tests 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_indexer_topk.py tests/kernels/test_indexer.py
  tail -5 "$R/gpu_tests.log"
  unset GLM_DSA_TEST_GPU
  ;;
small)
  step small 150 $P --batches 1,2 --out "$R/small.json" --op '[{}, {"topk_impl": "lax"}]'
  grep PARTS "$R/small.log" | cut -c1-160
  ;;
b32)
  step b32 120 $P --batches 32 --out "$R/b32.json" --op '[{}, {"topk_config": {"sort": "none"}}]'
  grep PARTS "$R/b32.log" | cut -c1-160
  ;;
attn)
  cp benchmarks/results/attention.json "$R/attention.json"
  step attn 240 python3 benchmarks/bench_attention.py --ops indexer --merge --timeout_s 220 --out "$R/attention.json"
  grep -E "scores\+topk|bench_attention" "$R/attn.log" | cut -c1-200 | head -30
  ;;
e2e)
  step e2e 240 python3 -m glm_dsa bench --preset bench --impls auto --decode-batches ${BATCHES:-1,32,128} \
    --decode-context 32768 --no-end-to-end --json-out "$R/e2e.json"
  grep "ms/step" "$R/e2e.log" | cut -c1-200
  ;;
unordered)
  step unordered 200 $P --batches 32,128,1 --out "$R/unordered.json" --op '[{}, {"ordered": false}]'
  grep PARTS "$R/unordered.log" | grep "PARTS op" | cut -c1-160
  ;;
engine_tests)
  export GLM_DSA_TEST_GPU=1
  step engine_tests 240 python3 -m pytest -q -p no:cacheprovider tests/glm_dsa/test_gpu_engine.py
  tail -3 "$R/engine_tests.log"
  unset GLM_DSA_TEST_GPU
  ;;
*) echo "unknown step $what"; exit 2 ;;
esac; done
tar czf "$OUT/session15_$(echo "$@" | tr ' ' _).tgz" -C "$OUT" r && rm -rf "$R"
