"""The drift knobs recorded (docs/USAGE.md "Drift lab"): config.json, every training row of the
metrics and summary.json carry them, and in a real program each knob reaches the rollouts: the
actors draw their lags from the seeded distribution (one lag per admitted batch), the learner's
staleness histogram shows them, bf16 actors at another temperature give nonzero drift, and the
preference weight of each step is the task's. No learning outcome is asserted."""
import collections
import json
import os

import pytest

from sao_actor_learner.actors.lags import LagSampler
from sao_actor_learner.builder import make_program
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.config.drift import knob_record
from sao_actor_learner.observers import read_metrics
from sao_actor_learner.observers.drift_labels import LabelledMetrics, label_learner_metrics
from sao_actor_learner.run import run_program
from sao_actor_learner.tasks.preference_drift import weight_of_config


class Rows:
    def __init__(self):
        self.rows, self.closed = [], False

    def write(self, row):
        self.rows.append(row)

    def close(self):
        self.closed = True


def test_training_rows_get_the_labels_and_other_rows_do_not():
    config = SAOConfig(task="preference_drift", forced_staleness=1, max_staleness=4,
                       forced_staleness_distribution="zipf", actor_dtype="bfloat16",
                       drift_experiment="sampling_mismatch", drift_actor_top_p=0.95)
    rows = Rows()
    logger = label_learner_metrics(config, rows)
    logger.write({"step": 3, "policy_version": 3, "reward_mean": 0.5})
    logger.write({"kind": "critic_eval", "policy_version": 3})
    logger.close()
    train, other = rows.rows
    assert train["drift_experiment"] == "sampling_mismatch" and train["actor_top_p"] == 0.95
    assert train["forced_staleness_distribution"] == "zipf" and train["actor_dtype"] == "bfloat16"
    assert train["forced_lag_mean"] == pytest.approx(1.0)
    assert train["reward_preference_weight"] == weight_of_config(config)(2)
    assert other == {"kind": "critic_eval", "policy_version": 3} and rows.closed
    plain = label_learner_metrics(SAOConfig(), Rows())
    plain.write({"step": 1, "policy_version": 1})
    assert isinstance(plain, LabelledMetrics)
    assert "reward_preference_weight" not in plain._logger.rows[0]
    assert plain._logger.rows[0]["drift_experiment"] == "none"
    assert "forced_lag_mean" not in plain._logger.rows[0]     # no forced staleness: left out
    assert label_learner_metrics(config, None) is None


def test_every_knob_reaches_the_rollouts_and_the_records(warm_start, tmp_path):
    k, max_staleness, actor_batch, batch_size = 1, 3, 4, 8
    config = SAOConfig(
        init_checkpoint=warm_start, run_dir=str(tmp_path / "run"), max_steps=6,
        batch_size=batch_size, num_actors=2, actor_batch=actor_batch, eval_every=0,
        eval_size=20, launch="local_mp", algorithm="critic_free", task="preference_drift",
        reward_drift_period=8, forced_staleness=k, max_staleness=max_staleness,
        forced_staleness_distribution="geometric", actor_dtype="bfloat16",
        drift_experiment="sampling_mismatch", drift_actor_temperature=0.8)
    summary = run_program(config, make_program, progress=False)
    with open(os.path.join(config.run_dir, "config.json")) as f:
        assert SAOConfig.from_json(f.read()) == config
    # The actors' lags: the first n draws of each actor's seeded sampler (n: those it counted).
    for actor_id in range(config.num_actors):
        with open(os.path.join(config.run_dir, f"actor_{actor_id}_stats.json")) as f:
            hist = json.load(f)["forced_lag_hist"]
        twin = LagSampler("geometric", k, 2.5, max_staleness, seed=(config.seed, actor_id, "lags"))
        drawn = collections.Counter(twin.draw() for _ in range(sum(hist)))
        assert hist == [drawn[lag] for lag in range(max_staleness + 1)]
    train = read_metrics(config.run_dir, "train")
    weight = weight_of_config(config)
    assert [r["step"] for r in train] == list(range(1, config.max_steps + 1))
    for r in train:
        assert sum(r["staleness_hist"]) == batch_size
        assert len(r["staleness_hist"]) == max_staleness + 1 and r["staleness_max"] <= r["step"] - 1
        if r["step"] - 1 >= max_staleness:      # no lag is capped by the version any more:
            # an admitted batch shares one lag, so each staleness comes in whole actor batches
            assert all(n % actor_batch == 0 for n in r["staleness_hist"])
        assert r["kl_rollout"] > 0              # bf16 actors at T=0.8 vs fp32 at T=1
        assert (r["drift_experiment"], r["actor_dtype"], r["actor_temperature"]) == \
            ("sampling_mismatch", "bfloat16", 0.8)
        assert r["forced_staleness_distribution"] == "geometric"
        assert r["forced_lag_mean"] == pytest.approx(k)
        assert r["reward_preference_weight"] == weight(r["step"] - 1)
    knobs = summary["drift_knobs"]
    assert {key: knobs[key] for key in knob_record(config)} == knob_record(config)
    # (the actors' stats files are a snapshot at most ~1 s old: the draws so far, at least one)
    assert sum(knobs["forced_lag_hist"]) > 0 and len(knobs["forced_lag_hist"]) == max_staleness + 1
    assert summary["reward_preference_weight"]["first"] == weight(0)
    with open(os.path.join(config.run_dir, "summary.json")) as f:
        assert json.load(f)["drift_knobs"]["drift_experiment"] == "sampling_mismatch"
