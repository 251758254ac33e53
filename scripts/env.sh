# Sourced by the other scripts: makes sure a Python environment with funcpar exists, and sets $PY to it.
#
# Default: a virtual environment in .venv, with the CPU build torch==2.13.0 installed first (so nothing pulls a
# multi-GB CUDA build), then funcpar in editable mode with its test extras.
# GPU users: set FUNCPAR_PYTHON to the python of an environment that already has your CUDA torch; funcpar is then
# installed into it with a torch *range* that your torch satisfies, so pip leaves your torch alone.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip, showing one line per package it fetches and its last line (a first install takes minutes: not in silence);
# its whole output goes to $ROOT/.pip.log, named when it fails
pip_shown() {
    if ! "$PY" -m pip install --progress-bar off "$@" 2>&1 | tee "$ROOT/.pip.log" \
            | { grep --line-buffered -E "^(Collecting|Successfully|ERROR)" || true; } | sed -u 's/^/[funcpar]   /' >&2
    then
        echo "[funcpar] pip failed: its whole output is in $ROOT/.pip.log" >&2
        return 1
    fi
}
if [ -n "${FUNCPAR_PYTHON:-}" ]; then
    PY=$FUNCPAR_PYTHON
    stamp_dir=$("$PY" -c 'import sys; print(sys.prefix)')
else
    if [ ! -x "$ROOT/.venv/bin/python" ]; then
        echo "[funcpar] creating $ROOT/.venv" >&2
        python3 -m venv "$ROOT/.venv"
    fi
    PY=$ROOT/.venv/bin/python
    stamp_dir=$ROOT/.venv
    if ! "$PY" -c "import torch" >/dev/null 2>&1; then
        echo "[funcpar] installing torch==2.13.0 (CPU build; about a minute)" >&2
        pip_shown torch==2.13.0
    fi
fi
# (re)install the project when pyproject.toml changed since the last install into this environment
want=$(sha1sum "$ROOT/pyproject.toml" | cut -d' ' -f1)
stamp="$stamp_dir/.funcpar-installed"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ] || ! "$PY" -c "import funcpar, funcpar.models" >/dev/null 2>&1; then
    echo "[funcpar] installing funcpar and its test extras (transformers, peft, tensorboard, ...; a first install" \
        "takes 2-3 minutes)" >&2
    if [ -z "${FUNCPAR_PYTHON:-}" ]; then
        pip_shown -e "$ROOT[test]"
        echo "$want" > "$stamp"
    # your own environment: build with its setuptools (no package index needed for that); where pip still cannot
    # install (no index for a missing extra), a funcpar already importable from this checkout is used as it is
    elif "$PY" -m pip install -q --no-build-isolation -e "$ROOT[test]"; then
        echo "$want" > "$stamp"
    elif "$PY" -c "import funcpar, funcpar.models, sys; sys.exit(not funcpar.__file__.startswith('$ROOT/'))" \
            >/dev/null 2>&1; then
        echo "[funcpar] warning: pip could not (re)install funcpar into $PY (above); using the funcpar this" \
            "checkout already gives it" >&2
    else
        echo "[funcpar] could not install funcpar into $PY (pip's error above)" >&2
        exit 1
    fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export HF_HUB_OFFLINE=1
