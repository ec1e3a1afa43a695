"""The staleness tuner's recommendation rule (experiments/staleness/recommend.py) on synthetic
measurements, and its grid of limits."""
import pytest

from experiments.staleness.recommend import LimitMeasurement, Rule, noise_band, recommend
from experiments.staleness.tuner import parse_limits
from sao_actor_learner.config import ConfigError


def _m(limit, rps, kl=0.001, ess=0.99, alarms=0.0, learning=(5.0, 5.2, 4.8)):
    return LimitMeasurement(limit, [rps, rps], [kl], [ess], [alarms], list(learning),
                            [0.5] * len(learning))


GRID = {0: 10.0, 1: 15.0, 2: 19.5, 4: 20.0, 8: 20.1}


def test_the_smallest_limit_within_five_percent_of_the_best_is_recommended():
    rec = recommend([_m(k, v) for k, v in GRID.items()])
    # 19.5 >= 0.95 * 20.1; 15 is not
    assert rec.limit == 2
    assert [k for k, v in rec.verdicts.items() if v["throughput_ok"]] == [2, 4, 8]
    assert "smallest" in rec.why and "5%" in rec.rule
    assert recommend([_m(k, v) for k, v in GRID.items()], Rule(throughput_tolerance=0.3)).limit == 1


def test_a_limit_whose_drift_crosses_the_alarms_is_passed_over():
    ms = [_m(k, v, kl=0.5 if k == 2 else 0.001) for k, v in GRID.items()]
    rec = recommend(ms)
    assert rec.limit == 4 and not rec.verdicts[2]["drift_ok"]
    ms = [_m(k, v, ess=0.1 if k in (2, 4) else 0.99) for k, v in GRID.items()]
    assert recommend(ms).limit == 8
    ms = [_m(k, v, alarms=0.5 if k == 2 else 0.0) for k, v in GRID.items()]
    assert recommend(ms).limit == 4
    assert recommend(ms, Rule(max_alarm_frac=0.6)).limit == 2


def test_a_limit_that_learns_less_per_rollout_than_lockstep_noise_allows_is_passed_over():
    # lock-step 5.0 +- t(2) * 0.2 / sqrt(3) ~ 5.0 +- 0.50: 4.0 is below the band, 4.8 inside
    ms = [_m(k, v, learning=(4.0, 4.1, 3.9) if k in (2, 4) else (4.8, 4.9, 4.7) if k == 8
             else (5.0, 5.2, 4.8)) for k, v in GRID.items()]
    rec = recommend(ms)
    assert rec.limit == 8
    assert rec.lockstep_band["mean"] == pytest.approx(5.0)
    assert rec.lockstep_band["half"] == pytest.approx(4.302653 * 0.2 / 3 ** 0.5, rel=1e-4)
    assert not rec.verdicts[2]["learning_ok"] and rec.verdicts[8]["learning_ok"]


def test_when_no_limit_passes_the_fastest_safe_one_is_recommended():
    ms = [_m(k, v, kl=1.0 if k >= 2 else 0.001) for k, v in GRID.items()]
    rec = recommend(ms)
    assert rec.limit == 1 and "no limit passes" in rec.why
    # only lock-step is safe: lock-step
    ms = [_m(k, v, kl=1.0 if k >= 1 else 0.0) for k, v in GRID.items()]
    assert recommend(ms).limit == 0


def test_the_noise_band_of_one_repeat_is_its_slopes_standard_error():
    one = LimitMeasurement(0, [1.0], learning=[3.0], learning_se=[0.5])
    assert noise_band(one) == pytest.approx({"mean": 3.0, "half": 0.98, "low": 2.02})
    assert noise_band(LimitMeasurement(0, [1.0], learning=[3.0])) is None
    # without a band, learning is not compared: throughput and drift decide
    ms = [LimitMeasurement(0, [10.0], learning=[3.0]), LimitMeasurement(2, [20.0],
                                                                       learning=[-9.0])]
    rec = recommend(ms)
    assert rec.limit == 2 and rec.lockstep_band is None


def test_bad_measurements_fail():
    with pytest.raises(ValueError, match="no limits measured"):
        recommend([])
    with pytest.raises(ValueError, match="no lock-step"):
        recommend([_m(1, 10.0), _m(2, 12.0)])
    with pytest.raises(ValueError, match="no finite rollouts/s"):
        recommend([_m(0, 10.0), LimitMeasurement(1, [float("nan")])])
    with pytest.raises(ValueError, match="--throughput_tolerance"):
        Rule(throughput_tolerance=1.5)


