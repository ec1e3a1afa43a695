"""Lock-step (synchronous) training, config `lockstep`: the baseline that asynchronous
SAO is benchmarked against (programs/benchmarks/async_vs_sync.py).

Lock-step means: at step v+1 the learner trains exactly the B rollouts generated with version v,
and actors generate nothing else with version v, so while the learner trains (all B version-v
rollouts delivered, admission full until v+1 is published) they are idle. The whole program
runs (real processes, Reverb, gRPC); each actor's engine logs its generate calls.
"""
import collections

import pytest

from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.observers import read_metrics
from experiments.benchmarks.generate_log import (make_program_with_generate_log,
                                                      read_generate_calls)
from sao_actor_learner.run import run_program


def _config(warm_start, run_dir, **overrides):
    base = dict(init_checkpoint=warm_start, run_dir=str(run_dir), max_steps=5, batch_size=8,
                num_actors=2, actor_batch=4, eval_every=0, eval_size=20, launch="local_mp",
                actor_delay="uniform", actor_delay_mean_s=0.02)
    base.update(overrides)
    return SAOConfig(**base)


def _generated_per_version(run_dir):
    calls = [c for cs in read_generate_calls(run_dir).values() for c in cs]
    per_version = collections.Counter()
    for c in calls:
        assert c["version"] == c["version_end"], c   # no weight switch inside a call
        per_version[c["version"]] += c["n"]
    return calls, per_version


def test_lockstep_generates_one_batch_per_version_and_trains_it_at_the_next_step(warm_start,
                                                                                  tmp_path):
    config = _config(warm_start, tmp_path / "run", lockstep=True)
    assert config.max_staleness == 0
    summary = run_program(config, make_program_with_generate_log, progress=False)
    B, steps = config.batch_size, config.max_steps
    train = read_metrics(config.run_dir, "train")
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    # The learner trains, at step v+1, only rollouts generated with version v: staleness 0.
    for row in train:
        assert row["staleness_hist"] == [B], row
        assert row["staleness_max"] == 0 and row["staleness_mean"] == 0.0
    assert summary["dropped_stale"] == 0
    # Actors generate exactly one batch with each version the learner trains on (version
    # `steps` is the final one: its batch may be under way when the run stops), so once the
    # learner has its B rollouts of version v nothing more is generated until v+1 is published.
    calls, per_version = _generated_per_version(config.run_dir)
    assert calls, "the recording engine logged no generate calls"
    assert set(per_version) <= set(range(steps + 1))
    for v in range(steps):
        assert per_version[v] == B, (v, dict(per_version))
    assert per_version[steps] <= B
    # No generation with version <= v overlaps the learner's training of step v+1 (the part of
    # the step after it stopped waiting for rollouts: collate, update, publish).
    for row in train:
        train_start = row["time"] - row["step_time_s"] * (1.0 - row["learner_wait_frac"])
        for c in calls:
            if c["version"] < row["step"]:
                assert c["t1"] <= train_start + 1e-3, (row["step"], c)


def test_async_generates_ahead_where_lockstep_does_not(warm_start, tmp_path):
    # The contrast that shows the checks above can fail: with max_staleness=2 actors start up to
    # 3 batches with version 0 while the learner is still on its first step. (weight_sync_mode
    # off, the default, said explicitly: each call keeps one version, as the per-call count
    # assumes.)
    config = _config(warm_start, tmp_path / "run", max_staleness=2, max_steps=3,
                     weight_sync_mode="off")
    run_program(config, make_program_with_generate_log, progress=False)
    _, per_version = _generated_per_version(config.run_dir)
    assert max(per_version.values()) > config.batch_size, dict(per_version)
    train = read_metrics(config.run_dir, "train")
    assert any(r["staleness_max"] > 0 for r in train), [r["staleness_hist"] for r in train]


@pytest.mark.parametrize("overrides, message", [
    (dict(max_staleness=3), "lockstep=True with max_staleness=3"),
    (dict(admission_control=False), "admission_control=False"),
    (dict(forced_staleness=0, max_staleness=0), "forced_staleness=0"),
])
def test_lockstep_config_errors_name_the_conflicting_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        SAOConfig(lockstep=True, **overrides)


def test_lockstep_sets_max_staleness_zero_and_round_trips():
    config = SAOConfig(lockstep=True)
    assert config.max_staleness == 0
    assert SAOConfig.from_json(config.to_json()) == config
    assert SAOConfig().lockstep is False and SAOConfig().max_staleness == 4
