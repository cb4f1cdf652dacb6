#!/usr/bin/env bash
# Session 16 device calls on one H200 (BENCHMARKS.md, session 16):
#   wheels    install the carried wheels (.whl: tokamax 0.0.17, qwix and what the image lacks) into /tmp/site
#   tk_shard  the routed FP8 experts at a TP = 8 shard (256 experts of 6144 x 256): our W8A8 kernel, the bf16 kernel
#             and tokamax's ragged_dot (its heuristic config and a few others) on the same experts and routing
#   tk_tp1    the same at TP = 1 (256 x 6144 x 2048, 2**31+ elements a stack; no float32 reference)
#   moe_tests the MoE impl "tokamax" against its float64 oracle on the GPU
#   impl_tp1  the MoE impl "tokamax" (layout and steering in the op) beside our default at TP = 1, T = 1-128
#   e2e_fp8, e2e_bf16  the engine decode step (bench preset, auto: tokamax for the TP = 1 FP8 experts from 16 rows)
#   overhead  at TP = 1, T = 32: the MoE impl "tokamax" beside the same kernel with its scales laid out before the op
#   attn      bench_attention.py --ops indexer (the new select default), merged into a copy of results/attention.json
#   topk_tests  the indexer and top-k GPU tests (the select passes at the one-pass warp rule)
#   topk8     the indexer op as the model calls it (unordered) at the default and with the select passes at 8 warps
# Every step under its own timeout; logs and JSON under $OUT/r, packed into one tarball.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"  # cd to the repository, OUT, R, the exports, step()
TK='"tokamax_f16": {"dtype": "float16"}, "tokamax_f16_bm16_s4": {"dtype": "float16", "block_m": 16, "num_stages": 4}, "tokamax_f16_bm32_s4": {"dtype": "float16", "block_m": 32, "num_stages": 4}, "tokamax_f16_bm64_s4": {"dtype": "float16", "num_stages": 4}, "tokamax_f16_bm16_s4_n": {"dtype": "float16", "block_m": 16, "num_stages": 4, "grid_minor_dim": "n"}, "tokamax_f16_bm16_s4_np": {"dtype": "float16", "block_m": 16, "num_stages": 4, "persistent": false}, "tokamax": {}'
# (call 1 ran bf16 scales, which this ptxas cannot convert to; the f16 rows are the working form)

for what in "$@"; do case $what in
wheels)
  install_wheels
  ;;
tk_shard)
  step tk_shard 330 python3 benchmarks/probe_moe_fp8.py --dims 6144,256,256 --batches 32,128,1 \
    --variants "{\"bf16\": {}, \"default\": {}, $TK}" --out "$R/tk_shard.json"
  tail -25 "$R/tk_shard.log" | cut -c1-150
  ;;
tk_tp1)
  step tk_tp1 200 python3 benchmarks/probe_moe_fp8.py --dims 6144,2048,256 --batches 32 --no-ref --iters 3 \
    --variants '{"default": {}, "tokamax_f16": {"dtype": "float16"}, "tokamax_f16_bm16_s4": {"dtype": "float16", "block_m": 16, "num_stages": 4}}' \
    --out "$R/tk_tp1.json"
  tail -6 "$R/tk_tp1.log" | cut -c1-150
  ;;
topk8)
  step topk8 200 python3 benchmarks/diag_indexer_parts.py --formats fp8 --scores [] --topk [] --batches 32,128,1 \
    --out "$R/topk8.json" --op '[{"ordered": false}, {"ordered": false, "topk_config": {"num_warps": 8}}]'
  grep "PARTS op" "$R/topk8.log" | cut -c1-160
  ;;
moe_tests|topk_tests)
  files=$([ $what = moe_tests ] && echo tests/kernels/test_moe_tokamax.py \
          || echo tests/kernels/test_indexer_topk.py tests/kernels/test_indexer.py)
  GLM_DSA_TEST_GPU=1 step $what 240 python3 -m pytest -q -p no:cacheprovider $files
  tail -3 "$R/$what.log"
  ;;
impl_tp1)
  step impl_tp1 240 python3 benchmarks/probe_moe_fp8.py --dims 6144,2048,256 --batches 32,128,16,8,1 --no-ref --iters 3 \
    --variants '{"default": {}, "impl_tokamax": {"impl": "tokamax"}}' --out "$R/impl_tp1.json"
  tail -12 "$R/impl_tp1.log" | cut -c1-150
  ;;
e2e_fp8|e2e_bf16)
  q=$([ $what = e2e_fp8 ] && echo "--quantization fp8" || true)
  step $what 270 python3 -m glm_dsa bench --preset bench --impls auto --decode-batches ${BATCHES:-1,32,128} \
    --decode-context 32768 --no-end-to-end $q --json-out "$R/$what.json"
  grep "ms/step" "$R/$what.log" | cut -c1-200
  ;;
overhead)
  step overhead 120 python3 benchmarks/probe_moe_fp8.py --dims 6144,2048,256 --batches 32 --no-ref --iters 3 \
    --variants '{"impl_tokamax": {"impl": "tokamax"}, "tokamax_f16_bm16_s4": {"dtype": "float16", "block_m": 16, "num_stages": 4}, "default": {}}' \
    --out "$R/overhead.json"
  tail -4 "$R/overhead.log" | cut -c1-150
  ;;
attn)
  cp benchmarks/results/attention.json "$R/attention.json"
  step attn 240 python3 benchmarks/bench_attention.py --ops indexer --merge --timeout_s 220 --out "$R/attention.json"
  grep -E "scores\+topk|bench_attention" "$R/attn.log" | cut -c1-200 | head -30
  ;;
*) echo "unknown step $what"; exit 2 ;;
esac; done
tar czf "$OUT/session16_$(echo "$@" | tr ' ' _).tgz" -C "$OUT" r && rm -rf "$R"
