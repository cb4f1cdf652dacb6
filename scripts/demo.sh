#!/usr/bin/env bash
# Set up .venv, write a small random GLM-5.2-shaped checkpoint, load it, generate; prints tokens and tokens/s.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m glm_dsa demo "$@"
