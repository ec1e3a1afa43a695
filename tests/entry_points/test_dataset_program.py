"""The whole program on a dataset task with a Hugging Face (BPE, chat-template) model."""
import json
import os

import pytest

import hf_fixtures as fx
from sao_actor_learner.builder import make_program
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.models import load_policy
from sao_actor_learner.observers import read_metrics
from sao_actor_learner.run import run_program

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Raises on every response of odd length: about half the calls.
FLAKY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if len(solution_str) % 2:
        raise ValueError("odd")
    return {"score": float(ground_truth in solution_str), "chars": len(solution_str)}
"""


@pytest.mark.timeout(600)
def test_a_dataset_run_trains_evaluates_with_pass_at_k_and_counts_reward_failures(tmp_path):
    model = fx.tiny_qwen3(str(tmp_path / "model"))
    train = fx.write_parquet(str(tmp_path / "train.parquet"), fx.gsm_rows(64))
    test = fx.write_jsonl(str(tmp_path / "test.jsonl"), fx.gsm_rows(12, start=500))
    (tmp_path / "reward.py").write_text(FLAKY_REWARD)
    config = SAOConfig(task="dataset", model=model, train_files=(train,), eval_files=(test,),
                       reward=f"{tmp_path}/reward.py:compute_score", reward_workers=1,
                       run_dir=str(tmp_path / "run"), max_steps=4, batch_size=8, actor_batch=4,
                       num_actors=2, eval_size=12, eval_every=2, eval_pass_k=2,
                       max_new_tokens=16, max_sequence_length=96, launch="local_mp")
    summary = run_program(config, make_program, progress=False)
    assert summary["steps"] == 4 and summary["rollouts_trained"] == 32
    assert summary["preflight"]["train_rows"] == 64 and summary["preflight"]["eval_rows"] == 12
    counters = summary["env_counters"]
    assert counters["reward_calls"] == counters["episodes"] >= 32
    assert 0 < counters["reward_failed_raised"] < counters["reward_calls"]
    assert counters["reward_chars"] > 0           # the reward's extra metric, summed
    evals = read_metrics(config.run_dir, "eval")
    assert [r["policy_version"] for r in evals][0] == 0 and evals[-1]["policy_version"] == 4
    assert all(0.0 <= r["eval_pass_at_2"] <= 1.0 and r["eval_size"] == 12 for r in evals)
    train_rows = read_metrics(config.run_dir, "train")
    assert max(r["staleness_max"] for r in train_rows) <= config.max_staleness
    # The final checkpoint is a model directory of the same kind: tokenizer and chat template.
    ckpt = os.path.join(config.run_dir, "checkpoints", "step_000004")
    policy, tok = load_policy(ckpt)
    assert tok.stop_ids == load_policy(model)[1].stop_ids and tok.has_chat_template
    with open(os.path.join(ckpt, "config.json")) as f:
        assert json.load(f)["tie_word_embeddings"] is True
