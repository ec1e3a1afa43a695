"""The single-rollout, critic-free baseline (algorithm=critic_free): its pure pieces.

One rollout per prompt, as in SAO, but no critic: every action token of a rollout gets the same
advantage, its total reward minus a tracked baseline,

    A_i = R_i - b(prompt_i)                  (whitened over the batch if normalize_advantages)

with b one of two trackers, read before the batch updates them (so R_i never baselines itself):
  - running_mean: one exponential moving average of all rewards, b <- d b + (1 - d) mean(R_batch);
  - per_prompt:   an EMA per prompt (keyed by the prompt's token ids), b_p <- d b_p + (1 - d) R,
                  falling back to the running mean for prompts not seen before.

A controlled run separates prompt diversity from single-rollout sampling (docs/METHOD.md section 12):
SAO (critic) vs this learner (no critic) on the same 128 x 1 batches, and this learner vs GRPO
(group baseline) on the same number of distinct prompts.

The learner runs it as `estimators.TrackedBaseline`. Its `value_loss` / `explained_variance`
metrics describe the baseline as a predictor of the reward (0.5 (R - b)^2, 1 - Var(R - b) /
Var(R)).
"""
from __future__ import annotations

import collections
from typing import Dict, Hashable, List, Optional, Sequence

import numpy as np
import torch

from sao_actor_learner.safe_records import plain_class
from sao_actor_learner.types import Batch, Rollout


# --- pure pieces ----------------------------------------------------------------------------------
def sequence_rewards(batch: Batch) -> torch.Tensor:
    """[B] total reward of each rollout (the sum of its per-token rewards)."""
    return batch.rewards.sum(dim=1)


def broadcast_to_action_tokens(scores: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: scores[b] on every action token of row b, 0 elsewhere."""
    return scores.to(action_mask.dtype)[:, None] * action_mask


def prompt_key(rollout: Rollout) -> bytes:
    """The prompt a rollout answered: its token ids before the first action token, as bytes."""
    actions = np.flatnonzero(rollout.action_mask)
    end = int(actions[0]) if actions.size else rollout.length
    return rollout.tokens[:end].astype(np.int32).tobytes()


@plain_class   # kept in learner checkpoints (safe_records.py)
class RunningMeanBaseline:
    """An exponential moving average of rewards, one number for every prompt.

    `values(keys)` returns the current estimate for each rollout (the first batch's own mean before
    any update); `update(keys, rewards)` folds in a batch's mean reward.
    """

    def __init__(self, decay: float = 0.9):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay}: must be in [0, 1)")
        self.decay = decay
        self.mean: Optional[float] = None

    def values(self, keys: Sequence[Hashable], rewards: np.ndarray) -> np.ndarray:
        rewards = np.asarray(rewards, dtype=np.float64)
        b = float(rewards.mean()) if self.mean is None else self.mean
        return np.full(len(keys), b)

    def update(self, keys: Sequence[Hashable], rewards: np.ndarray) -> None:
        m = float(np.mean(rewards))
        self.mean = m if self.mean is None else self.decay * self.mean + (1 - self.decay) * m


@plain_class   # kept in learner checkpoints (safe_records.py)
class PerPromptBaseline:
    """A per-prompt EMA of rewards (a tabular value tracker), with a running-mean fallback.

    A prompt seen before gets its own estimate; an unseen prompt gets the global running mean.
    At most `max_prompts` prompts are remembered (least recently updated forgotten first).
    """

    def __init__(self, decay: float = 0.9, max_prompts: int = 100_000):
        if max_prompts < 1:
            raise ValueError(f"max_prompts={max_prompts}: must be >= 1")
        self.decay = decay
        self.max_prompts = max_prompts
        self.fallback = RunningMeanBaseline(decay)
        self.table: "collections.OrderedDict[Hashable, float]" = collections.OrderedDict()

    def values(self, keys: Sequence[Hashable], rewards: np.ndarray) -> np.ndarray:
        default = self.fallback.values(keys, rewards)
        return np.array([self.table.get(k, d) for k, d in zip(keys, default)], dtype=np.float64)

    def update(self, keys: Sequence[Hashable], rewards: np.ndarray) -> None:
        for k, r in zip(keys, np.asarray(rewards, dtype=np.float64)):
            old = self.table.pop(k, None)
            self.table[k] = float(r) if old is None else self.decay * old + (1 - self.decay) * r
            if len(self.table) > self.max_prompts:
                self.table.popitem(last=False)
        self.fallback.update(keys, rewards)


def make_baseline(name: str, decay: float):
    """The tracker called `name` (config.CRITIC_FREE_BASELINES)."""
    if name == "running_mean":
        return RunningMeanBaseline(decay)
    if name == "per_prompt":
        return PerPromptBaseline(decay)
    raise ValueError(f"baseline={name!r}: must be running_mean or per_prompt")


def baseline_stats(rewards: np.ndarray, baseline: np.ndarray) -> Dict[str, float]:
    """The baseline as a reward predictor: value_loss 0.5 mean (R - b)^2, explained variance."""
    rewards = np.asarray(rewards, dtype=np.float64)
    err = rewards - np.asarray(baseline, dtype=np.float64)
    var = rewards.var()
    return {"value_loss": float(0.5 * np.mean(err ** 2)),
            "explained_variance": float(1.0 - err.var() / var) if var > 1e-12 else 0.0,
            "baseline_mean": float(np.mean(baseline))}
