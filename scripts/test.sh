#!/usr/bin/env bash
# Run the whole test suite on CPU: sets up both environments, then pytest on 8 simulated devices, in
# GLM_DSA_TEST_WORKERS pytest-xdist worker processes (default 2, CI's cores: 51 against 67 minutes in one process,
# measured 2026-12-02; 0 runs in this process), listing the 25 slowest tests at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_ref.sh
export GLM_DSA_REF_PYTHON="$PWD/.venv-ref/bin/python" GLM_DSA_REQUIRE_REF=1
# The CPU backend's LLVM at its lowest optimisation: the tests run small shapes, so compiling dominates their time
# (about a sixth less wall time for the model and multi-process tests, the interpreted kernels' unchanged). Every
# bitwise check compares runs under the same flags. Subprocesses keep them (tests/multihost: `xla_flags`).
export XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
export JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${GLM_DSA_TEST_WORKERS:-2}" --durations=25 "$@"
