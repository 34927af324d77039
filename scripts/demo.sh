#!/usr/bin/env bash
# Sets up a virtual environment (CPU torch) and runs the built-in demo on a tiny random-weight model.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
"$PY" -m pip install -q -e .
"$PY" -m hf_radix.demo "$@"
