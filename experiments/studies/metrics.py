"""Pure statistics of the reproduction study (programs/study.py, docs/REPRODUCTION.md).

Standard library only. Each function has a slow, obvious twin in tests/experiments/test_study_metrics.py:

- `t_quantile`, `mean_ci`: the mean over seeds and its two-sided confidence interval from the
  Student t distribution with n - 1 degrees of freedom (`mean +- t * s / sqrt(n)`, `s` the
  sample standard deviation). One seed has no interval (None).
- `welch`: the difference of two means and its Welch-Satterthwaite confidence interval, the
  test behind every "A > B" verdict of the report; `welch_p`: the same test's two-sided p-value
  (below 0.05 exactly when the 95% interval excludes 0).
- `holm`, `bonferroni`: p-values adjusted for the number of tests in a family (the study's
  families: experiments/studies/tables.py).
- `collapse_step`: whether and when a run collapses (the rule of sweeps.is_collapsed, dated).
- `recovery`: adaptation after a reward shift (steps until a moving average is back at a
  fraction of its pre-shift level).
- `bin_curve`, `band`: per-run curves put on a common step grid, and mean +- CI per grid step.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple


# --- Student t ---------------------------------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularised incomplete beta (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularised incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df={df}: must be > 0")
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with t_cdf(t, df) = p (bisection to ~1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p={p}: must be in (0, 1)")
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > p:
        lo *= 2.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


# --- means and intervals -----------------------------------------------------------------------
def finite_values(values: Sequence) -> List[float]:
    """The values that are finite numbers, as floats (None, text, NaN and inf left out)."""
    out = []
    for v in values:
        try:
            x = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(x):
            out.append(x)
    return out


def mean_ci(values: Sequence, confidence: float = 0.95) -> Dict[str, Optional[float]]:
    """{"n", "mean", "sd", "half", "lo", "hi"} of the finite `values` (others are ignored).

    half = t_{(1+confidence)/2, n-1} * sd / sqrt(n), sd the sample (n-1) standard deviation;
    n = 1 gives mean only (sd, half, lo, hi None); n = 0 gives every entry None but n.
    """
    xs = finite_values(values)
    n = len(xs)
    out: Dict[str, Optional[float]] = dict(n=n, mean=None, sd=None, half=None, lo=None, hi=None)
    if not n:
        return out
    mean = sum(xs) / n
    out["mean"] = mean
    if n < 2:
        return out
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n)
    out.update(sd=sd, half=half, lo=mean - half, hi=mean + half)
    return out


def welch(a: Sequence, b: Sequence, confidence: float = 0.95) -> Dict[str, Optional[float]]:
    """mean(a) - mean(b) with its Welch confidence interval: {"diff", "lo", "hi", "df"}.

    Needs two finite values on each side; otherwise lo, hi and df are None. When both samples
    have zero variance the interval is the point itself (df None).
    """
    xa, xb = finite_values(a), finite_values(b)
    out: Dict[str, Optional[float]] = dict(diff=None, lo=None, hi=None, df=None)
    if not xa or not xb:
        return out
    ma, mb = sum(xa) / len(xa), sum(xb) / len(xb)
    out["diff"] = ma - mb
    if len(xa) < 2 or len(xb) < 2:
        return out
    va = sum((x - ma) ** 2 for x in xa) / (len(xa) - 1) / len(xa)
    vb = sum((x - mb) ** 2 for x in xb) / (len(xb) - 1) / len(xb)
    if va + vb == 0.0:
        out.update(lo=ma - mb, hi=ma - mb)
        return out
    df = (va + vb) ** 2 / ((va ** 2 / (len(xa) - 1) if va else 0.0)
                           + (vb ** 2 / (len(xb) - 1) if vb else 0.0))
    half = t_quantile(0.5 + confidence / 2.0, df) * math.sqrt(va + vb)
    out.update(lo=ma - mb - half, hi=ma - mb + half, df=df)
    return out


def welch_p(a: Sequence, b: Sequence) -> Optional[float]:
    """The two-sided p-value of Welch's t-test of mean(a) = mean(b).

    t = (mean(a) - mean(b)) / sqrt(s_a^2 / n_a + s_b^2 / n_b) on the Welch-Satterthwaite df,
    p = 2 P(T <= -|t|). None where `welch` has no df: fewer than two finite values on a side,
    or zero variance on both (the difference is then exact, or a tie: no test applies).
    """
    xa, xb = finite_values(a), finite_values(b)
    if len(xa) < 2 or len(xb) < 2:
        return None
    ma, mb = sum(xa) / len(xa), sum(xb) / len(xb)
    va = sum((x - ma) ** 2 for x in xa) / (len(xa) - 1) / len(xa)
    vb = sum((x - mb) ** 2 for x in xb) / (len(xb) - 1) / len(xb)
    if va + vb == 0.0:
        return None
    df = (va + vb) ** 2 / ((va ** 2 / (len(xa) - 1) if va else 0.0)
                           + (vb ** 2 / (len(xb) - 1) if vb else 0.0))
    t = (ma - mb) / math.sqrt(va + vb)
    return min(1.0, 2.0 * t_cdf(-abs(t), df))


def _counted(pvalues: Sequence[Optional[float]]) -> List[int]:
    """The indices of the p-values that count in a family (None entries do not)."""
    out = []
    for i, p in enumerate(pvalues):
        if p is None:
            continue
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p-value {p!r} at {i}: must be in [0, 1] or None")
        out.append(i)
    return out


def bonferroni(pvalues: Sequence[Optional[float]]) -> List[Optional[float]]:
    """min(1, m p) for each p-value, m the number of them that are not None (passed through)."""
    idx = _counted(pvalues)
    out: List[Optional[float]] = [None] * len(pvalues)
    for i in idx:
        out[i] = min(1.0, len(idx) * pvalues[i])
    return out


def holm(pvalues: Sequence[Optional[float]]) -> List[Optional[float]]:
    """Holm-Bonferroni (step-down) adjusted p-values, in the order given.

    With the m non-None p-values sorted, p_(1) <= ... <= p_(m): the adjusted p_(k) is
    max over j <= k of min(1, (m - j + 1) p_(j)), monotone in k and capped at 1. Rejecting
    where the adjusted value is < alpha is Holm's procedure at family-wise error rate alpha.
    None entries are passed through and do not count in m.
    """
    idx = sorted(_counted(pvalues), key=lambda i: pvalues[i])
    m = len(idx)
    out: List[Optional[float]] = [None] * len(pvalues)
    running = 0.0
    for k, i in enumerate(idx):
        running = max(running, min(1.0, (m - k) * pvalues[i]))
        out[i] = running
    return out


def verdict(diff: Dict[str, Optional[float]]) -> str:
    """"higher" / "lower" when the Welch interval excludes 0, else "indistinguishable"."""
    if diff.get("lo") is None or diff.get("hi") is None:
        return "indistinguishable"
    if diff["lo"] > 0:
        return "higher"
    if diff["hi"] < 0:
        return "lower"
    return "indistinguishable"


# --- curves -----------------------------------------------------------------------------------
def moving_average(values: Sequence[float], window: int) -> List[float]:
    """Trailing mean of up to `window` values at each position."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def bin_curve(points: Sequence[Tuple[int, float]], every: int) -> Dict[int, float]:
    """{grid step: value}: each (step, value) filed under the multiple of `every` at or below
    its step, the first point of a bin kept (the evaluator can evaluate a version a little late;
    docs/METHOD.md section 11)."""
    out: Dict[int, float] = {}
    for step, value in sorted(points, key=lambda p: p[0]):
        out.setdefault(step // max(every, 1) * max(every, 1), value)
    return out


def band(curves: Sequence[Dict[int, float]], confidence: float = 0.95
         ) -> Tuple[List[int], List[float], List[Optional[float]], List[Optional[float]]]:
    """(steps, means, lows, highs) over the grid steps every curve has."""
    if not curves:
        return [], [], [], []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    means, lows, highs = [], [], []
    for s in steps:
        ci = mean_ci([c[s] for c in curves], confidence)
        means.append(ci["mean"])
        lows.append(ci["lo"])
        highs.append(ci["hi"])
    return steps, means, lows, highs


# --- collapse ---------------------------------------------------------------------------------
def collapse_step(rewards: Sequence[Tuple[int, float]], window: int, reward_fraction: float,
                  evals: Sequence[Tuple[int, float]] = (), eval_drop: float = 0.10,
                  nonfinite_step: Optional[int] = None) -> Optional[int]:
    """The step at which a run collapsed, or None if it did not.

    A run collapses (sweeps.is_collapsed) when a loss went non-finite, when its `window`-step
    moving-average reward ends below `reward_fraction` x its best, or when its last held-out
    accuracy ends more than `eval_drop` below the first (version 0). The step dates it: the
    first non-finite step; the step after which the moving average stays below
    `reward_fraction` x the best moving average reached up to then; the first evaluated version
    after which every accuracy stays below the initial one minus `eval_drop`. The earliest of
    those that apply.
    """
    found: List[int] = []
    if nonfinite_step is not None:
        found.append(nonfinite_step)
    pts = sorted(rewards)
    if pts:
        smooth = moving_average([v for _, v in pts], window)
        best = max(smooth)
        if best > 0 and smooth[-1] < reward_fraction * best:
            # walk back from the end while the average stays below the running best's fraction
            running = []
            top = float("-inf")
            for v in smooth:
                top = max(top, v)
                running.append(top)
            i = len(smooth) - 1
            while i > 0 and smooth[i - 1] < reward_fraction * running[i - 1]:
                i -= 1
            found.append(pts[i][0])
    ev = sorted(evals)
    if len(ev) >= 2 and ev[-1][1] < ev[0][1] - eval_drop:
        floor = ev[0][1] - eval_drop
        i = len(ev) - 1
        while i > 1 and ev[i - 1][1] < floor:
            i -= 1
        found.append(ev[i][0])
    return min(found) if found else None


# --- adaptation after a shift -----------------------------------------------------------------
def recovery(values_by_step: Dict[int, float], shift_every: int, max_steps: int, window: int,
             fraction: float) -> List[Dict[str, Optional[float]]]:
    """One dict per shift at s = shift_every, 2 shift_every, ... < max_steps.

    level: mean of the values at steps in (s - window, s]. The new phase is (s, s +
    shift_every] (capped at max_steps); a `window`-step trailing moving average runs over the
    whole series; dip: its lowest value in the phase (the first such step: dip_step). Recovered
    at the first phase step after dip_step whose average reaches fraction x level; if the dip
    never fell below it, 0 steps. steps_to_recover = that step - s, or None (not within the
    phase). Also phase_mean, the mean value over the phase. Rollouts trained right after a
    shift were made before it, so the fall comes late; counting from the dip handles that.
    """
    steps = sorted(values_by_step)
    smooth = dict(zip(steps, moving_average([values_by_step[s] for s in steps], window)))
    out: List[Dict[str, Optional[float]]] = []
    for j, s in enumerate(range(shift_every, max_steps, shift_every), start=1):
        before = [values_by_step[t] for t in steps if s - window < t <= s]
        after = [t for t in steps if s < t <= min(s + shift_every, max_steps)]
        if not before or not after:
            continue
        level = sum(before) / len(before)
        dip_step = min(after, key=lambda t: smooth[t])
        if smooth[dip_step] >= fraction * level:
            back: Optional[int] = s
        else:
            back = next((t for t in after if t > dip_step and smooth[t] >= fraction * level),
                        None)
        out.append({"shift": j, "shift_step": s, "to_phase": j % 2, "pre_level": level,
                    "dip": smooth[dip_step], "dip_step": dip_step,
                    "phase_mean": sum(values_by_step[t] for t in after) / len(after),
                    "steps_to_recover": None if back is None else back - s})
    return out


def eval_recovery(evals_by_version: Dict[int, float], shift_every: int, max_steps: int,
                  fraction: float) -> List[Dict[str, Optional[float]]]:
    """Adaptation on held-out accuracy under the current rule, one dict per shift at s.

    level: the last accuracy evaluated before s (a version < s; the version s itself already
    answers to the new rule); the phase's evaluations are those at versions in [s, s +
    shift_every) (and max_steps when the phase reaches it). steps_to_recover: the first such
    version with accuracy >= fraction x level, minus s (None: not within the phase);
    at_shift: the accuracy at the phase's first evaluation; phase_mean: the mean over them.
    """
    versions = sorted(evals_by_version)
    out: List[Dict[str, Optional[float]]] = []
    for j, s in enumerate(range(shift_every, max_steps, shift_every), start=1):
        pre = [v for v in versions if v < s]
        phase = [v for v in versions if s <= v < s + shift_every or v == max_steps > s]
        if not pre or not phase:
            continue
        level = evals_by_version[pre[-1]]
        back = next((v for v in phase if evals_by_version[v] >= fraction * level), None)
        out.append({"shift": j, "shift_step": s, "to_phase": j % 2, "pre_level": level,
                    "at_shift": evals_by_version[phase[0]],
                    "phase_mean": sum(evals_by_version[v] for v in phase) / len(phase),
                    "steps_to_recover": None if back is None else back - s})
    return out
