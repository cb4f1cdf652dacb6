#!/usr/bin/env bash
# Session 17's device steps (issues 16, 17): bash benchmarks/gpu_session17.sh STEP...
#   wheels     install the carried wheels (.whl: tokamax 0.0.17, qwix and what the image lacks) into /tmp/site
#   mla_tests  the Mosaic sparse MLA GPU tests (TESTS_K: a pytest -k expression; default every gpu test)
#   fp8_probe  the fp8_ds_mla kernel at B = 128 / 32 / 1 (VARIANTS: the probe's variants; calls 1-2 also ran
#              variants since removed: BENCHMARKS.md, session 17)
#   bf16_probe the bf16 kernel at B = 128 / 32 with the L2 prefetch at 0 / 1 / 2 / 4 tiles
#   moe_tests  the MoE impl "tokamax" against its float64 oracle (after wheels)
#   attn       bench_attention.py --ops sparse_mla_mosaic (the new default beside l2_prefetch 0, xla and Triton),
#              merged into a copy of results/attention.json
# Every step under its own timeout; logs and JSON under $OUT/r, packed into one tarball.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"  # cd to the repository, OUT, R, the exports, step()

for what in "$@"; do case $what in
wheels)
  install_wheels
  ;;
mla_tests)
  GLM_DSA_TEST_GPU=1 step mla_tests ${T_TESTS:-220} python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_sparse_mla_mosaic.py -k "${TESTS_K:-gpu}"
  tail -4 "$R/mla_tests.log"
  ;;
fp8_probe)
  step fp8_probe ${T_PROBE:-220} python3 benchmarks/probe_sparse_mla_mosaic.py --caches fp8 --batches ${BATCHES:-128,32,1} \
    --variants ${VARIANTS:-cp_async,pf1,pf2} --baselines "${BASELINES:-}" --splits default --out "$R/fp8_probe.json"
  grep "PROBE" "$R/fp8_probe.log" | grep -v "PASS" | cut -c1-170
  grep -c "PASS" "$R/fp8_probe.log"
  ;;
bf16_probe)
  step bf16_probe ${T_PROBE:-130} python3 benchmarks/probe_sparse_mla_mosaic.py --caches bf16 --batches ${BATCHES:-128,32} \
    --variants ${VARIANTS:-pf0,pf1,pf2,pf4} --baselines "${BASELINES:-}" --splits default --out "$R/bf16_probe.json"
  grep "PROBE" "$R/bf16_probe.log" | grep -v "PASS" | cut -c1-170
  ;;
moe_tests)
  GLM_DSA_TEST_GPU=1 step moe_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_tokamax.py
  tail -3 "$R/moe_tests.log"
  ;;
attn)
  cp benchmarks/results/attention.json "$R/attention.json"
  step attn 250 python3 benchmarks/bench_attention.py --ops sparse_mla_mosaic --merge --timeout_s 240 \
    --extra "sparse_mla_mosaic=--variants cp_async,pf0 --baselines xla,triton --splits default" --out "$R/attention.json"
  grep "PROBE time" "$R/attn.log" | cut -c1-170; tail -3 "$R/attn.log"
  ;;
*) echo "unknown step $what"; exit 2 ;;
esac; done
tar czf "$OUT/session17_$(echo "$@" | tr ' ' _).tgz" -C "$OUT" r && rm -rf "$R"
