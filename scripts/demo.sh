#!/usr/bin/env bash
# Sets up the environment if needed, then runs the main job: train a tensor-parallel MLP on Mesh(tp=2, dp=2)
# over 4 local CPU processes (started through torch.distributed.run) and print its falling loss.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec "$PY" -m funcpar.demo "$@"
