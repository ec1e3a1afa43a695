#!/usr/bin/env bash
# One prepared device check for sao_actor_learner.kernels on a lent GPU (H200: torch 2.11,
# triton 3.6, no reverb/TensorFlow; nothing to install). From the repository root:
#
#     bash programs/benchmarks/gpu_kernels.sh            # writes to $OUT (or ./gpu_kernels_out)
#
# 1. a preflight import: the kernels package and the two references import with torch alone
#    (no reverb, tensorflow or grpc) and Triton sees the GPU;
# 2. tests/kernels/test_kernels.py on CUDA with compiled Triton kernels (TRITON_INTERPRET unset);
# 3. programs/benchmarks/kernels.py, the full grid (N in {8k, 32k}, H in {2048, 4096},
#    V=151936, bf16), JSON to $OUT/kernels.json.
# Each step has its own time limit (about 9 minutes in all); a failing step does not stop the
# next one, and the script exits non-zero if any failed. Logs: $OUT/*.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu_kernels_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
status=0

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv \
    >"$OUT/nvidia_smi.log" 2>&1 || true

echo "== preflight"
timeout 120 "$PY" - <<'EOF' 2>&1 | tee "$OUT/preflight.log" || status=1
import sys
import torch
import sao_actor_learner.kernels as K
from sao_actor_learner.learner import advantages, losses  # noqa: F401
heavy = [m for m in ("reverb", "tensorflow", "grpc") if m in sys.modules]
assert not heavy, f"imported {heavy}"
assert "triton" not in sys.modules, "triton imported before a Triton kernel ran"
assert torch.cuda.is_available(), "no CUDA device visible"
assert K.triton_available("cuda"), "Triton cannot run on this GPU"
import triton
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
EOF

echo "== tests (CUDA, compiled Triton)"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_kernels.py -rs \
    2>&1 | tee "$OUT/test_kernels.log" || status=1

echo "== benchmark"
timeout 300 "$PY" programs/benchmarks/kernels.py --out_json="$OUT/kernels.json" "$@" \
    2>&1 | tee "$OUT/bench.log" || status=1

echo "== done (status $status); files in $OUT"
exit $status
