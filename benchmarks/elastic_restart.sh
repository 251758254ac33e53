#!/usr/bin/env bash
# An elastic job that loses a node, on one machine: two torchrun agents (--nnodes 1:2, 2 ranks each, c10d
# rendezvous on localhost) train `--mesh tp=2,dp=auto` (dp=2 over 4 ranks); after step 25 agent B and its workers are
# SIGKILLed. Agent A's ranks fail, torchrun restarts them on the one node left, and they resume the last checkpoint
# on dp=1 by themselves. Prints agent A's log and the seconds from the kill to the first step after it.
#     bash benchmarks/elastic_restart.sh [WORKDIR]
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${1:-$(mktemp -d)}
mkdir -p "$WORK" && cd "$WORK" && rm -rf out a.log b.log
source "$ROOT/.venv/bin/activate"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=$ROOT
PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
common=(--nnodes 1:2 --nproc-per-node 2 --max-restarts 2 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$PORT"
        --rdzv-id elastic --rdzv-conf last_call_timeout=2,keep_alive_interval=2,keep_alive_max_attempt=2
        -m funcpar train --model llama-micro --mesh tp=2,dp=auto --steps 60 --global-batch 8 --seq-len 32
        --save-every 10 --eval-every 0 --log-every 5 --heartbeat 5 --out "$WORK/out")
setsid python -m torch.distributed.run "${common[@]}" > a.log 2>&1 &
A=$!
sleep 2
setsid python -m torch.distributed.run "${common[@]}" > b.log 2>&1 &
B=$!
t0=$(date +%s)
until grep -q "step    25/" a.log 2>/dev/null; do
    sleep 0.2
    if [ $(( $(date +%s) - t0 )) -gt 300 ]; then echo "no step 25 within 300 s"; kill -9 -- -$A -$B; exit 1; fi
done
KILLED=$(date +%s.%N)
kill -9 -- -"$B"
wait "$A"
echo "agent A exit $?"
grep -v "^\s*$" a.log | grep -v "^leaf\|^layers\|^embed\|^lm_head\|^norm"
python - "$KILLED" <<'PY'
import json, sys
rows = [json.loads(line) for line in open("out/metrics.jsonl")]
after = min((r for r in rows if r["time"] > float(sys.argv[1])), key=lambda r: r["time"])
print(f"first step after the kill: step {after['step']}, {after['time'] - float(sys.argv[1]):.1f} s after it; "
      f"metrics rows for steps {rows[0]['step']}..{rows[-1]['step']}")
PY
