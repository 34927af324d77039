# Sourced by demo.sh, test.sh and check_wheel.sh: makes (or reuses) the project's virtual environment with
# CPU torch. HF_RADIX_VENV picks its directory (default .venv), HF_RADIX_TORCH the torch requirement.
VENV=${HF_RADIX_VENV:-.venv}
TORCH=${HF_RADIX_TORCH:-torch==2.13.0}
export PIP_DISABLE_PIP_VERSION_CHECK=1
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
    "$PY" -m pip install -qq --upgrade pip
fi
"$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" \
    || "$PY" -m pip install -qq "$TORCH"

# pip_install_once NAME ARGS...: `pip install ARGS` unless this venv already got the same ARGS from the same
# sources (a hash of hf_radix's .py and .cu files, setup.py, pyproject.toml and requirements-test.txt, kept
# in $VENV/.NAME.sha256) and hf-radix is still installed in it: a second run installs nothing.
pip_install_once() {
    local stamp="$VENV/.$1.sha256"
    shift
    local key
    key=$({ echo "$*"; find hf_radix setup.py pyproject.toml requirements-test.txt -type f \
        \( -name '*.py' -o -name '*.cu' -o -name '*.toml' -o -name '*.txt' \) -print0 | LC_ALL=C sort -z \
        | xargs -0 sha256sum; } | sha256sum | cut -d' ' -f1)
    if [ "$(cat "$stamp" 2>/dev/null)" = "$key" ] \
        && "$PY" -c "import importlib.metadata as m; m.version('hf-radix')" 2>/dev/null; then
        return 0
    fi
    rm -f "$stamp"
    "$PY" -m pip install -qq "$@"
    echo "$key" >"$stamp"
}