def test_the_grid_always_holds_lockstep_and_refuses_no_limit():
    assert parse_limits(["lockstep", "4", "1", "4"]) == [0, 1, 4]
    assert parse_limits(["2"]) == [0, 2]
    with pytest.raises(ConfigError, match="--limits is empty"):
        parse_limits([])
    with pytest.raises(ConfigError, match="--limits is empty"):
        parse_limits(["", " "])
    with pytest.raises(ConfigError, match="--limits entry '-1'"):
        parse_limits(["-1"])
    with pytest.raises(ConfigError, match="--limits entry 'fast'"):
        parse_limits(["fast"])


def _fake_run(config, rollouts_per_s):
    """A finished run's folder with the files the tuner reads: train rows at the given
    throughput, one generate call, an evaluation at the start and the end."""
    import json
    import os
    os.makedirs(config.run_dir, exist_ok=True)
    b, dt = config.batch_size, config.batch_size / rollouts_per_s
    with open(os.path.join(config.run_dir, "generate_calls_actor_0.jsonl"), "w") as f:
        f.write(json.dumps({"t0": 100.0, "t1": 100.1, "n": 4, "tokens": 12,
                            "lengths": [3, 3, 3, 3]}) + "\n")
    with open(os.path.join(config.run_dir, "metrics.jsonl"), "w") as f:
        for v, acc in ((0, 0.4), (config.max_steps, 0.6)):
            f.write(json.dumps({"kind": "eval", "policy_version": v, "eval_accuracy": acc}) + "\n")
        for step in range(1, config.max_steps + 1):
            hist = [0] * (config.max_staleness + 1)
            hist[-1] = b
            f.write(json.dumps({
                "kind": "train", "step": step, "policy_version": step, "time": 100.0 + step * dt,
                "rollouts_trained": step * b, "tokens_per_s": 10.0 * b / dt, "step_time_s": dt,
                "wait_s": 0.1 * dt, "publish_s": 0.01, "batch_size": b,
                "response_length_mean": 3.0, "staleness_hist": hist,
                "staleness_rollout_mean": float(config.max_staleness),
                "kl_rollout": 0.001 * config.max_staleness, "ess": 0.99,
                "dis_masked_frac": 0.0, "reward_mean": 0.1 * step + 0.01 * (step % 2),
                "drift_alarm_kl_high": 0}) + "\n")
    summary = {"steps": config.max_steps, "dropped_stale": 0}
    with open(os.path.join(config.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f)
    with open(os.path.join(config.run_dir, "config.json"), "w") as f:
        f.write(config.to_json())
    return summary


def test_the_tuner_measures_every_limit_and_leaves_a_failed_run_out(tmp_path):
    import io
    from experiments.staleness import report, tuner
    from sao_actor_learner.config import SAOConfig
    speed = {0: 10.0, 1: 16.0, 2: 19.8, 4: 20.0}
    ran = []

    def run_fn(config):
        ran.append(config.run_dir)
        if config.max_staleness == 4 and config.seed == 1:
            raise RuntimeError("node crashed")
        return _fake_run(config, speed[config.max_staleness] * (1 + 0.01 * config.seed))

    base = SAOConfig(batch_size=8, actor_batch=4, num_actors=1, max_steps=6, seed=0)
    result = tuner.tune(base, [0, 1, 2, 4], 2, str(tmp_path), run_fn, progress=False)
    assert len(ran) == 8 and len(result.failed) == 1 and "node crashed" in result.failed[0]
    assert result.limits == [0, 1, 2, 4] and result.summary[4]["repeats"] == 1
    assert result.summary[1]["rollouts_per_s"]["mean"] == pytest.approx(16.0 * 1.005)
    assert result.summary[2]["staleness_hist"] == [0, 0, 2 * 6 * 8]     # 2 repeats x 6 steps
    assert result.summary[0]["heldout_gain_per_1k"]["mean"] == pytest.approx(200 / 48)
    assert result.summary[0]["learning"]["mean"] == pytest.approx(1000 * 0.1 / 8, rel=0.05)
    assert result.recommendation.limit == 2           # 19.8 * 1.005 >= 0.95 * 20.0
    text = report.tune_markdown(result, [])
    assert "1 run(s) failed" in text and "| 0 (lock-step) |" in text
    # the next invocation reads the finished runs and runs the failed one again
    ran.clear()
    out = io.StringIO()
    runs, failed = tuner.run_grid(base, [0, 1, 2, 4], 2, str(tmp_path), run_fn, out=out)
    assert ran == [str(tmp_path / "runs" / "eta4_r1")] and len(failed) == 1
    assert out.getvalue().count("done earlier, read") == 7
