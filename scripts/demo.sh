#!/usr/bin/env bash
# Sets up a virtual environment (CPU torch), installs hf_radix into it (a regular, non-editable install;
# skipped when this source is already installed there) and runs the demo: plain generate and hf_radix side
# by side on a tiny random-weight model.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
pip_install_once demo-install .
"$PY" -m hf_radix.demo "$@"
