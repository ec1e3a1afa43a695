"""programs/evaluate.py and evaluation.evaluate_model on a tiny Hugging Face model: its greedy
accuracy is the run evaluator's, pass@1 and maj@1 are the sample accuracy, a run folder is
resolved to its newest checkpoint, and a k above n fails naming the flags."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import hf_fixtures as fx
from sao_actor_learner import core
from sao_actor_learner.actors.evaluator import evaluate
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.engines import TorchEngine
from sao_actor_learner.evaluation import evaluate_model, resolve_model
from sao_actor_learner.learner.checkpoint_files import checkpoint_path, write_checkpoint
from sao_actor_learner.tasks.registry import task_spec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Correct on about half the responses of a random model, so every metric has something to count.
PARITY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2 == 0)
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evaluate")
    model = fx.tiny_qwen3(str(tmp / "model"))
    rows = fx.gsm_rows(10)
    for i, row in enumerate(rows):
        row["data_source"] = "test/even" if i % 2 == 0 else "test/odd"
    test = fx.write_jsonl(str(tmp / "test.jsonl"), rows)
    (tmp / "reward.py").write_text(PARITY_REWARD)
    return tmp, model, test, f"{tmp}/reward.py:compute_score"


def test_metrics_agree_with_the_run_evaluator_and_with_each_other(setup):
    tmp, model, test, reward = setup
    config = SAOConfig(task="dataset", model=model, train_files=(test,), eval_files=(test,),
                       reward=reward, reward_workers=1, eval_size=10, max_new_tokens=6,
                       max_sequence_length=96, seed=3)
    report = evaluate_model(config, n=4, ks=[1, 2, 4])
    engine = TorchEngine.from_checkpoint(model)
    task = task_spec("dataset").build(config, 0, engine.tokenizer)
    try:
        params = core.SamplingParams(max_new_tokens=6, temperature=0.0,
                                     stop_token_ids=tuple(engine.tokenizer.stop_ids))
        assert report["greedy_accuracy"] == evaluate(engine, task, task.eval_prompts(), params)
    finally:
        task.close()
    assert 0.0 < report["sample_accuracy"] < 1.0          # something to count
    assert report["pass@1"] == pytest.approx(report["sample_accuracy"])
    assert report["maj@1"] == pytest.approx(report["sample_accuracy"])
    assert report["pass@1"] <= report["pass@2"] <= report["pass@4"]
    by_source = report["greedy_accuracy_by_data_source"]
    assert set(by_source) == {"test/even", "test/odd"}
    assert (by_source["test/even"] + by_source["test/odd"]) / 2 == \
        pytest.approx(report["greedy_accuracy"])
    again = evaluate_model(config, n=4, ks=[2])             # seeded samples: the same numbers
    assert again["pass@2"] == report["pass@2"] and again["maj@2"] == report["maj@2"]


def program(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "programs", "evaluate.py"), *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO})


def test_the_program_scores_a_run_folders_newest_checkpoint_and_writes_json(setup):
    tmp, model, test, reward = setup
    run = tmp / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"task": "dataset"}))   # a run's own config

    def write(directory):   # a learner checkpoint's files: the model directory and its state
        for f in os.listdir(model):
            shutil.copy(os.path.join(model, f), directory)
        torch.save({"version": 2}, os.path.join(directory, "learner_state.pt"))
    for step in (1, 2, 3):
        write_checkpoint(checkpoint_path(str(run / "checkpoints"), step), write)
    with open(os.path.join(checkpoint_path(str(run / "checkpoints"), 3), "config.json"), "a") as f:
        f.write(" ")                                        # step 3 no longer matches its manifest
    assert resolve_model(str(run)) == checkpoint_path(str(run / "checkpoints"), 2)
    assert resolve_model(str(run / "checkpoints")) == checkpoint_path(str(run / "checkpoints"), 2)
    out = tmp / "report.json"
    proc = program(f"--model={run}", f"--eval_files={test}", f"--reward={reward}",
                   "--max_new_tokens=4", "--n=2", "--k=1,2", f"--out={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["model"].endswith("step_000002") and report["eval_size"] == 10
    assert {"greedy_accuracy", "pass@1", "pass@2", "maj@1", "maj@2"} <= set(report)
    assert json.loads(proc.stdout) == report


@pytest.mark.parametrize("args, message", [
    (["--n=4", "--k=8"], "--k=8 with --n=4"),
    (["--k=2"], "--k=2 needs samples"),
])
def test_the_program_refuses_k_above_n_naming_the_flags(setup, args, message):
    tmp, model, test, reward = setup
    proc = program(f"--model={model}", f"--eval_files={test}", *args)
    assert proc.returncode != 0 and message in proc.stderr


def test_the_program_refuses_a_folder_that_is_no_model(setup):
    tmp, _, test, _ = setup
    proc = program(f"--model={tmp}", f"--eval_files={test}")
    assert proc.returncode != 0 and "neither a model directory" in proc.stderr
