#!/usr/bin/env bash
# Sets up a virtual environment (CPU torch) and runs the built-in demo on a tiny random-weight model.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HF_RADIX_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e .
"$PY" -m hf_radix.demo "$@"
