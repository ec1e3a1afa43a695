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
