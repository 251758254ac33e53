#!/usr/bin/env bash
# The benchmark on a one-GPU machine, within a short lease: the same benchmarks/run.py, on CUDA.
#
#   OUT=/some/folder bash benchmarks/gpu_run.sh [seconds]
#
# Uses the machine's own Python with its CUDA torch and transformers (FUNCPAR_PYTHON, default python3); installs
# funcpar into it without touching torch (--no-deps), and optree from .whl/ when that folder holds a wheel (machines
# with no package index). Stages, most important first, each skipped when less than its budget is left of [seconds]
# (default 480); STAGES (default all, in this order) picks some:
#   fp32           the small and large sizes, one process (NCCL takes one GPU per rank: multi-rank meshes need more GPUs)
#   bf16-gpu       bf16 (fp32 masters), the 0.87B "gpu" size, one process (PROFILE=1: with where the time goes)
#   eager-large    fp32, large, funcpar with compile=False against the eager loop
#   eager-gpu      bf16, the "gpu" size, funcpar with compile=False alone
# (funcpar's jobs run compile_step's default, compile="auto": compiled on one GPU; --compile on/off forces it)
# Each stage writes RESULTS-*.md, results-*.json and its log under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${FUNCPAR_PYTHON:-python3}
OUT=${OUT:-/tmp/funcpar-gpu}
BUDGET=${1:-480}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
"$PY" -c "import torch, transformers, funcpar; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'gpu', torch.cuda.get_device_name(0))" 2>&1 | tee -a "$OUT/gpu.txt"

stage() {  # name, seconds it needs, run.py arguments...
    local name=$1 need=$2
    shift 2
    if [ "$(left)" -lt "$need" ]; then
        echo "== $name: skipped ($(left) s left, needs $need)"
        return
    fi
    echo "== $name ($(left) s left)"
    timeout "$(left)" "$PY" benchmarks/run.py --device cuda --meshes 1 --no-plan --peak-seconds 2 \
        --out "$OUT/RESULTS-$name.md" --json "$OUT/results-$name.json" --plot "$OUT/results-$name.png" "$@" \
        2>&1 | grep -v "Writing model shards" | tee "$OUT/log-$name.txt"
}

want() { [[ " ${STAGES:-fp32 bf16-gpu eager-large eager-gpu} " == *" $1 "* ]]; }
want fp32 && stage fp32 150 --size both --precision fp32 --repeats 2 --warmup 3 --steps 10
# a failed funcpar job: its traceback (the runner keeps one line)
if grep -q "funcpar Mesh().*FAILED" "$OUT/log-fp32.txt" 2>/dev/null; then
    "$PY" - <<'EOF' 2>&1 | tail -40
import subprocess, sys, tempfile, torch, transformers
sys.path.insert(0, "."); from benchmarks import common as C
d = tempfile.mkdtemp(); torch.manual_seed(0)
transformers.LlamaForCausalLM(transformers.LlamaConfig(**C.hf_config(C.SIZES["small"]))).save_pretrained(d)
subprocess.run([sys.executable, "benchmarks/worker.py", "--mesh", "1", "--impl", "funcpar", "--size", "small",
                "--weights", d, "--device", "cuda", "--warmup", "2", "--steps", "1"])
EOF
fi
want bf16-gpu && stage bf16-gpu 150 --size gpu --precision bf16 --tol 2e-2 --repeats 2 --warmup 3 --steps 10 \
    ${PROFILE:+--profile}
# funcpar with compile=False (its eager gradient), against the same eager loop
want eager-large && stage eager-large 70 --size large --precision fp32 --compile off --repeats 1 --warmup 3 --steps 10
want eager-gpu && stage eager-gpu 100 --size gpu --precision bf16 --tol 2e-2 --compile off --impls funcpar \
    --repeats 1 --warmup 3 --steps 10
echo "== done in $(( $(date +%s) - start )) s"
