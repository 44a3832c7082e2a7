#!/usr/bin/env bash
# The GPU checks of issue 32, for whenever a GPU is lent (under 5 minutes on one H200, besides the set-up):
#   1. tests/test_mixed_precision.py: bf16-mixed and 16-mixed `vlfuse fit` end to end, the fusion stack in bf16;
#   2. scripts/bench_scale.py --device cuda --dtype bfloat16 --quick: the real-size step split by part, with
#      activation checkpointing, and the fusion stack's forward+backward as a share of the bf16
#      matrix-product rate (target: at least 50%);
#   3. scripts/bench_compile.py --device cuda: torch.compile (inductor) against eager, the real-width
#      fusion stack forward+backward (float32).
# Each step's output goes to ${OUT:-gpu_check_out}/<step>.log; a failed step does not stop the next,
# and the script exits 1 naming the failed ones.
#
#   bash scripts/gpu_check.sh
#   GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh   # print the commands, run none (any machine)
#   GPU_CHECK_SETUP=0 bash scripts/gpu_check.sh     # .venv already set up: skip scripts/setup_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-gpu_check_out}
PYTHON=.venv/bin/python
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
FAILED=()

# step NAME SECONDS COMMAND...: print the command, then run it for at most SECONDS, its output also in $LOGS/NAME.log
step() {
    local name=$1 seconds=$2
    shift 2
    echo "+ timeout $seconds $(printf '%q ' "$@")> $LOGS/$name.log"
    if [ "$DRY_RUN" = 1 ]; then
        return 0
    fi
    if ! (timeout "$seconds" "$@" 2>&1 | tee "$LOGS/$name.log"); then
        echo "gpu_check: step $name failed (exit status above; timeout's is 124), see $LOGS/$name.log"
        FAILED+=("$name")
    fi
}

mkdir -p "$LOGS"
if [ "$DRY_RUN" != 1 ] && ! command -v nvidia-smi > /dev/null; then
    echo "gpu_check: no GPU here (nvidia-smi not found); GPU_CHECK_DRY_RUN=1 prints the commands" >&2
    exit 1
fi
step nvidia-smi 30 nvidia-smi
if [ "${GPU_CHECK_SETUP:-1}" != 0 ]; then
    step setup 600 bash scripts/setup_env.sh
fi
if [ "$DRY_RUN" != 1 ] && ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check: torch in $PYTHON sees no CUDA device (a CPU-only torch?): the GPU tests would only skip" >&2
    exit 1
fi
step test_gpu 120 "$PYTHON" -m pytest -q -n 0 -rs tests/test_mixed_precision.py
step bench_scale 100 "$PYTHON" scripts/bench_scale.py --device cuda --dtype bfloat16 --quick
step bench_compile 60 "$PYTHON" scripts/bench_compile.py --device cuda --sizes real --cases "stack fwd+bwd" --backends inductor --repeats 5

if [ ${#FAILED[@]} -gt 0 ]; then
    echo "gpu_check: failed: ${FAILED[*]} (logs in $LOGS/)" >&2
    exit 1
fi
if [ "$DRY_RUN" = 1 ]; then
    echo "gpu_check: dry run, nothing ran"
else
    echo "gpu_check: done (logs in $LOGS/)"
fi
