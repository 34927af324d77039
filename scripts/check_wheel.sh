#!/usr/bin/env bash
# Packaging check: builds the wheel, installs it with its dependencies into a fresh virtual environment
# (no editable install, the same torch as the project's venv) and runs the demo from it outside the source
# tree, so a module or package data file (kernels/store.cu) missing from the wheel fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip wheel -qq --no-deps -w "$WORK/dist" .
python3 -m venv "$WORK/venv"
FRESH="$WORK/venv/bin/python"
"$FRESH" -m pip install -qq "$TORCH" "$WORK"/dist/hf_radix-*.whl
cd "$WORK"
"$FRESH" - <<'PYEOF'
import sys
from importlib import metadata, resources

import hf_radix

assert hf_radix.__file__.startswith(sys.prefix), f"hf_radix imported from {hf_radix.__file__}, not the wheel"
assert (resources.files("hf_radix.kernels") / "store.cu").is_file(), "kernels/store.cu is missing from the wheel"
print(f"== wheel hf-radix {metadata.version('hf-radix')} imports from {sys.prefix}; extras:",
      ", ".join(metadata.metadata("hf-radix").get_all("Provides-Extra")))
PYEOF
"$FRESH" -m hf_radix.demo
