#!/usr/bin/env bash
# Sets up a fresh virtual environment and runs the test suite on the newest transformers 5.x and on 5.17.0.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
"$PY" -m pip install -q -e ".[test]"
"$PY" -m pip install -q -U "transformers>=5.17,<6"
"$PY" -m ruff check .
echo "== tests on transformers $("$PY" -c 'import transformers; print(transformers.__version__)')"
"$PY" -m pytest -q -p no:cacheprovider "$@"
"$PY" -m pip install -q "transformers==5.17.0"
echo "== tests on transformers $("$PY" -c 'import transformers; print(transformers.__version__)')"
"$PY" -m pytest -q -p no:cacheprovider -m "not slow" "$@"
