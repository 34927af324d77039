# Sourced by demo.sh and test.sh: makes (or reuses) the project's virtual environment with CPU torch.
VENV=${HF_RADIX_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
