#!/usr/bin/env bash
# Create .venv-ref (Python 3.11, CPU torch, transformers >= 5.13) for the reference run; idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-ref/bin/python ]; then
  PYENV_VERSION=${GLM_DSA_REF_PYENV:-3.11.7} python3 -m venv .venv-ref
fi
# torch is pinned: an unpinned torch pulls GBs of CUDA; 2.13.0's CPU wheel is served for Python 3.11.
.venv-ref/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" "transformers>=5.13" safetensors numpy
