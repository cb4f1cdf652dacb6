#!/usr/bin/env bash
# Create .venv (Python 3.12 through pyenv) with glm-dsa and its test extras; idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${GLM_DSA_PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  PYENV_VERSION=${PYENV_VERSION:-3.12.1} "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -c scripts/constraints.txt -e ".[test]"
