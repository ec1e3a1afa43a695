#!/usr/bin/env bash
# One prepared device check for the learner on a lent GPU (H200: torch, triton, transformers;
# no reverb/TensorFlow, so the learner runs in-process, without replay). From the repository
# root:
#
#     bash programs/benchmarks/gpu_learner.sh            # writes to $OUT (or ./gpu_learner_out)
#
# 1. preflight: the learner's modules import with torch alone (no reverb, tensorflow or grpc)
#    and CUDA is visible;
# 2. programs/benchmarks/learner_step.py on a Qwen3-0.6B-shaped random-init model in bf16,
#    batch 8 x 1024 tokens, micro-batches of 0 (whole batch) and 4096 tokens: step time,
#    tokens/s, peak memory, MFU against the H200's 989 TFLOP/s dense bf16;
#    then packed vs padded micro-batches (micro_batch_layout) on the gsm_tiny length mix;
# 3. the kernel benchmarks (programs/benchmarks/kernels.py, the full grid);
# 4. the data-parallel path on NCCL with every visible GPU as a rank: tests/learner/test_learner_group.py
#    's equality of a 2-rank DDP / FSDP2 step with the single-process step (gloo there; NCCL
#    here through LEARNER_GROUP_BACKEND=nccl), when two GPUs or more are visible.
# Each step has its own time limit (about 9 minutes in all); a failing step does not stop the
# next one, and the script exits non-zero if any failed. Logs: $OUT/*.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu_learner_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" HF_HUB_OFFLINE=1
status=0

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv \
    >"$OUT/nvidia_smi.log" 2>&1 || true

echo "== preflight"
timeout 120 "$PY" - <<'EOF' 2>&1 | tee "$OUT/preflight.log" || status=1
import sys
import torch
from sao_actor_learner.builder import assemble_learner  # noqa: F401
from sao_actor_learner.learner import distributed, estimators, policy  # noqa: F401
heavy = [m for m in ("reverb", "tensorflow", "grpc") if m in sys.modules]
assert not heavy, f"imported {heavy}"
assert torch.cuda.is_available(), "no CUDA device visible"
print("torch", torch.__version__, torch.cuda.device_count(), "x", torch.cuda.get_device_name())
EOF

echo "== learner step (Qwen3-0.6B shape, bf16)"
timeout 300 "$PY" programs/benchmarks/learner_step.py --device=cuda --sizes=small,qwen3-0.6b \
    --dtypes=bfloat16 --micro_batch_tokens=0,4096 --batch=8 --seq_len=1024 --steps=3 \
    2>&1 | tee "$OUT/learner_step.log" || status=1

echo "== packed vs padded micro-batches (gsm_tiny length mix, bf16; per-rollout sdpa)"
timeout 120 "$PY" programs/benchmarks/learner_step.py --device=cuda --sizes=small,25m \
    --dtypes=bfloat16 --micro_batch_tokens=0 --layouts=padded,packed --batch=32 \
    --lengths_file=results/learner_step/gsm_tiny_lengths.json --steps=3 \
    2>&1 | tee "$OUT/learner_step_packing.log" || status=1

echo "== kernel benchmarks"
timeout 180 "$PY" programs/benchmarks/kernels.py --out_json="$OUT/kernels.json" \
    2>&1 | tee "$OUT/kernels.log" || status=1

if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    echo "== learner group on NCCL"
    LEARNER_GROUP_BACKEND=nccl timeout 120 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
        tests/learner/test_learner_group.py -k "equals_the_single_process" 2>&1 \
        | tee "$OUT/learner_group.log" || status=1
else
    echo "== learner group on NCCL: skipped (one GPU visible)" | tee "$OUT/learner_group.log"
fi

echo "== done (status $status); files in $OUT"
exit $status
