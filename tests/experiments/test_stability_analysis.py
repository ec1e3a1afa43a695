"""The stability study's analysis on synthetic runs: the collapse rule (a stable run, a
collapsing one, noisy ones that must not trigger, each criterion, against a brute-force
version), Wilson intervals and survival curves against slow computations, time to collapse,
and the early-warning lead times and false alarms. Nothing here trains; no learning outcome."""
import math
import random

import pytest

from experiments.studies import collapse as cl
from experiments.studies import early_warning as ew

STEPS = 300
EVERY = 20


def stable_run(seed=0, noise=0.03):
    """Accuracy 0.35 -> 0.8 by step 100 then a plateau; reward the same; length ~3."""
    rng = random.Random(seed)
    level = lambda s: 0.35 + 0.45 * min(s, 100) / 100  # noqa: E731
    evals = [(s, level(s) + rng.uniform(-noise, noise)) for s in range(0, STEPS + 1, EVERY)]
    rewards = [(s, min(1.0, max(0.0, level(s) + rng.gauss(0, 0.08)))) for s in range(1, STEPS + 1)]
    lengths = [(s, 3.0 + rng.uniform(-0.3, 0.3)) for s in range(1, STEPS + 1)]
    return evals, rewards, lengths


def collapsing_run(fall_at=160, seed=0):
    """The stable run until `fall_at`, then accuracy 0.25 and reward 0.2."""
    evals, rewards, lengths = stable_run(seed)
    evals = [(s, a if s < fall_at else 0.25) for s, a in evals]
    rewards = [(s, r if s < fall_at else 0.2) for s, r in rewards]
    return evals, rewards, lengths


# --- the collapse rule ----------------------------------------------------------------------------
def test_a_stable_run_does_not_collapse_and_a_collapsing_one_is_dated_at_its_onset():
    evals, rewards, lengths = stable_run()
    assert cl.collapse(evals, rewards, lengths) is None
    evals, rewards, lengths = collapsing_run(fall_at=160)
    assert cl.collapse(evals, rewards, lengths) == (160, "accuracy")
    # without evaluations the reward's 10-step mean dates it: the first window below 0.6 x
    # peak and peak - 0.15, which needs >= 4 of its 10 steps past the fall at the plateau 0.8
    step, cause = cl.collapse((), rewards, lengths)
    assert cause == "reward" and 160 <= step <= 170


