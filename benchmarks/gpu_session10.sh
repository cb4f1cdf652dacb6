#!/usr/bin/env bash
# Session 10 device calls on one H200 (BENCHMARKS.md, session 10), in the order they ran:
#   moe        the FP8 expert kernels at decode: swap-AB and split-K variants, per-kernel ncu figures (call 1)
#   moe2 idx   quant_h (h quantised in the up kernel) and stage variants; the indexer with the select top-k (call 2)
#   moe3 idx2 e2e   the leading variants again, the indexer's default, the engine decode step bf16 / FP8 (call 3)
#   final      the TP = 1 uint16-word stack's variants; the FP8 engine decode step with the final defaults (call 4)
#   mla        the Mosaic sparse MLA share_p schedule beside cp_async (written, not run this session)
# Every step under its own timeout; logs and JSON under $OUT/r, packed into one tarball.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"  # cd to the repository, OUT, R, the exports, step()
P=benchmarks/probe_moe_fp8.py
TP8=6144,256,256   # hidden, expert width, experts: a GLM-5.2 TP = 8 shard (plain e4m3)
TP1=6144,2048,256  # the whole stack on one device (uint16 words)

# probe NAME TIMEOUT DIMS BATCHES VARIANTS [flags]: the variants' table at the end of the log
probe() { local name=$1 t=$2 dims=$3 b=$4 v=$5; shift 5
  step "$name" "$t" python3 $P --dims "$dims" --batches "$b" --variants "$v" --iters 3 --out "$R/$name.json" "$@"
  sed -n '/^ *T variant/,$p' "$R/$name.log"; }
e2e() { local name=$1; shift
  step "$name" 190 python3 -m glm_dsa bench --preset bench --impls auto --decode-batches 1,32,128 \
    --decode-context 32768 --no-end-to-end --json-out "$R/$name.json" "$@"
  grep "ms/step" "$R/$name.log" | cut -c1-200; }
indexer() { step "$1" 150 python3 benchmarks/bench_indexer.py --batches 32,128 --formats fp8 --sweep 0 --old 0 \
    --out "$R/$1.json" "${@:2}"; grep -E "check|scores|topk" "$R/$1.log" | cut -c1-220 | head -16; }
moe_tests() { step moe_tests 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe.py -k "$1"
  tail -3 "$R/moe_tests.log"; }

for what in "$@"; do case $what in
moe)
  moe_tests "k_major_stacks"
  probe moe_tp8 200 $TP8 32,1,128 '{"bf16": {}, "default": {}, "swap": {"swap_ab": true},
    "swap_s3": {"swap_ab": true, "num_stages": 3}, "swap_ks2": {"swap_ab": true, "k_split": 2},
    "swap_ks4": {"swap_ab": true, "k_split": 4}, "swap_bn64": {"swap_ab": true, "bn_up": 64, "bn_down": 64},
    "swap_bd256": {"swap_ab": true, "bn_down": 256}, "swap_w8": {"swap_ab": true, "num_warps": 8},
    "ks2": {"k_split": 2}}'
  M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
  M=$M,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active
  for v in default swap; do
    step ncu_$v 90 ncu --clock-control none --profile-from-start off --csv --metrics $M \
      python3 $P --dims $TP8 --batches 32 --variants '{"default": {}, "swap": {"swap_ab": true}}' --ncu $v
    grep -E '"moe_' "$R/ncu_$v.log" | awk -F'","' '{print $5" | "$(NF-2)" | "$NF}'
  done
  ;;
moe2)
  moe_tests "k_major_stacks or quant_h"
  probe moe_tp8_32 200 $TP8 32 '{"bf16": {}, "default": {}, "hq": {"quant_h": true}, "ks2": {"k_split": 2},
    "ks4": {"k_split": 4}, "hq_swap": {"quant_h": true, "swap_ab": true}, "swap_bn64": {"swap_ab": true, "bn_up": 64},
    "hq_bd256": {"quant_h": true, "bn_down": 256}, "hq_w8": {"quant_h": true, "num_warps": 8},
    "hq_s3": {"quant_h": true, "num_stages": 3}, "ks2_s3": {"k_split": 2, "num_stages": 3}}'
  probe moe_tp8_1_128 120 $TP8 1,128 '{"bf16": {}, "default": {}, "hq": {"quant_h": true}, "ks2": {"k_split": 2},
    "hq_swap": {"quant_h": true, "swap_ab": true}}'
  ;;
idx) indexer indexer ;;
moe3)
  probe moe_tp8_32 150 $TP8 32 '{"bf16": {}, "default": {}, "s4_ks1": {"num_stages": 4, "k_split": 1},
    "ks2_s3_swap": {"k_split": 2, "num_stages": 3, "swap_ab": true}, "ks4_s3": {"k_split": 4, "num_stages": 3},
    "hq_s3_swap": {"quant_h": true, "num_stages": 3, "swap_ab": true, "k_split": 1}}'
  probe moe_tp8_1_128 120 $TP8 128,1 '{"bf16": {}, "default": {}, "ks2_s3_1": {"k_split": 2, "num_stages": 3},
    "hq_swap_s3": {"quant_h": true, "swap_ab": true, "num_stages": 3},
    "ks2_s3": {"k_split": 2, "num_stages": 3, "quant_h": false, "swap_ab": false}}'
  ;;
idx2) indexer indexer --xla 0 ;;
e2e) e2e e2e_fp8 --quantization fp8; e2e e2e_bf16 ;;
final)
  probe moe_tp1 120 $TP1 32,128 '{"default": {}, "s3": {"num_stages": 3},
    "hq_s3_swap": {"quant_h": true, "num_stages": 3, "swap_ab": true}}' --no-ref
  e2e e2e_fp8 --quantization fp8
  ;;
mla)
  for c in bf16 fp8; do
    step mla_$c 120 python3 benchmarks/probe_sparse_mla_mosaic.py --out "$R/mla_$c.json" --caches $c \
      --variants cp_async,share_p --batches 128,32
  done
  grep -h PROBE "$R"/mla_*.log | cut -c1-250
  ;;
*) echo "unknown step $what"; exit 2 ;;
esac; done
tar czf "$OUT/session10_$(echo "$@" | tr ' ' _).tgz" -C "$OUT" r && rm -rf "$R"
