"""Forced staleness lag distributions (actors/lags.py, docs/USAGE.md "Drift lab"): the exact
pmf has the asked mean, many seeded draws match it (mean within a bound from the sample size,
every bin within a binomial bound), draws are deterministic per seed and never above
max_staleness, the actor's weight following loads version P - lag for each admitted batch, and
bad input fails before launch naming the flags."""
import math
import threading

import pytest

from sao_actor_learner.actors.engine_weights import EngineWeights
from sao_actor_learner.actors.lags import LagSampler, lag_pmf
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.services import server_keep_versions

DRAWS = 20_000
CASES = [("geometric", 1, 2.5, 3), ("geometric", 8, 2.5, 32), ("zipf", 2, 2.5, 8),
         ("zipf", 8, 2.5, 64), ("zipf", 8, 4.0, 32)]


@pytest.mark.parametrize("dist,k,alpha,max_lag", CASES)
def test_many_draws_match_the_distribution_with_mean_k(dist, k, alpha, max_lag):
    pmf = lag_pmf(dist, k, alpha, max_lag)
    assert len(pmf) == max_lag + 1 and math.isclose(sum(pmf), 1.0, abs_tol=1e-12)
    assert sum(i * p for i, p in enumerate(pmf)) == pytest.approx(k, abs=1e-9)
    assert all(p > 0 for p in pmf)            # every lag up to max_staleness can happen
    assert all(a > b for a, b in zip(pmf, pmf[1:]))   # both laws decrease with the lag
    sampler = LagSampler(dist, k, alpha, max_lag, seed=(0, 1, "lags"))
    draws = [sampler.draw() for _ in range(DRAWS)]
    assert min(draws) >= 0 and max(draws) <= max_lag
    sd = math.sqrt(sampler.variance)
    # the sample mean within 5 standard errors of k (fixed seed: deterministic)
    assert abs(sum(draws) / DRAWS - k) < 5 * sd / math.sqrt(DRAWS)
    for lag, p in enumerate(pmf):              # every bin within 5 binomial standard deviations
        count = draws.count(lag)
        assert abs(count - DRAWS * p) <= 5 * math.sqrt(DRAWS * p * (1 - p)) + 1, (lag, count)
    again = LagSampler(dist, k, alpha, max_lag, seed=(0, 1, "lags"))
    assert [again.draw() for _ in range(DRAWS)] == draws
    other = LagSampler(dist, k, alpha, max_lag, seed=(0, 2, "lags"))
    assert [other.draw() for _ in range(200)] != draws[:200]


def test_zipf_has_a_heavier_tail_than_geometric_at_the_same_mean():
    geo, zipf = lag_pmf("geometric", 8, 0, 64), lag_pmf("zipf", 8, 2.5, 64)
    # beyond 6k the power law keeps > 5x the geometric's mass (measured: 6.0x at 49..64)
    assert sum(zipf[49:]) > 5 * sum(geo[49:]) and sum(zipf[33:]) > 2 * sum(geo[33:])
    assert zipf[0] > geo[0]   # and more mass at no lag: same mean, more spread


def test_constant_and_zero_mean_are_one_lag():
    assert lag_pmf("constant", 3, 2.5, 4) == [0, 0, 0, 1.0, 0]
    assert lag_pmf("geometric", 0, 2.5, 4) == [1.0, 0, 0, 0, 0]
    sampler = LagSampler("zipf", 0, 2.5, 4)
    assert {sampler.draw() for _ in range(100)} == {0}


class Variables:
    """What EngineWeights asks of the actor's variable client, over versions 0..newest."""

    def __init__(self, newest):
        self.newest, self.fetched = newest, []

    def update(self):
        pass

    def update_and_wait(self):
        pass

    def wait_for_version(self, version):
        assert version <= self.newest

    def get_variables(self):
        return self.newest, {"v": self.newest}

    def fetch_version(self, version):
        self.fetched.append(version)
        return {"v": version}


class Engine:
    weight_sync_mode = "off"

    def __init__(self):
        self.version, self.loaded = -1, []

    def load_weights(self, state_dict, version):
        assert state_dict == {"v": version}
        self.version = version
        self.loaded.append(version)


def test_each_admitted_batch_runs_version_p_minus_its_own_lag():
    engine, variables = Engine(), Variables(newest=0)
    sampler = LagSampler("geometric", 2, 2.5, 6, seed=7)
    weights = EngineWeights(engine, variables, decode=lambda p: p, forced_staleness=2,
                            poll_s=0.05, stop=threading.Event(), lags=sampler)
    assert not weights.feeding
    twin = LagSampler("geometric", 2, 2.5, 6, seed=7)
    expected = []
    for p in range(40):
        variables.newest = p
        weights.catch_up(p)
        lag = twin.draw()
        expected.append(max(0, p - lag))
        assert engine.version == expected[-1]
    assert sum(weights.lag_hist) == 40 and len(weights.lag_hist) == 7
    assert len(set(expected[10:])) > 1 and len({p - v for p, v in enumerate(expected)}) > 2


def test_bad_lag_input_fails_before_launch_naming_the_flags():
    with pytest.raises(ConfigError, match="forced_staleness_distribution='geometric' with "
                       "forced_staleness=-1.*set --forced_staleness"):
        SAOConfig(forced_staleness_distribution="geometric")
    with pytest.raises(ConfigError, match="forced_staleness_tail_alpha=2.0.*no finite mean"):
        SAOConfig(forced_staleness_distribution="zipf", forced_staleness=2, max_staleness=16,
                  forced_staleness_tail_alpha=2.0)
    with pytest.raises(ConfigError, match="forced_staleness_tail_alpha=1.5.*alpha > 2"):
        SAOConfig(forced_staleness_distribution="zipf", forced_staleness=2, max_staleness=16,
                  forced_staleness_tail_alpha=1.5)
    with pytest.raises(ConfigError, match="max_staleness=8.*raise max_staleness above 8"):
        SAOConfig(forced_staleness_distribution="geometric", forced_staleness=4, max_staleness=8)
    with pytest.raises(ConfigError, match="forced_staleness_distribution='poisson'.*constant, "
                       "geometric, zipf"):
        SAOConfig(forced_staleness_distribution="poisson", forced_staleness=1)


def test_the_server_keeps_every_version_a_lag_reaches():
    zipf = SAOConfig(forced_staleness_distribution="zipf", forced_staleness=2, max_staleness=9)
    assert server_keep_versions(zipf) == 11
    assert server_keep_versions(SAOConfig(forced_staleness=2, max_staleness=9)) == 4
    assert SAOConfig.from_json(zipf.to_json()) == zipf
