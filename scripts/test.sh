#!/usr/bin/env bash
# Sets up the environment if needed, then lints the tree (ruff: the rules in pyproject.toml) and runs the whole test
# suite (extra arguments go to pytest).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
"$PY" -m ruff --version >/dev/null 2>&1 || "$PY" -m pip install -q "ruff>=0.5"
"$PY" -m ruff check --no-cache "$ROOT"
exec "$PY" -m pytest -q "$@"
