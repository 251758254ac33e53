#!/usr/bin/env bash
# Sets up the environment if needed, then runs the main job: `funcpar train` with its defaults (a small Llama on
# the built-in arithmetic task, Mesh(tp=2, dp=2) over 4 local CPU processes, ~2-3 minutes here), writing out/.
# Extra arguments go to `funcpar train` (see `funcpar train --help`).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec "$PY" -m funcpar train "$@"
