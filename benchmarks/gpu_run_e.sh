#!/usr/bin/env bash
# Device call E (issue 18, serving). Usage: bash benchmarks/gpu_run_e.sh [one|pair|all]   (default: all)
#   one  (nvidia-h200, under 250 s with the compiles): on GPU 0,
#        host: the loop's device idle time per decode step at B = 32, 1, 128 (the loop's step time against a
#              replay of the same steps back to back; see bench_serving.py's docstring), with the host's
#              build / launch / process split;
#        rate: static groups (the old generate) vs continuous batching, 48 requests of 512 tokens (64 out) arriving
#              as a Poisson process at 16 / s (seed 0): output tok/s, TTFT and TPOT p50 / p99.
#   pair (nvidia-h200-x2, under 240 s): DCP = 1 vs 2 at TP = 2, 16 prompts of 16K tokens (32 out) at once in 600
#        pages of 64 per rank: DCP = 1 holds 2 such sequences at a time, DCP = 2 holds 4.
#   all: one, then pair (an x2 lease, under 500 s).
# XLA's GEMM autotuning stays on (off made the step 2.6x slower). Logs, JSON, exit codes, nvidia-smi and the tree's
# commit and status go into one tarball, $OUT/e.tgz (the device tool returns a few files only).
# PY and EXTRA (appended to every bench command, so its flags win) are for a CPU smoke run, e.g.
#   OUT=/tmp/e PY=.venv/bin/python EXTRA="--cpu --preset tiny --block-size 16 --num-requests 16 --input-len 64
#   --output-len 8 --host-overhead-input-len 32 --request-rate 40" bash benchmarks/gpu_run_e.sh
set -uo pipefail
WHAT=${1:-all}
case $WHAT in one|pair|all) ;; *) echo "usage: $0 [one|pair|all]" >&2; exit 2;; esac
OUT=${OUT:-gpu_out}; R="$OUT/e"; mkdir -p "$R"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
{ git rev-parse --short HEAD; git status --short | head -80; } > "$R/tree.txt" 2>&1
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv > "$R/gpu.txt" 2>&1
run() {  # name, time limit (s), command...: the log to $R/name.log, the exit code to $R/rc.txt
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T))"
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  echo "$name rc=$? ($(date +%T))" | tee -a "$R/rc.txt"
  tail -n 8 "$R/$name.log"
}
S="${PY:-python3} benchmarks/bench_serving.py --preset bench"
X=${EXTRA:-}
if [[ $WHAT == one || $WHAT == all ]]; then
  (
    export CUDA_VISIBLE_DEVICES=0
    run host 110 $S --modes= --host-overhead-batches 32,1,128 --host-overhead-input-len 128 --output-len 64 \
      --out "$R/host.json" $X
    run rate 125 $S --modes continuous,static --num-requests 48 --input-len 512 --output-len 64 --max-num-seqs 16 \
      --max-num-batched-tokens 2048 --request-rate 16 --warm-passes 4 --out "$R/rate.json" $X
  )
fi
if [[ $WHAT == pair || $WHAT == all ]]; then
  for d in 1 2; do
    run dcp$d 115 $S --tp 2 --dcp $d --num-requests 16 --input-len 16384 --output-len 32 --max-num-seqs 16 \
      --num-pages 600 --modes continuous --out "$R/dcp$d.json" $X
  done
fi
tar czf "$OUT/e.tgz" -C "$OUT" e && rm -rf "$R"
