"""The reproduction study's pure statistics (experiments/studies/metrics.py), each against a
slow, obvious version written here."""
import math
import random

import pytest

from experiments.studies import metrics as sm
from experiments import sweeps


# --- slow, obvious versions --------------------------------------------------------------------
def slow_t_cdf(t, df, n=20000):
    """Simpson's rule on the t density from 0 to |t|, plus one half."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    pdf = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731
    a, b = 0.0, abs(t)
    h = (b - a) / n
    s = pdf(a) + pdf(b) + sum((4 if i % 2 else 2) * pdf(a + i * h) for i in range(1, n))
    half = s * h / 3
    return 0.5 + half if t >= 0 else 0.5 - half


def slow_t_quantile(p, df):
    """Scan upward in steps of 1e-3 from -20 until the slow CDF reaches p, then refine."""
    x = 0.0
    step = 1.0 if p > 0.5 else -1.0
    for scale in (1.0, 0.1, 0.01, 0.001):
        step = math.copysign(scale, step)
        while (slow_t_cdf(x + step, df, 4000) < p) == (step > 0):
            x += step
    return x + step / 2


def slow_mean_ci(xs, confidence=0.95):
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    half = slow_t_quantile(0.5 + confidence / 2, n - 1) * math.sqrt(var / n)
    return mean, mean - half, mean + half


def slow_moving_average(values, window):
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def slow_collapse_step(rewards, window, fraction, evals, drop, nonfinite):
    """Every candidate step checked against the definition, in order."""
    found = []
    if nonfinite is not None:
        found.append(nonfinite)
    steps = [s for s, _ in sorted(rewards)]
    smooth = slow_moving_average([v for _, v in sorted(rewards)], window)
    if smooth and max(smooth) > 0 and smooth[-1] < fraction * max(smooth):
        for i in range(len(smooth)):
            if all(smooth[j] < fraction * max(smooth[:j + 1]) for j in range(i, len(smooth))):
                found.append(steps[i])
                break
    ev = sorted(evals)
    if len(ev) >= 2 and ev[-1][1] < ev[0][1] - drop:
        for i in range(1, len(ev)):
            if all(a < ev[0][1] - drop for _, a in ev[i:]):
                found.append(ev[i][0])
                break
    return min(found) if found else None


def slow_recovery(values, shift_every, max_steps, window, fraction):
    out = []
    steps = sorted(values)
    s = shift_every
    j = 0
    while s < max_steps:
        j += 1
        before = [values[t] for t in steps if s - window < t <= s]
        phase = [t for t in steps if s < t <= min(s + shift_every, max_steps)]
        if before and phase:
            level = sum(before) / len(before)

            def avg(t):
                prior = [u for u in steps if u <= t][-window:]
                return sum(values[u] for u in prior) / len(prior)
            dip = min(avg(t) for t in phase)
            dip_step = [t for t in phase if avg(t) == dip][0]
            if dip >= fraction * level:
                rec = 0
            else:
                rec = None
                for t in phase:
                    if t > dip_step and avg(t) >= fraction * level:
                        rec = t - s
                        break
            out.append((j, level, dip, dip_step, rec))
        s += shift_every
    return out


# --- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 30])
@pytest.mark.parametrize("t", [-3.0, -0.7, 0.0, 0.4, 1.5, 4.0])
def test_t_cdf_matches_numerical_integration(t, df):
    assert sm.t_cdf(t, df) == pytest.approx(slow_t_cdf(t, df), abs=1e-7)


@pytest.mark.parametrize("df", [1, 2, 4, 9])
@pytest.mark.parametrize("p", [0.025, 0.3, 0.9, 0.975])
def test_t_quantile_matches_a_scan_of_the_slow_cdf(p, df):
    assert sm.t_quantile(p, df) == pytest.approx(slow_t_quantile(p, df), abs=2e-3)


def test_t_quantile_table_values():
    # the textbook 97.5% points: df 2, 4, 10, and the normal's 1.96 for large df
    for df, t in ((2, 4.303), (4, 2.776), (10, 2.228), (10000, 1.960)):
        assert sm.t_quantile(0.975, df) == pytest.approx(t, abs=1e-3)


def test_mean_ci_against_the_formula():
    rng = random.Random(0)
    for n in (2, 3, 5, 8):
        xs = [rng.uniform(0, 1) for _ in range(n)]
        got = sm.mean_ci(xs)
        mean, lo, hi = slow_mean_ci(xs)
        assert got["n"] == n and got["mean"] == pytest.approx(mean)
        assert (got["lo"], got["hi"]) == (pytest.approx(lo, abs=1e-3), pytest.approx(hi, abs=1e-3))
    one = sm.mean_ci([0.5, None, "x", float("nan")])
    assert one["n"] == 1 and one["mean"] == 0.5 and one["lo"] is None and one["half"] is None
    assert sm.mean_ci([])["mean"] is None
    assert sm.mean_ci(["0.25", "0.75"])["mean"] == 0.5   # CSV strings count as numbers


def test_welch_against_the_formula_and_verdicts():
    a, b = [0.8, 0.85, 0.9], [0.5, 0.6, 0.55, 0.58]
    got = sm.welch(a, b)
    ma, mb = sum(a) / 3, sum(b) / 4
    va = sum((x - ma) ** 2 for x in a) / 2 / 3
    vb = sum((x - mb) ** 2 for x in b) / 3 / 4
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 3)
    half = slow_t_quantile(0.975, df) * math.sqrt(va + vb)
    assert got["diff"] == pytest.approx(ma - mb)
    assert got["df"] == pytest.approx(df)
    assert got["lo"] == pytest.approx(ma - mb - half, abs=2e-3)
    assert sm.verdict(got) == "higher" and sm.verdict(sm.welch(b, a)) == "lower"
    assert sm.verdict(sm.welch([0.5, 0.7], [0.6, 0.61])) == "indistinguishable"
    assert sm.verdict(sm.welch([0.5], [0.1, 0.2])) == "indistinguishable"  # one seed: no CI
    same = sm.welch([1.0, 1.0], [0.0, 0.0])
    assert (same["lo"], same["hi"]) == (1.0, 1.0) and sm.verdict(same) == "higher"


def test_moving_average_bin_curve_and_band():
    rng = random.Random(1)
    xs = [rng.random() for _ in range(30)]
    for w in (1, 3, 5):
        assert sm.moving_average(xs, w) == pytest.approx(slow_moving_average(xs, w))
    # eval versions 0, 11 (late for 10), 20, 23 (a second point in bin 20 is dropped), 30
    assert sm.bin_curve([(0, 0.1), (11, 0.2), (23, 0.9), (20, 0.3), (30, 0.4)], 10) == {
        0: 0.1, 10: 0.2, 20: 0.3, 30: 0.4}
    steps, mean, lo, hi = sm.band([{0: 0.0, 10: 1.0}, {0: 1.0, 10: 1.0, 20: 1.0}])
    assert steps == [0, 10] and mean == [0.5, 1.0] and hi[1] == lo[1] == 1.0
    assert lo[0] == pytest.approx(0.5 - 12.706 * 0.5, abs=1e-2)


def test_collapse_step_against_brute_force_and_the_sweep_rule():
    rng = random.Random(2)
    for trial in range(300):
        n = rng.randint(1, 25)
        level = rng.random()
        rewards, v = [], level
        for s in range(1, n + 1):
            v = min(1.0, max(0.0, v + rng.uniform(-0.3, 0.2)))
            rewards.append((s, v))
        evals = [(0, rng.random())] + [(s, rng.random()) for s in range(5, n + 1, 5)]
        nonfinite = rng.choice([None] * 5 + [rng.randint(1, n)])
        w, f, d = sweeps.REWARD_WINDOW, sweeps.COLLAPSE_REWARD_FRACTION, sweeps.COLLAPSE_EVAL_DROP
        got = sm.collapse_step(rewards, w, f, evals, d, nonfinite)
        assert got == slow_collapse_step(rewards, w, f, evals, d, nonfinite), trial
        assert sm.collapse_step(rewards, 2, 0.6, evals, 0.2, nonfinite) == \
            slow_collapse_step(rewards, 2, 0.6, evals, 0.2, nonfinite), trial
        if len(evals) >= 2:
            rule = sweeps.is_collapsed([r for _, r in rewards], evals[0][1], evals[-1][1],
                                       nonfinite is not None)
            assert (got is not None) == rule, trial


def test_collapse_step_dates_a_fall():
    rewards = list(enumerate([0.5, 0.6, 0.7, 0.7, 0.7, 0.1, 0.0, 0.0, 0.0, 0.0], start=1))
    assert sm.collapse_step(rewards, 1, 0.5) == 6
    assert sm.collapse_step(rewards[:6] + [(7, 0.7)], 1, 0.5) is None  # came back
    assert sm.collapse_step([(1, 0.5)], 1, 0.5, [(0, 0.6), (10, 0.2), (20, 0.1)]) == 10
    assert sm.collapse_step([(1, 0.5)], 1, 0.5, [(0, 0.6), (10, 0.2), (20, 0.6)]) is None


def test_recovery_against_brute_force_and_online_shift_program():
    from experiments.sweep_presets.online_shift import recovery as program_recovery
    rng = random.Random(3)
    for trial in range(200):
        n = rng.randint(6, 40)
        shift_every = rng.randint(2, max(2, n // 2))
        values = {s: rng.random() for s in range(1, n + 1) if rng.random() > 0.1}
        window = rng.randint(1, shift_every)
        got = sm.recovery(values, shift_every, n, window, 0.9)
        slow = slow_recovery(values, shift_every, n, window, 0.9)
        assert [(g["shift"], g["dip_step"], g["steps_to_recover"]) for g in got] == \
            [(j, d, r) for j, _, _, d, r in slow], trial
        for g, (_, level, dip, _, _) in zip(got, slow):
            assert g["pre_level"] == pytest.approx(level) and g["dip"] == pytest.approx(dip)
        prog = program_recovery(values, shift_every, n, window, 0.9)
        assert [p["steps_to_recover"] for p in prog] == [g["steps_to_recover"] for g in got]


def slow_eval_recovery(evals, shift_every, max_steps, fraction):
    out = []
    for j, s in enumerate(range(shift_every, max_steps, shift_every), start=1):
        pre = max((v for v in evals if v < s), default=None)
        phase = sorted(v for v in evals if s <= v < s + shift_every or v == max_steps > s)
        if pre is None or not phase:
            continue
        rec = None
        for v in phase:
            if evals[v] >= fraction * evals[pre]:
                rec = v - s
                break
        out.append((j, evals[pre], evals[phase[0]], rec))
    return out


def test_eval_recovery_against_brute_force():
    rng = random.Random(4)
    for trial in range(200):
        n = rng.randint(5, 60)
        every = rng.randint(1, 6)
        shift_every = rng.randint(2, max(2, n // 2))
        evals = {v: rng.random() for v in range(0, n + 1, every)}
        evals[n] = rng.random()
        got = sm.eval_recovery(evals, shift_every, n, 0.75)
        assert [(g["shift"], g["pre_level"], g["at_shift"], g["steps_to_recover"])
                for g in got] == slow_eval_recovery(evals, shift_every, n, 0.75), trial
    # 0.9 before the shift at 4; 0.3 at it; 0.8 >= 0.75 * 0.9 two versions later
    got = sm.eval_recovery({0: 0.5, 2: 0.9, 4: 0.3, 6: 0.8, 8: 0.2}, 4, 8, 0.75)
    assert got[0]["steps_to_recover"] == 2   # the phase holds 4, 6 and the last version, 8
    assert got[0]["phase_mean"] == pytest.approx((0.3 + 0.8 + 0.2) / 3)


# --- p-values and multiplicity ------------------------------------------------------------------
def slow_welch_p(a, b):
    """Welch's t and df written out, the two tails by Simpson's rule on the t density."""
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    sa = sum((x - ma) ** 2 for x in a) / (na - 1)
    sb = sum((x - mb) ** 2 for x in b) / (nb - 1)
    se2 = sa / na + sb / nb
    df = se2 ** 2 / ((sa / na) ** 2 / (na - 1) + (sb / nb) ** 2 / (nb - 1))
    t = (ma - mb) / math.sqrt(se2)
    return 2 * slow_t_cdf(-abs(t), df)


def slow_holm(ps):
    """By the definition: p_(1) <= ... <= p_(m) (the Nones left out); the adjusted p of the
    i-th is max over j <= rank(i) of min(1, (m - j + 1) p_(j))."""
    kept = [p for p in ps if p is not None]
    m = len(kept)
    order = sorted(range(m), key=lambda i: kept[i])   # order[r - 1]: the index of rank r
    adjusted = [max(min(1.0, (m - j + 1) * kept[order[j - 1]])
                    for j in range(1, order.index(i) + 2)) for i in range(m)]
    it = iter(adjusted)
    return [None if p is None else next(it) for p in ps]


def slow_bonferroni(ps):
    m = sum(p is not None for p in ps)
    return [None if p is None else min(1.0, p * m) for p in ps]


def test_welch_p_against_integration_and_the_interval():
    rng = random.Random(5)
    for trial in range(40):
        a = [rng.gauss(0.5, rng.uniform(0.01, 0.2)) for _ in range(rng.randint(2, 10))]
        b = [rng.gauss(rng.uniform(0.3, 0.7), rng.uniform(0.01, 0.2))
             for _ in range(rng.randint(2, 10))]
        p = sm.welch_p(a, b)
        assert p == pytest.approx(slow_welch_p(a, b), abs=1e-6), trial
        # p < 0.05 exactly when the 95% interval excludes 0; at an end of it p is 0.05
        d = sm.welch(a, b)
        assert (p < 0.05) == (sm.verdict(d) != "indistinguishable"), trial
        assert sm.welch_p([x - d["lo"] for x in a], b) == pytest.approx(0.05, abs=1e-7), trial
        assert sm.welch_p(b, a) == pytest.approx(p)


def test_welch_p_known_values():
    # scipy.stats.ttest_ind([1, 2, 3], [4, 5, 6], equal_var=False).pvalue (t = -3.674, df = 4)
    assert sm.welch_p([1, 2, 3], [4, 5, 6]) == pytest.approx(0.021311641128756, abs=1e-10)
    # two seeds each with the same spread: df = 2, where 2 P(T <= -|t|) = 1 - |t| / sqrt(2 + t^2)
    a, b = [0.1, 0.3], [0.5, 0.7]
    t = (0.2 - 0.6) / math.sqrt(0.02 / 2 + 0.02 / 2)
    assert sm.welch_p(a, b) == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t), abs=1e-10)
    # one side without variance, two seeds on the other: df = 1 (Cauchy), p = 1 - 2 atan|t| / pi
    t = (1.0 - 0.25) / math.sqrt(0.5 / 2)
    assert sm.welch_p([0.5, 1.5], [0.25, 0.25]) == pytest.approx(
        1 - 2 * math.atan(abs(t)) / math.pi, abs=1e-10)
    # the textbook 97.5% point of t_4 (2.776) is p = 0.05: three seeds each, equal spreads
    a = [-1.0, 0.0, 1.0]
    shift = 2.776 * math.sqrt(2 / 3)
    assert sm.welch_p([x + shift for x in a], a) == pytest.approx(0.05, abs=1e-4)
    assert sm.welch_p(a, a) == pytest.approx(1.0)
    # no test, as welch has no interval: one seed, no finite values, both without variance
    assert sm.welch_p([0.5], [0.1, 0.2]) is None
    assert sm.welch_p([0.1, 0.2], [None, "x", float("nan")]) is None
    assert sm.welch_p([1.0, 1.0], [0.0, 0.0]) is None
    assert sm.welch_p(["0.1", "0.3"], [0.5, 0.7]) == sm.welch_p([0.1, 0.3], [0.5, 0.7])


def test_holm_and_bonferroni_against_their_definitions():
    rng = random.Random(6)
    for trial in range(300):
        ps = [rng.choice([None, rng.random(), rng.random() / 50, 1.0, 0.0])
              for _ in range(rng.randint(0, 9))]
        if ps and rng.random() < 0.3:
            ps.append(rng.choice(ps))   # ties
        got = sm.holm(ps)
        want = slow_holm(ps)
        assert [g is None for g in got] == [p is None for p in ps], trial
        assert [g for g in got if g is not None] == pytest.approx(
            [w for w in want if w is not None]), trial
        assert sm.bonferroni(ps) == slow_bonferroni(ps), trial
        for p, h, bf in zip(ps, got, sm.bonferroni(ps)):
            if p is not None:
                assert p <= h <= bf <= 1.0, trial   # Holm is never worse than Bonferroni
        kept = sorted((p, h) for p, h in zip(ps, got) if p is not None)
        assert all(h1 <= h2 for (_, h1), (_, h2) in zip(kept, kept[1:])), trial   # monotone


def test_holm_and_bonferroni_by_hand():
    # sorted: 0.005 (x4 = 0.02), 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1, but >= 0.06)
    assert sm.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert sm.bonferroni([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.04, 0.16, 0.12, 0.02])
    # Nones pass through and do not count: m = 2
    assert sm.holm([None, 0.01, 0.04, None]) == [None, pytest.approx(0.02), 0.04, None]
    assert sm.bonferroni([None, 0.01, 0.04, None]) == [None, 0.02, 0.08, None]
    assert sm.holm([0.6, 0.7]) == [1.0, 1.0] and sm.bonferroni([0.6, 0.7]) == [1.0, 1.0]
    assert sm.holm([]) == [] and sm.holm([None]) == [None] and sm.holm([0.3]) == [0.3]
    with pytest.raises(ValueError):
        sm.holm([0.1, 1.5])
