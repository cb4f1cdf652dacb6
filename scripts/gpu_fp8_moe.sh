#!/usr/bin/env bash
# The Mosaic GPU W8A8 routed experts on one H100 / H200, in one go: the gpu tests of kernels/fp8_gemm and of the MoE
# impl "mosaic" (each prints its largest error / bound and relative error), then the quick benchmark against the
# current Triton forms and XLA bf16 (benchmarks/bench_fp8_gemm_mosaic.py --quick, about 3 min). Logs and the
# benchmark's JSON record go to $OUT (default /tmp/gpu_fp8_moe). Exit code: the tests' (or the benchmark's).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" GLM_DSA_TEST_GPU=1
out="${OUT:-/tmp/gpu_fp8_moe}"
mkdir -p "$out"
python -m pytest -m gpu -q -p no:cacheprovider -s -rA --durations=20 tests/kernels/fp8_gemm \
    tests/kernels/moe/test_moe_mosaic.py 2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
python benchmarks/bench_fp8_gemm_mosaic.py --quick --out "$out/fp8_gemm_mosaic_quick.json" 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
echo "gpu tests: exit $tests; benchmark: exit $bench; files in $out"
exit $(( tests != 0 ? tests : bench ))
