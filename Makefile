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

.PHONY: venv run test warm-start stubs clean

venv: $(STAMP)

$(STAMP): setup.py protos/*.proto
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=23" "setuptools>=68,<80" wheel
	$(PY) -m pip install -q "torch==2.13.0" "dm-reverb[tensorflow]==0.14.0" "grpcio-tools==1.62.3" \
	    "triton==3.7.1" "pytest>=7" "pytest-timeout>=2"
	$(PY) -m pip install -q --no-build-isolation -e ".[triton,test]"
	$(PY) -m pip check
	touch $(STAMP)

stubs: venv
	$(PY) -c "import setup" 2>/dev/null || $(PY) -c "exec(open('setup.py').read().split('class BuildPyWithStubs')[0]); generate_stubs()"

$(WARM_START)/config.json: | $(STAMP)
	$(PY) programs/sft.py --task=arithmetic --out_dir=$(WARM_START)

warm-start: $(WARM_START)/config.json

run: venv warm-start
	$(PY) programs/sao.py --task=arithmetic --init_checkpoint=$(WARM_START) --run_dir=$(RUN_DIR)

test: venv warm-start
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info sao_actor_learner/protos_gen runs
