#!/usr/bin/env bash
# Sets up the environment if needed, then runs the whole test suite (extra arguments go to pytest).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec "$PY" -m pytest -q "$@"