def test_noisy_runs_must_not_trigger():
    for seed in range(20):   # evaluation noise +-0.08 around the plateau, reward noise sd 0.08
        evals, rewards, lengths = stable_run(seed, noise=0.08)
        assert cl.collapse(evals, rewards, lengths) is None, seed
    evals, rewards, lengths = stable_run()
    # one evaluation falls far (a dip), the next is back: not a collapse (2 consecutive needed)
    dipped = [(s, 0.2 if s == 200 else a) for s, a in evals]
    assert cl.accuracy_onset(dipped) is None
    # a fall in the last evaluation only is not confirmed
    assert cl.accuracy_onset(evals[:-1] + [(STEPS, 0.1)]) is None
    # a low-accuracy run whose relative fall is within 0.10 of its peak is noise, not a collapse
    low = [(s, 0.12 if (s // EVERY) % 2 else 0.05) for s in range(0, STEPS + 1, EVERY)]
    assert cl.accuracy_onset(low) is None
    # reward spikes down for fewer than `sustain` steps' windows: not a collapse
    spiky = [(s, 0.0 if 150 <= s < 153 else r) for s, r in rewards]
    assert cl.reward_onset(spiky) is None


def test_each_criterion_and_the_earliest_wins():
    evals, rewards, lengths = stable_run()
    # response length blow-up (x3) from step 200: dated where the 10-step mean has been above
    # 2x its first window's for 10 steps; the first such window ends at step ~205
    long = [(s, 9.0 if s >= 200 else v) for s, v in lengths]
    step, cause = cl.collapse(evals, rewards, long)
    assert cause == "length" and 200 <= step <= 206
    short = [(s, 1.0 if s >= 200 else v) for s, v in lengths]     # and a collapse to 1/3
    assert cl.collapse(evals, rewards, short)[1] == "length"
    assert cl.collapse(evals, rewards, lengths, nonfinite_step=42) == (42, "nonfinite")
    ce, cr, _ = collapsing_run(fall_at=240)
    assert cl.collapse(ce, cr, long) == (step, "length")           # 200-odd < 240
    # a run that never learns but falls below its warm start collapses too
    never = [(s, 0.4 if s < 100 else 0.2) for s in range(0, STEPS + 1, EVERY)]
    assert cl.accuracy_onset(never) == 100
    with pytest.raises(ValueError, match="eval_fraction"):
        cl.CollapseRule(eval_fraction=1.5)


def slow_accuracy_onset(evals, rule):
    pts = sorted(evals)
    for i in range(len(pts) - rule.eval_consecutive + 1):
        if all(pts[j][1] < min(rule.eval_fraction * max(a for _, a in pts[:j + 1]),
                               max(a for _, a in pts[:j + 1]) - rule.eval_min_drop)
               for j in range(i, i + rule.eval_consecutive)):
            return pts[i][0]
    return None


def slow_reward_onset(rewards, rule):
    pts = sorted(rewards)
    w = rule.reward_window
    means = [(pts[i][0], sum(v for _, v in pts[i - w + 1:i + 1]) / w)
             for i in range(w - 1, len(pts))]
    for i in range(len(means) - rule.sustain + 1):
        if all(means[j][1] < min(rule.reward_fraction * max(m for _, m in means[:j + 1]),
                                 max(m for _, m in means[:j + 1]) - rule.reward_min_drop)
               for j in range(i, i + rule.sustain)):
            return means[i][0]
    return None


@pytest.mark.parametrize("seed", range(6))
def test_the_criteria_equal_a_brute_force_version_on_random_walks(seed):
    rng = random.Random(seed)
    rule = cl.CollapseRule(eval_consecutive=1 + seed % 3, sustain=1 + seed % 4, reward_window=3)
    acc, evals = 0.5, []
    for s in range(0, 200, 10):
        acc = min(1.0, max(0.0, acc + rng.gauss(0, 0.15)))
        evals.append((s, acc))
    r, rewards = 0.5, []
    for s in range(1, 120):
        r = min(1.0, max(0.0, r + rng.gauss(0, 0.1)))
        rewards.append((s, r))
    assert cl.accuracy_onset(evals, rule) == slow_accuracy_onset(evals, rule)
    assert cl.reward_onset(rewards, rule) == slow_reward_onset(rewards, rule)


# --- Wilson intervals, survival, time to collapse -----------------------------------------------
def slow_wilson(k, n, z=cl.Z95, grid=200000):
    inside = [i / grid for i in range(grid + 1)
              if (k / n - i / grid) ** 2 <= z * z * (i / grid) * (1 - i / grid) / n]
    return min(inside), max(inside)


@pytest.mark.parametrize("k,n", [(0, 5), (1, 5), (5, 5), (3, 10), (7, 10), (13, 40)])
def test_wilson_against_a_scan_of_the_score_test(k, n):
    lo, hi = cl.wilson(k, n)
    slo, shi = slow_wilson(k, n)
    assert lo == pytest.approx(slo, abs=2e-5) and hi == pytest.approx(shi, abs=2e-5)
    assert lo <= k / n <= hi
    assert cl.wilson(0, 0) == (None, None)
    with pytest.raises(ValueError):
        cl.wilson(3, 2)


def test_wilson_known_value():
    # 0 of 10: the upper end is z^2 / (n + z^2)
    assert cl.wilson(0, 10)[1] == pytest.approx(cl.Z95 ** 2 / (10 + cl.Z95 ** 2))


def test_survival_against_a_slow_count():
    steps = list(range(0, 301, 10))
    collapses = [None, 40, 40, 125, None, 300, 7]
    rows = cl.survival(collapses, steps)
    assert [r["step"] for r in rows] == steps
    for r in rows:
        alive = len([c for c in collapses if not (c is not None and c <= r["step"])])
        assert r["surviving"] == alive and r["runs"] == 7
        assert r["fraction"] == pytest.approx(alive / 7)
        assert (r["lo"], r["hi"]) == pytest.approx(slow_wilson(alive, 7), abs=2e-5)
    fr = [r["fraction"] for r in rows]
    assert fr == sorted(fr, reverse=True) and fr[0] == 1.0 and fr[-1] == pytest.approx(2 / 7)


def test_time_to_collapse():
    t = cl.time_to_collapse([None, 40, 100, None, 220], 300)
    assert t["collapsed"] == 3 and t["runs"] == 5 and t["collapsed_frac"] == 0.6
    assert t["mean_step"] == pytest.approx(120.0) and t["median_step"] == 100.0
    assert t["rmst"] == pytest.approx((300 + 40 + 100 + 300 + 220) / 5)
    assert t["mean_lo"] < 120.0 < t["mean_hi"]
    none = cl.time_to_collapse([None, None], 300)
    assert none["collapsed"] == 0 and none["mean_step"] is None and none["rmst"] == 300


# --- early warning -------------------------------------------------------------------------------
def test_trailing_median_ignores_one_spike_and_fires_on_a_sustained_crossing():
    ess = [(s, 1.0) for s in range(1, 50)] + [(s, 0.5) for s in range(50, 101)]
    # the 5-step median ending at s is 0.5 once 3 of its 5 steps are >= 50: s = 52
    assert ew.fire_step(ess, "below", 0.9) == 52
    spike = [(s, 50.0 if s == 30 else 0.01) for s in range(1, 101)]
    assert ew.fire_step(spike, "above", 1.0) is None
    meds = ew.trailing_medians([(s, float(s % 7)) for s in range(1, 20)], 4)
    for step, m in meds:    # even window: the mean of the middle two
        vals = sorted(float(x % 7) for x in range(step - 3, step + 1))
        assert m == (vals[1] + vals[2]) / 2


def test_lead_times_false_alarms_and_the_arm_summary():
    rising = {"kl_rollout": [(s, 0.001 if s < 60 else 0.2) for s in range(1, 301)],
              "ess": [(s, 0.99) for s in range(1, 301)]}
    rows = ew.run_warnings(rising, collapse_step=100)
    kl = [r for r in rows if r["indicator"] == "k3_kl_rise"]
    assert [r["outcome"] for r in kl] == ["hit"] * 3
    assert all(r["fire_step"] == 62 and r["lead"] == 38 for r in kl)
    ess = [r for r in rows if r["indicator"] == "ess_drop"]
    assert [r["outcome"] for r in ess] == ["miss", "miss", "miss"]
    # missing metric: never fires
    assert all(r["fire_step"] is None for r in rows if r["indicator"] == "chi2_rise")
    late = ew.run_warnings(rising, collapse_step=40)      # fired after the collapse: a miss
    assert {r["outcome"] for r in late if r["indicator"] == "k3_kl_rise"} == {"miss"}
    stable = ew.run_warnings(rising, collapse_step=None)
    assert {r["outcome"] for r in stable if r["indicator"] == "k3_kl_rise"} == {"false_alarm"}
    assert {r["outcome"] for r in stable if r["indicator"] == "ess_drop"} == {"quiet"}
    pick = lambda rs: [r for r in rs if r["indicator"] == "k3_kl_rise" and r["threshold"] == 0.05]  # noqa: E731
    s = ew.summarize(pick(rows) + pick(late) + pick(stable) + pick(rows))
    assert (s["runs"], s["collapsed"], s["hit"], s["miss"], s["false_alarm"], s["quiet"]) == \
        (4, 3, 2, 1, 1, 0)
    assert s["hit_rate"] == pytest.approx(2 / 3) and s["false_alarm_rate"] == 1.0
    assert (s["hit_lo"], s["hit_hi"]) == cl.wilson(2, 3)
    assert s["lead_mean"] == 38 and s["lead_median"] == 38 and s["lead_min"] == 38
    empty = ew.summarize([])
    assert empty["hit_rate"] is None and empty["lead_mean"] is None
    assert math.isclose(ew.summarize(pick(stable))["false_alarm_lo"], cl.wilson(1, 1)[0])


def slow_relative_fire(points, direction, factor, floor, start, window=5, baseline=10):
    pts = sorted((s, v if direction == "above" else 1.0 - v) for s, v in points)
    base = [e for s, e in pts if s >= start][:baseline]
    if len(base) < baseline:
        return None
    level = sorted(base)[(baseline - 1) // 2] / 2 + sorted(base)[baseline // 2] / 2
    last_base = [s for s, _ in pts if s >= start][baseline - 1]
    for i in range(window - 1, len(pts)):
        vals = sorted(e for _, e in pts[i - window + 1:i + 1])
        med = vals[window // 2]
        if pts[i][0] > last_base and med > factor * level and med > floor:
            return pts[i][0]
    return None


def test_relative_indicators_fire_on_a_rise_over_the_run_s_own_level():
    # KL 0.2 once staleness has reached k = 8, then 0.6 from step 100: the absolute
    # thresholds fire at the first window; the 2x rise fires when the median passes 0.4
    kl = [(s, 0.02 * s if s <= 8 else (0.2 if s < 100 else 0.6)) for s in range(1, 201)]
    assert ew.fire_step(kl, "above", 0.05) == 5
    assert ew.relative_fire_step(kl, "above", 2.0, 0.01, start=9) == 102
    assert ew.relative_fire_step(kl, "above", 4.0, 0.01, start=9) is None
    flat = [(s, 0.2) for s in range(1, 201)]
    assert ew.relative_fire_step(flat, "above", 2.0, 0.01, start=9) is None
    # no drift (k = 0): a relative rise of numerical noise stays under the floor
    zero = [(s, 1e-10 * (1 + s % 3)) for s in range(1, 201)]
    assert ew.relative_fire_step(zero, "above", 2.0, 0.01) is None
    # ESS: the deficit 1 - ESS doubles (0.1 -> 0.3) from step 60
    ess = [(s, 0.9 if s < 60 else 0.7) for s in range(1, 201)]
    assert ew.relative_fire_step(ess, "below", 2.0, 0.05) == 62
    # a run shorter than its baseline cannot fire
    assert ew.relative_fire_step(kl[:12], "above", 2.0, 0.01, start=9) is None
    rows = ew.run_warnings({"kl_rollout": kl}, collapse_step=150, start=9)
    rel = {r["threshold"]: r for r in rows if r["indicator"] == "k3_kl_rise_rel"}
    assert rel[2.0]["outcome"] == "hit" and rel[2.0]["lead"] == 48
    assert rel[4.0]["outcome"] == "miss"
    rng = random.Random(3)
    for _ in range(20):   # against the slow version on random series
        pts = [(s, rng.uniform(0, 1) ** 3) for s in range(1, rng.randint(5, 80))]
        start, factor = rng.randint(1, 10), rng.choice([1.5, 2.0, 4.0])
        for direction in ("above", "below"):
            assert ew.relative_fire_step(pts, direction, factor, 0.01, start) == \
                slow_relative_fire(pts, direction, factor, 0.01, start)
