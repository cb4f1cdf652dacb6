#!/usr/bin/env bash
# Run the whole test suite on CPU: sets up both environments, then pytest on 8 simulated devices, in
# GLM_DSA_TEST_WORKERS pytest-xdist worker processes (default 2, CI's cores: 51 against 67 minutes in one process,
# measured 2026-12-02; 0 runs in this process), listing the 25 slowest tests at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_ref.sh
export GLM_DSA_REF_PYTHON="$PWD/.venv-ref/bin/python" GLM_DSA_REQUIRE_REF=1
export XLA_FLAGS="--xla_force_host_platform_device_count=8" JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${GLM_DSA_TEST_WORKERS:-2}" --durations=25 "$@"
