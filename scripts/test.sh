#!/usr/bin/env bash
# Sets up the environment if needed, then lints the tree (ruff: the rules in pyproject.toml) and runs the whole test
# suite (extra arguments go to pytest).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
"$PY" -m ruff check --no-cache "$ROOT"
exec "$PY" -m pytest -q "$@"
