#!/usr/bin/env bash
# Everything of the project that runs on a one-GPU machine without network, in one go, in at
# most 4 minutes; what it cannot run there it skips with one line each (tests/gpu/README.md).
#
#   tests/gpu/device_check.sh            # run (a dry run when no CUDA device is visible)
#   tests/gpu/device_check.sh --dry-run  # list what would run and what is skipped
#
# Exit status: 0 every step that ran passed, 1 a step failed.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
if [[ $DRY == 0 ]] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1; then
    echo "no CUDA device visible: dry run"
    DRY=1
fi
VENDOR=tests/gpu/.vendor
export PYTHONPATH="$PWD/$VENDOR:$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG=${DEVICE_CHECK_LOG:-$(mktemp -d -t device-check-XXXX)}
FAILED=0

have() { "$PY" -c "import $1" >/dev/null 2>&1; }
cuda_devices() { "$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0; }
skip() { echo "skip: $1: $2"; }

step() {  # step NAME SECONDS COMMAND...: run under a time limit, one line of result, log kept
    local name=$1 limit=$2
    shift 2
    if [[ $DRY == 1 ]]; then
        echo "would run: $name (<= ${limit} s): $*"
        return
    fi
    local start=$SECONDS rc=0
    timeout "$limit" "$@" >"$LOG/$name.log" 2>&1 || rc=$?
    if [[ $rc == 0 ]]; then
        echo "ok: $name ($((SECONDS - start)) s) $(grep -E 'passed|skipped|tokens/s' "$LOG/$name.log" | tail -n 1)"
    else
        echo "FAIL: $name (exit $rc after $((SECONDS - start)) s; log $LOG/$name.log)"
        tail -n 15 "$LOG/$name.log" | sed 's/^/    /'
        FAILED=1
    fi
}

# Carried wheels (make gpu-wheels): the packages the machine lacks, installed without network.
if compgen -G "tests/gpu/wheels/*.whl" >/dev/null; then
    step install-wheels 60 "$PY" -m pip install --quiet --no-index --no-deps --target "$VENDOR" tests/gpu/wheels/*.whl
else
    skip install-wheels "no tests/gpu/wheels (run make gpu-wheels on a machine with network, carry the folder)"
fi

if [[ $DRY == 1 ]] || have pytest; then
    # The parts that need no Ray and no vLLM, on this machine's torch, transformers and peft.
    step cpu-layers 70 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" \
        tests/test_algos.py tests/test_algos_2025.py tests/test_rollout_correction.py tests/test_layout.py \
        tests/test_packing.py tests/test_chunked_logits.py tests/test_engines.py tests/test_token_budget.py
    # Colocation's offload to CPU memory and back, the resharder on nccl, megatron on nccl (one GPU).
    step gpu-tests 60 "$PY" -m pytest -q -p no:cacheprovider -m gpu \
        tests/test_colocation.py \
        tests/test_reshard.py tests/gpu/test_megatron_nccl.py
    # One FSDP2 step (fully_shard over a world of one, nccl) against the torch engine's step.
    step fsdp2-cuda 30 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_fsdp2_cuda.py
else
    skip "cpu-layers, gpu-tests" "no pytest (add it to tests/gpu/wheels)"
fi

if [[ $DRY == 1 ]] || have megatron.core; then
    step megatron-cuda 100 "$PY" tests/gpu/megatron_cuda_check.py --wheels tests/gpu/wheels
else
    skip megatron-cuda "no megatron-core (make gpu-wheels carries it)"
fi

if [[ $DRY == 0 ]] && have vllm; then
    step vllm-sleep 60 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_vllm_sleep.py
else
    skip vllm-sleep "tests/gpu/test_vllm_sleep.py needs the CUDA vLLM package (not carried: too large)"
fi
skip ray "worker groups, the controller and end-to-end runs need Ray (tests/test_workers.py, test_end_to_end.py)"
if [[ $DRY == 1 ]] || (($(cuda_devices) < 2)); then
    skip multi-gpu "nccl tests at tp 2 and vLLM tp 2 (tests/gpu/test_*_nccl.py) need 2 or more GPUs"
fi
[[ $DRY == 0 ]] && echo "logs: $LOG"
exit $FAILED
