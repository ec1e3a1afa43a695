"""The critic probe's statistics (sao_actor_learner/critic/stats.py) against slow, obvious
versions."""
import numpy as np
import pytest

from sao_actor_learner.critic import stats


def slow_ev(v, r):
    n = len(r)
    mr = sum(r) / n
    var_r = sum((x - mr) ** 2 for x in r) / n
    e = [a - b for a, b in zip(r, v)]
    me = sum(e) / n
    var_e = sum((x - me) ** 2 for x in e) / n
    return 0.0 if var_r <= 1e-12 else 1 - var_e / var_r


def test_explained_variance_matches_slow_version_and_ignores_a_constant_offset():
    rng = np.random.default_rng(0)
    r = rng.normal(size=50)
    v = 0.5 * r + rng.normal(size=50)
    assert stats.explained_variance(v, r) == pytest.approx(slow_ev(list(v), list(r)))
    assert stats.explained_variance(v + 3.0, r) == pytest.approx(stats.explained_variance(v, r))
    assert stats.explained_variance(r, r) == pytest.approx(1.0)
    assert stats.explained_variance(v, np.ones(50)) == 0.0       # no variance to explain
    assert stats.explained_variance([1.0], [2.0]) == 0.0


def test_ev_by_segment_is_the_ev_within_each_segment():
    rng = np.random.default_rng(1)
    r = rng.normal(size=40)
    v = r + rng.normal(size=40)
    seg = np.array([0, 1, 2, 3] * 10)
    out = stats.explained_variance_by_segment(v, r, seg)
    for i, name in enumerate(stats.SEGMENTS):
        sel = seg == i
        assert out[name] == pytest.approx(slow_ev(list(v[sel]), list(r[sel])))
    assert out["all"] == pytest.approx(slow_ev(list(v), list(r)))
    assert "answer" not in stats.explained_variance_by_segment(v[:3], r[:3], seg[:3])


def slow_between_share(rewards):
    """Method of moments by hand: E[MSB] = s_w + G s_b, E[MSW] = s_w."""
    n, g = len(rewards), len(rewards[0])
    means = [sum(row) / g for row in rewards]
    grand = sum(means) / n
    msb = g * sum((m - grand) ** 2 for m in means) / (n - 1)
    msw = sum((x - m) ** 2 for row, m in zip(rewards, means) for x in row) / (n * (g - 1))
    sb = max((msb - msw) / g, 0.0)
    return sb / (sb + msw)


def test_between_prompt_share_matches_slow_version_and_is_unbiased():
    rng = np.random.default_rng(2)
    p = rng.uniform(0, 1, size=30)
    rewards = (rng.uniform(size=(30, 4)) < p[:, None]).astype(float)
    got = stats.between_prompt_share(rewards)
    assert got["share"] == pytest.approx(slow_between_share(rewards.tolist()))
    # Rewards that do not depend on the prompt: the naive share (variance of group means) sees
    # 1/G of the noise as signal; the corrected one is near 0 on average over many draws.
    naive, corrected = [], []
    for s in range(200):
        noise = (np.random.default_rng(s).uniform(size=(50, 4)) < 0.4).astype(float)
        out = stats.between_prompt_share(noise)
        naive.append(out["naive_share"])
        corrected.append(out["share"])
    assert np.mean(naive) == pytest.approx(0.25, abs=0.03)
    assert np.mean(corrected) < 0.03
    # Rewards fixed by the prompt: everything lies between prompts.
    fixed = np.repeat((p > 0.5).astype(float)[:, None], 4, axis=1)
    assert stats.between_prompt_share(fixed)["share"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="samples >= 2"):
        stats.between_prompt_share(np.ones((5, 1)))


def test_ridge_probe_matches_the_normal_equations_with_an_unpenalised_intercept():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(60, 5))
    y = x @ np.array([1.0, -2.0, 0.0, 0.5, 0.0]) + 4.0 + 0.1 * rng.normal(size=60)
    xt = rng.normal(size=(7, 5))
    alpha = 2.0
    # Slow: augment with a column of ones and a zero penalty on it.
    xa = np.hstack([x, np.ones((60, 1))])
    penalty = alpha * np.diag([1.0] * 5 + [0.0])
    w = np.linalg.solve(xa.T @ xa + penalty, xa.T @ y)
    expected = np.hstack([xt, np.ones((7, 1))]) @ w
    assert np.allclose(stats.ridge_probe(x, y, xt, alpha), expected)
    assert np.allclose(stats.ridge_probe(x, y, xt, 0.0),
                       np.hstack([xt, np.ones((7, 1))]) @ np.linalg.lstsq(xa, y, rcond=None)[0])


def test_segments_of_a_gsm_style_completion():
    tokens = ["Tom", " has", " 3", ".\n", "He", " gets", " 2", ", so", " 3", " +", " 2", " =",
              " 5", ".\n", "####", " 5", ""]
    seg = stats.segment_of_tokens(tokens)
    names = [stats.SEGMENTS[i] for i in seg]
    assert names[0] == "first"
    assert names[1:4] == ["before_last_step"] * 3
    assert names[4:14] == ["last_step"] * 10
    assert names[14:] == ["answer"] * 3
    # No equation and no answer marker: everything after the first token is "before".
    assert list(stats.segment_of_tokens(["8", "2", ""])) == [0, 1, 1]
