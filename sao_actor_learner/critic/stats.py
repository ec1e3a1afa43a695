"""Statistics of a critic on a fixed rollout set (docs/METHOD.md, "Measuring the critic").

Pure functions on numpy arrays; no torch, reverb, tensorflow or grpc.

  explained_variance(v, r)            1 - Var(r - v) / Var(r) (population variances), the
                                      learner's definition; 0 when Var(r) is 0.
  explained_variance_by_segment(...)  the same within each position segment (first completion
                                      token, steps before the last, the last step, the answer).
  between_prompt_share(rewards)       the ceiling of any predictor that sees only the prompt:
                                      the share of reward variance that lies between prompts,
                                      from G samples per prompt, bias-corrected (one-way ANOVA,
                                      method of moments).
  ridge_probe(x_train, y_train, x_test, alpha)   closed-form ridge regression with an
                                      unpenalised intercept: what a linear read-out of frozen
                                      features can explain.
"""
from __future__ import annotations

from typing import Dict, Sequence

import numpy as np

# Position segments of a completion, in order (segment_of_tokens assigns them).
SEGMENTS = ("first", "before_last_step", "last_step", "answer")


def explained_variance(values: np.ndarray, returns: np.ndarray) -> float:
    """1 - Var(returns - values) / Var(returns); 0 with fewer than 2 entries or Var(returns) 0.
    The mean of the residual does not count (the learner's `losses.explained_variance`)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    r = np.asarray(returns, dtype=np.float64).ravel()
    if r.size < 2:
        return 0.0
    var_r = r.var()
    if var_r <= 1e-12:
        return 0.0
    return float(1.0 - (r - v).var() / var_r)


def explained_variance_by_segment(values: np.ndarray, returns: np.ndarray,
                                  segments: np.ndarray,
                                  names: Sequence[str] = SEGMENTS) -> Dict[str, float]:
    """{name: EV over the tokens whose segment index is names.index(name)} plus "all"; a
    segment with fewer than 2 tokens is left out."""
    segments = np.asarray(segments)
    out = {"all": explained_variance(values, returns)}
    for i, name in enumerate(names):
        sel = segments == i
        if sel.sum() >= 2:
            out[name] = explained_variance(np.asarray(values)[sel], np.asarray(returns)[sel])
    return out


def between_prompt_share(rewards: np.ndarray) -> Dict[str, float]:
    """The between-prompt share of reward variance from `rewards` [n prompts, G samples].

    One-way random-effects ANOVA: with group means m_i, grand mean m, MSB = G * sum (m_i - m)^2
    / (n - 1) and MSW = sum (r_ij - m_i)^2 / (n (G - 1)), the between-prompt variance is
    s_b = max((MSB - MSW) / G, 0) and the within-prompt variance s_w = MSW (both unbiased, unlike
    the plain variance of the group means, which counts MSW / G of noise as signal). The share
    s_b / (s_b + s_w) is the explained variance of the best predictor that sees only the prompt
    (the true per-prompt mean), for a new sample of a new prompt. Returns the share and its
    parts; share 0 when there is no variance. Needs n >= 2 and G >= 2.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] < 2 or r.shape[1] < 2:
        raise ValueError(f"rewards of shape {r.shape}: need [prompts >= 2, samples >= 2] to "
                         "separate between- from within-prompt variance")
    n, g = r.shape
    means = r.mean(axis=1)
    msb = g * ((means - r.mean()) ** 2).sum() / (n - 1)
    msw = ((r - means[:, None]) ** 2).sum() / (n * (g - 1))
    between = max((msb - msw) / g, 0.0)
    total = between + msw
    return {"share": between / total if total > 1e-12 else 0.0, "between_var": between,
            "within_var": msw, "naive_share": (float(means.var()) / float(r.var())
                                               if r.var() > 1e-12 else 0.0)}


def ridge_probe(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
                alpha: float) -> np.ndarray:
    """Predictions on x_test of ridge regression fitted on (x_train, y_train): the weights
    minimise |y - b - X w|^2 + alpha |w|^2 (the intercept b is not penalised), solved in closed
    form on centred data: w = (Xc' Xc + alpha I)^-1 Xc' yc, b = mean(y) - mean(X) w."""
    x = np.asarray(x_train, dtype=np.float64)
    y = np.asarray(y_train, dtype=np.float64)
    if alpha < 0:
        raise ValueError(f"alpha={alpha}: must be >= 0")
    mx, my = x.mean(axis=0), y.mean()
    xc = x - mx
    w = np.linalg.solve(xc.T @ xc + alpha * np.eye(x.shape[1]), xc.T @ (y - my))
    return (np.asarray(x_test, dtype=np.float64) - mx) @ w + my


def segment_of_tokens(token_texts: Sequence[str], answer_marker: str = "####") -> np.ndarray:
    """Segment index (into SEGMENTS) of each completion token, from the text each token adds.

    The completion is read as lines: the answer starts at `answer_marker` (GSM8K's "####";
    without one there is no answer segment), the last step is the last line before the answer
    that holds an "=" (the line that computes the number the answer repeats; none without
    such a line), everything between the first token and that line is before it. Token 0 is "first". A token belongs
    to the segment where its text starts.
    """
    starts, pos = [], 0
    for t in token_texts:
        starts.append(pos)
        pos += len(t)
    text = "".join(token_texts)
    answer_at = text.find(answer_marker)
    head = text if answer_at < 0 else text[:answer_at]
    last_step_at = len(text) + 1   # no line with "=": no last-step segment
    lines = head.split("\n")
    offset = 0
    line_starts = []
    for line in lines:
        line_starts.append((offset, line))
        offset += len(line) + 1
    for start, line in reversed(line_starts):
        if "=" in line:
            last_step_at = start
            break
    out = np.empty(len(token_texts), dtype=np.int64)
    for i, s in enumerate(starts):
        if i == 0:
            out[i] = 0
        elif answer_at >= 0 and s >= answer_at:
            out[i] = 3
        elif s >= last_step_at:
            out[i] = 2
        else:
            out[i] = 1
    return out
