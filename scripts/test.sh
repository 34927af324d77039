#!/usr/bin/env bash
# Sets up a virtual environment and runs ruff, the test suite on the newest transformers 5 (<6) and on 5.17.0,
# then the packaging check (the built wheel, installed into a fresh venv, runs the demo). The first run
# uses every core, a test file per worker (a file's interpreter subprocess and fixtures are made once): its
# interpreter subprocesses dominate it. The second, without them, is faster in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
pip_install_once test-install ".[test]"  # the tests import the source tree (pyproject's pythonpath)
"$PY" -m pip install -qq -U "transformers>=5.17,<6"
"$PY" -m ruff check .
echo "== tests on transformers $("$PY" -c 'import transformers; print(transformers.__version__)') (set-up took ${SECONDS} s)"
"$PY" -m pytest -q -p no:cacheprovider -n auto --dist loadfile "$@"
"$PY" -m pip install -qq "transformers==5.17.0"
echo "== tests on transformers $("$PY" -c 'import transformers; print(transformers.__version__)') (${SECONDS} s so far)"
"$PY" -m pytest -q -p no:cacheprovider -m "not slow" "$@"
echo "== packaging check (${SECONDS} s so far)"
bash scripts/check_wheel.sh
echo "== done in ${SECONDS} s"
