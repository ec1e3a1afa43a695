#!/usr/bin/env bash
# The GPU recipe's end-to-end check (docs/GPU.md): SAO on a 0.5B-1.5B instruct model with vLLM
# actors, bf16, FSDP2 learner ranks and --placement of the groups on GPUs, then the export and
# the evaluation of what it trained. From the repository root, after `make venv vllm-env`:
#
#     bash programs/gpu_check.sh /path/to/Qwen2.5-0.5B-Instruct     # a GPU machine, >= 2 GPUs
#     GPU_CHECK_MODE=cpu bash programs/gpu_check.sh                 # the same steps on CPU
#
# GPU mode: the actors' vLLM servers on GPU 0, one learner rank on each other GPU
# (--learners=N-1 --learner_strategy=fsdp2 --placement=actor:gpu0,learner:gpu1-(N-1)), the
# policy step in bf16 autocast (--dtype=bfloat16), the arith_qa dataset
# (programs/make_arith_dataset.py), STEPS (20) steps of 32 rollouts; a few minutes.
# CPU mode (tests/entry_points/test_gpu_check.py): a tiny Qwen3 made on the spot
# (programs/make_tiny_model.py), two FSDP2 ranks on gloo, --placement=actor:cpu0,learner:cpu1,
# vLLM-CPU actors when .venv-vllm exists (else ENGINE=torch), 2 steps of 4 rollouts; the two
# evaluations use the torch engine there (EVAL_ENGINE; vLLM in GPU mode).
#
# Steps: 1. data (and the tiny model); 2. programs/evaluate.py on the model before training;
# 3. programs/sao.py with the recipe's flags; 4. programs/export_model.py of the run's final
# checkpoint; 5. programs/evaluate.py on the export (greedy, pass@k, maj@k); 6. a check that
# every step did what it should, written to $OUT/gpu_check.json. Each step has its own time
# limit; the script stops at the first failure and exits non-zero. Logs: $OUT/*.log.
# Environment: OUT (default ./gpu_check_out; its run, export and data emptied first), PYTHON
# (.venv/bin/python), ENGINE (vllm), EVAL_ENGINE, STEPS, and EXTRA_FLAGS (more programs/sao.py
# flags, e.g. --gradient_checkpointing).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE="${GPU_CHECK_MODE:-gpu}"
OUT="${OUT:-$PWD/gpu_check_out}"
PY="${PYTHON:-.venv/bin/python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
rm -rf "$OUT/run" "$OUT/export" "$OUT/data"
mkdir -p "$OUT"

if [ "$MODE" = "gpu" ]; then
    MODEL="${1:-${MODEL:-}}"
    [ -n "$MODEL" ] || { echo "usage: bash programs/gpu_check.sh MODEL_DIR (a local 0.5B-1.5B instruct model)"; exit 2; }
    GPUS="$(nvidia-smi --list-gpus 2>/dev/null | wc -l)"
    if [ "$GPUS" -lt 2 ]; then
        echo "gpu_check: $GPUS GPU(s) visible; the recipe puts the actors' vLLM on GPU 0 and the learner ranks on the others (needs >= 2; docs/GPU.md)"; exit 2
    fi
    LEARNERS=$((GPUS - 1))
    ENGINE="${ENGINE:-vllm}"
    STEPS="${STEPS:-20}"
    PLACEMENT="actor:gpu0,learner:gpu1"
    [ "$LEARNERS" -eq 1 ] || PLACEMENT="actor:gpu0,learner:gpu1-$((GPUS - 1))"
    SIZES=(--batch_size=32 --actor_batch=32 --max_new_tokens=24 --max_sequence_length=128
           --eval_size=100 --eval_every=10 --policy_lr=1e-6 --critic_lr=5e-6
           --threads_per_process=4)
    EVAL_SAMPLES=(--n=8 --k=1,4,8 --max_new_tokens=24)
    EVAL_ENGINE="${EVAL_ENGINE:-$ENGINE}"
    DATA=(--num_train=4000 --num_test=200)
    LIMIT=900
elif [ "$MODE" = "cpu" ]; then
    MODEL="$OUT/tiny_model"
    [ -f "$MODEL/config.json" ] || timeout 300 "$PY" programs/make_tiny_model.py --out_dir="$MODEL" \
        --vocab_size=600 --hidden_size=64 --num_layers=2 --num_heads=2 --num_kv_heads=1 \
        --head_dim=32 --intermediate_size=128 --max_position_embeddings=512 >"$OUT/model.log" 2>&1
    LEARNERS=2
    if [ -z "${ENGINE:-}" ]; then
        if [ -x .venv-vllm/bin/python ]; then ENGINE=vllm; else ENGINE=torch; fi
    fi
    STEPS="${STEPS:-2}"
    PLACEMENT="actor:cpu0,learner:cpu1"
    # (nproc would read OMP_NUM_THREADS)
    [ "$("$PY" -c 'import os; print(len(os.sched_getaffinity(0)))')" -ge 2 ] || PLACEMENT=""
    SIZES=(--batch_size=4 --actor_batch=4 --max_new_tokens=8 --max_sequence_length=64
           --eval_size=8 --eval_every=2 --policy_lr=1e-4 --critic_lr=5e-4
           --threads_per_process=1 --vllm_kv_cache_gb=1)
    EVAL_SAMPLES=(--n=2 --k=1,2 --max_new_tokens=8 --eval_size=8)
    EVAL_ENGINE="${EVAL_ENGINE:-torch}"      # one vLLM start (the actor's) on a small CPU box
    DATA=(--num_train=64 --num_test=16)
    LIMIT=600
