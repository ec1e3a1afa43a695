"""The statistics of one learner step that describe its batch rather than its math: staleness
(with the per-rollout version spans, drift.py), rewards and lengths, and what the learner refused
to train on. Group-wide: every rank must call them (they are collectives).
"""
from __future__ import annotations

from typing import Dict, Sequence

import numpy as np

from sao_actor_learner import core
from sao_actor_learner.learner import drift
from sao_actor_learner.learner.distributed import Collective
from sao_actor_learner.learner.sampling import RolloutSampler
from sao_actor_learner.types import Batch, Rollout


def batch_stats(batch: Batch, rollouts: Sequence[Rollout], version: int, max_staleness: int,
                collective: Collective) -> Dict[str, float]:
    """Staleness (token and rollout level, histogram, version spans), reward and length
    statistics of the whole group's batch; `version` is the one the batch trained."""
    mask = batch.action_mask.bool()
    token_staleness = (version - batch.versions)[mask].double()
    staleness = [r.staleness(version) for r in rollouts]
    rewards = [r.total_reward for r in rollouts]
    parts = collective.gather_objects(
        (staleness, rewards, float(token_staleness.sum()), int(token_staleness.numel()),
         float(mask.sum(1).double().sum()), drift.version_spans(batch.versions, mask)))
    staleness = [s for p in parts for s in p[0]]
    spans = [s for p in parts for s in p[5]]
    rewards = np.array([r for p in parts for r in p[1]])
    n_tokens = sum(p[3] for p in parts)
    hist = np.bincount(np.array(staleness, dtype=np.int64), minlength=max_staleness + 1)
    return {
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
        "staleness_mean": sum(p[2] for p in parts) / n_tokens if n_tokens else 0.0,
        "staleness_max": int(max(staleness)), "staleness_hist": hist.tolist(),
        "response_length_mean": sum(p[4] for p in parts) / len(staleness),
        "batch_size": len(staleness), **drift.staleness_stats(staleness, spans),
    }


def integrity_counters(source: core.RolloutSource, sampler: RolloutSampler,
                       collective: Collective) -> Dict[str, int]:
    """Group-wide counts of what the learner refused to train on: duplicates (keys already
    consumed), rollouts from the future, and replay items the source refused, by reason."""
    refused = source.rejected
    names = sorted(set().union(*collective.gather_objects(sorted(refused))))
    values = collective.sum([sampler.duplicates, sampler.from_future] +
                            [refused.get(n, 0) for n in names])
    out = {"duplicates_skipped": int(values[0]), "refused_version_from_future": int(values[1])}
    out.update({f"refused_{n}": int(v) for n, v in zip(names, values[2:])})
    out["refused_total"] = sum(v for k, v in out.items() if k.startswith("refused_"))
    return out
