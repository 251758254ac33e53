#!/usr/bin/env bash
# The GPU check, on a one-GPU machine, in under 8 minutes: the CUDA test tier (tests/test_cuda.py), the README's
# main job as a GPU user runs it, the refusal of more ranks than GPUs, and a short benchmark; one summary file.
#
#   OUT=/some/folder bash scripts/gpu_check.sh        # writes $OUT/summary.md (and each part's log beside it)
#
# Uses the machine's own Python with its CUDA torch and transformers (FUNCPAR_PYTHON, default python3) and installs
# funcpar into it without touching torch (--no-deps); wheels in .whl/ (optree, pytest, for a machine with no package
# index) are installed first. Copy the summary into docs/GPU.md with the commit, GPU and date it names.
# DEVICE=cpu runs the same script on a machine without a GPU (the tier on the CPU): a check of the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${FUNCPAR_PYTHON:-python3}
OUT=${OUT:-/tmp/funcpar-gpu-check}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }

if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/funcpar-site \
        .whl/*.whl && export PYTHONPATH=/tmp/funcpar-site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import funcpar.models" 2>/dev/null || "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
S="$OUT/summary.md"
{
    echo "# scripts/gpu_check.sh"
    echo
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
    echo "- date: $(date -u +%Y-%m-%dT%H:%MZ)"
    echo "- device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "$DEVICE (no nvidia-smi)")"
    echo "- software: $("$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)' 2>&1)"
} > "$S"

# 1. the CUDA tier
tier_env=()
[ "$DEVICE" = cpu ] && tier_env=(FUNCPAR_CUDA_TIER_DEVICE=cpu)
env "${tier_env[@]}" timeout 300 "$PY" -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider -rA -s \
    > "$OUT/tier.log" 2>&1
tier=$?
{
    echo
    echo "## CUDA tier (tests/test_cuda.py): exit $tier, $(elapsed) s"
    echo '```'
    tail -1 "$OUT/tier.log"
    grep -E "^(FAILED|ERROR) " "$OUT/tier.log" | head -20
    grep -oE "plan \{.*" "$OUT/tier.log"
    echo '```'
} >> "$S"

# 2. the README's main job as a GPU user runs it (auto: the CPU for 4 ranks beside one GPU), and the refusal
timeout 200 env FUNCPAR_PYTHON="$PY" bash scripts/train.sh --steps 30 --eval-every 30 --save-every 30 \
    --out "$OUT/train" --overwrite > "$OUT/train.log" 2>&1
train=$?
timeout 60 "$PY" -m funcpar train --mesh tp=2,dp=2 --device cuda --out "$OUT/refused" > "$OUT/refused.log" 2>&1
refused=$?
timeout 200 "$PY" -m funcpar train --mesh 1 --device "$DEVICE" --steps 30 --eval-every 30 --save-every 30 \
    --out "$OUT/one-gpu" --overwrite > "$OUT/one-gpu.log" 2>&1
one=$?
{
    echo
    echo "## The main job: $(elapsed) s"
    echo "- \`FUNCPAR_PYTHON=$PY bash scripts/train.sh --steps 30\`: exit $train"
    echo '```'
    grep -E "warning: the ranks run|^funcpar train:|^loss " "$OUT/train.log" | cut -c1-300
    echo '```'
    echo "- \`funcpar train --mesh tp=2,dp=2 --device cuda\`: exit $refused, $(wc -l < "$OUT/refused.log") line(s)"
    echo '```'
    cut -c1-300 "$OUT/refused.log"
    echo '```'
    echo "- \`funcpar train --mesh 1 --device $DEVICE --steps 30\`: exit $one"
    echo '```'
    grep -E "^funcpar train:|^loss |tok/s" "$OUT/one-gpu.log" | tail -3 | cut -c1-300
    echo '```'
} >> "$S"

# 3. the plan against max_memory_allocated on the cases of issue 40 (one GPU, the 165M Llama, 8 x 512 tokens): the
# default options (compiled where compile="auto" compiles: the plan gives a bound) and each one eager
left=$((400 - $(elapsed)))
if [ "$left" -gt 60 ]; then
    [ "$left" -gt 200 ] && left=200
    # shellcheck disable=SC2086  # (PLAN_ARGS: several words; a smaller model checks the script on a CPU)
    timeout "$left" "$PY" benchmarks/plan_vs_measured.py ${PLAN_ARGS:---batch 8 --seq 512} \
        --cases "1:1:eager,1:3,1:1:bf16:eager,1:1:remat,1:0:eager,1:1,1:1:bf16" > "$OUT/plan.log" 2>&1
    plan=$?
    { echo; echo "## The plan against max_memory_allocated (benchmarks/plan_vs_measured.py ${PLAN_ARGS:---batch 8 --seq 512}): \
exit $plan, $(elapsed) s"; echo '```'; grep -E "^\|" "$OUT/plan.log"; echo '```'; } >> "$S"
else
    { echo; echo "## The plan against max_memory_allocated: skipped ($left s left)"; } >> "$S"
fi

# 4. a short benchmark: funcpar against the eager transformers loop, one process, small model, fp32
left=$((470 - $(elapsed)))
if [ "$left" -gt 60 ]; then
    timeout "$left" "$PY" benchmarks/run.py --device "$DEVICE" --meshes 1 --size small --precision fp32 --repeats 1 \
        --warmup 3 --steps 5 --no-plan --peak-seconds 1 --out "$OUT/RESULTS.md" --json "$OUT/results.json" \
        --plot "$OUT/results.png" > "$OUT/bench.log" 2>&1
    bench=$?
    { echo; echo "## Benchmark (benchmarks/run.py --meshes 1 --size small): exit $bench, $(elapsed) s"
      echo '```'; grep -E "^\| (Mesh|mesh \| (implementation|funcpar s/step))" "$OUT/RESULTS.md" 2>/dev/null | head -8; echo '```'; } >> "$S"
else
    { echo; echo "## Benchmark: skipped ($left s left of the 8 minutes)"; } >> "$S"
fi
echo "total $(elapsed) s" >> "$S"
cat "$S"
[ "$tier" -eq 0 ] && [ "$train" -eq 0 ] && [ "$refused" -ne 0 ] && [ "$one" -eq 0 ]