else
    echo "GPU_CHECK_MODE=$MODE: gpu or cpu"; exit 2
fi
echo "gpu_check: mode $MODE, model $MODEL, engine $ENGINE, $LEARNERS learner rank(s), placement '$PLACEMENT', $STEPS steps; logs in $OUT"

echo "== 1. data"
timeout 120 "$PY" programs/make_arith_dataset.py --out_dir="$OUT/data" "${DATA[@]}" 2>&1 | tee "$OUT/data.log"
DATA_FLAGS=(--eval_files="$OUT/data/test.parquet" --reward=final_number)

echo "== 2. evaluate the model before training"
timeout "$LIMIT" "$PY" programs/evaluate.py --model="$MODEL" "${DATA_FLAGS[@]}" \
    "${EVAL_SAMPLES[@]}" --engine="$EVAL_ENGINE" --out="$OUT/eval_before.json" >"$OUT/eval_before.log" 2>&1 \
    || { tail -30 "$OUT/eval_before.log"; exit 1; }

echo "== 3. SAO: $ENGINE actors, bf16, fsdp2 x $LEARNERS, placement '$PLACEMENT'"
timeout "$LIMIT" "$PY" programs/sao.py --task=dataset --model="$MODEL" \
    --train_files="$OUT/data/train.parquet" "${DATA_FLAGS[@]}" \
    --engine="$ENGINE" --dtype=bfloat16 --learners="$LEARNERS" --learner_strategy=fsdp2 \
    ${PLACEMENT:+--placement="$PLACEMENT"} --num_actors=1 --evaluator=node \
    --max_steps="$STEPS" "${SIZES[@]}" --checkpoint_every=0 --noprogress \
    --run_dir="$OUT/run" ${EXTRA_FLAGS:-} >"$OUT/sao.log" 2>&1 \
    || { tail -40 "$OUT/sao.log"; exit 1; }

echo "== 4. export the final checkpoint"
timeout 600 "$PY" programs/export_model.py --model="$OUT/run" --out_dir="$OUT/export" \
    >"$OUT/export.log" 2>&1 || { tail -30 "$OUT/export.log"; exit 1; }

echo "== 5. evaluate the export"
timeout "$LIMIT" "$PY" programs/evaluate.py --model="$OUT/export" "${DATA_FLAGS[@]}" \
    "${EVAL_SAMPLES[@]}" --engine="$EVAL_ENGINE" --out="$OUT/eval_after.json" >"$OUT/eval_after.log" 2>&1 \
    || { tail -30 "$OUT/eval_after.log"; exit 1; }

echo "== 6. check"
"$PY" - "$OUT" "$STEPS" "$LEARNERS" "$ENGINE" "$MODE" <<'EOF'
import json, os, sys
out, steps, learners, engine, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
load = lambda *p: json.load(open(os.path.join(out, *p)))
summary, config = load("run", "summary.json"), load("run", "config.json")
before, after, export = load("eval_before.json"), load("eval_after.json"), load("export", "export.json")
problems = []
if summary["steps"] != steps:
    problems.append(f"trained {summary['steps']} steps, not {steps}")
for key, want in (("engine", engine), ("dtype", "bfloat16"), ("learners", learners),
                  ("learner_strategy", "fsdp2")):
    if config[key] != want:
        problems.append(f"config {key}={config[key]!r}, not {want!r}")
if export["step"] != steps:
    problems.append(f"exported step {export['step']}, not the final {steps}")
for name, report in (("before", before), ("after", after)):
    missing = {"greedy_accuracy", "pass@1", "maj@1"} - set(report)
    if missing:
        problems.append(f"eval_{name}.json lacks {sorted(missing)}")
result = {"mode": mode, "engine": engine, "learners": learners, "steps": summary["steps"],
          "placement": config.get("placement"), "wall_time_s": summary.get("wall_time_s"),
          "run_eval_accuracy": [summary.get("initial_eval_accuracy"),
                                summary.get("final_eval_accuracy")],
          "greedy_accuracy_before": before["greedy_accuracy"],
          "greedy_accuracy_after": after["greedy_accuracy"],
          "pass_at_1_after": after["pass@1"], "problems": problems, "ok": not problems}
json.dump(result, open(os.path.join(out, "gpu_check.json"), "w"), indent=2)
print(json.dumps(result, indent=2))
sys.exit(1 if problems else 0)
EOF
echo "== done: $OUT/gpu_check.json"
