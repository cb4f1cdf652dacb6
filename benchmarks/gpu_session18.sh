#!/usr/bin/env bash
# Session 18's device steps (issues 16, 17): bash benchmarks/gpu_session18.sh STEP...
#   mla_tests  the Mosaic sparse MLA GPU tests (TESTS_K: a pytest -k expression; default every gpu test)
#   fp8_probe  the fp8_ds_mla kernel at B = 128 / 32: the register splits (VARIANTS) beside the previous module
#              (BEFORE: a file holding it, e.g. `git show 9d1aebb:kernels/sparse_mla_mosaic.py`) and xla
#   b1_probe   the default Mosaic kernel at B = 1, both caches, beside the previous module
#   bf16_probe the bf16 kernel's default at B = 128 / 32 (the fp8 line's reference, same run)
#   wheels     install the carried wheels (.whl: tokamax 0.0.17, qwix and what the image lacks) into /tmp/site
#   e2e        the engine (`python -m glm_dsa bench`, bench preset, impl auto) with bf16 and with FP8 weights
#              (QUANTS, default "none fp8"): prefill 8 x 32K, 16 new tokens, decode steps at B = 1 / 32 / 128
#              (issue 16's lines); calls 5-6 ran it after `wheels`, when "auto" still took tokamax (no longer)
#   attn       bench_attention.py --ops sparse_mla_mosaic (the defaults beside xla and Triton), merged into a copy
#              of results/attention.json
# Every step under its own timeout; logs and JSON under $OUT/r, packed into one tarball.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"  # cd to the repository, OUT, R, the exports, step()
BEFORE=${BEFORE-.s18/before.py}

for what in "$@"; do case $what in
mla_tests)
  GLM_DSA_TEST_GPU=1 step mla_tests ${T_TESTS:-220} python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_sparse_mla_mosaic.py -k "${TESTS_K:-gpu}"
  tail -4 "$R/mla_tests.log"
  ;;
fp8_probe)
  step fp8_probe ${T_PROBE:-240} python3 benchmarks/probe_sparse_mla_mosaic.py --caches fp8 --batches 128,32 \
    --variants ${VARIANTS:-cp_async,fr168,fr184,cr208} --baselines "${BASELINES-xla}" --before "$BEFORE" --splits default \
    --out "$R/fp8_probe.json"
  grep "PROBE" "$R/fp8_probe.log" | grep -v "PASS" | cut -c1-170
  ;;
b1_probe)
  step b1_probe ${T_B1:-100} python3 benchmarks/probe_sparse_mla_mosaic.py --caches fp8,bf16 --batches 1 \
    --variants cp_async --baselines "" --before "$BEFORE" --splits default --out "$R/b1_probe.json"
  grep "PROBE" "$R/b1_probe.log" | grep -v "PASS" | cut -c1-170
  ;;
bf16_probe)
  step bf16_probe ${T_BF16:-100} python3 benchmarks/probe_sparse_mla_mosaic.py --caches bf16 --batches 128,32 \
    --variants cp_async --baselines "" --splits default --out "$R/bf16_probe.json"
  grep "PROBE" "$R/bf16_probe.log" | grep -v "PASS" | cut -c1-170
  ;;
wheels)
  install_wheels
  ;;
e2e)
  for q in ${QUANTS:-none fp8}; do
    flag=$([ $q = fp8 ] && echo "--quantization fp8")
    step "e2e_$q" ${T_E2E:-270} python3 -m glm_dsa bench --preset bench --impls auto --input-len 32768 --batch 8 \
      --output-len 16 --decode-batches 1,32,128 --decode-context 32768 $flag --json-out "$R/e2e_$q.json"
    tail -25 "$R/e2e_$q.log" | cut -c1-170
  done
  ;;
attn)
  cp benchmarks/results/attention.json "$R/attention.json"
  step attn ${T_ATTN:-250} python3 benchmarks/bench_attention.py --ops sparse_mla_mosaic --merge --timeout_s 240 \
    --extra "sparse_mla_mosaic=--variants cp_async --baselines xla,triton --splits default" --out "$R/attention.json"
  grep "PROBE time" "$R/attn.log" | cut -c1-170; tail -3 "$R/attn.log"
  ;;
*) echo "unknown step $what"; exit 2 ;;
esac; done
tar czf "$OUT/session18_$(echo "$@" | tr ' ' _).tgz" -C "$OUT" r && rm -rf "$R"
