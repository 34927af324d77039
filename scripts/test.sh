#!/usr/bin/env bash
# Sets up a fresh virtual environment and runs the test suite on transformers 5.17.0 and the newest 5.x.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HF_RADIX_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e ".[test]" "transformers>=5.17,<6"
"$PY" -m ruff check .
echo "== tests on transformers $("$PY" -c 'import transformers; print(transformers.__version__)')"
"$PY" -m pytest -q -p no:cacheprovider "$@"
"$PY" -m pip install -q "transformers==5.17.0"
echo "== tests on transformers $("$PY" -c 'import transformers; print(transformers.__version__)')"
"$PY" -m pytest -q -p no:cacheprovider -m "not slow" "$@"
