# Sourced by demo.sh, test.sh and check_wheel.sh: makes (or reuses) the project's virtual environment with
# CPU torch. HF_RADIX_VENV picks its directory (default .venv), HF_RADIX_TORCH the torch requirement.
VENV=${HF_RADIX_VENV:-.venv}
TORCH=${HF_RADIX_TORCH:-torch==2.13.0}
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -qq --upgrade pip
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -qq "$TORCH"
