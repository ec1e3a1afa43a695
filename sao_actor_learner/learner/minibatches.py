"""Splitting a collated batch into policy minibatches, and merging their statistics.

`config.policy_minibatches` = M turns one learner step into M policy optimizer steps on
consecutive slices of the batch's rows (advantages are computed once, on the whole batch). The
policy version still counts learner steps (publishes), not optimizer steps.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

import numpy as np
import torch

from sao_actor_learner.types import Batch


def row_splits(batch_size: int, num_minibatches: int) -> List[np.ndarray]:
    """`num_minibatches` consecutive, near-equal, non-empty slices of range(batch_size)."""
    if not 1 <= num_minibatches <= batch_size:
        raise ValueError(f"num_minibatches={num_minibatches}: must be in [1, batch size "
                         f"{batch_size}]")
    return [rows for rows in np.array_split(np.arange(batch_size), num_minibatches)]


def select_rows(batch: Batch, rows: Sequence[int]) -> Batch:
    """The sub-batch of `rows` (tensors indexed along dim 0; padding kept as is)."""
    index = torch.as_tensor(np.asarray(rows), dtype=torch.long)
    fields = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            fields[f.name] = value.index_select(0, index.to(value.device))
        else:  # the rollouts list
            fields[f.name] = [value[int(i)] for i in rows]
    return Batch(**fields)


def merge_stats(per_minibatch: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """One stats dict from several: max of *_max, min of *_min, sum of num_*, mean of the rest."""
    if len(per_minibatch) == 1:
        return dict(per_minibatch[0])
    merged: Dict[str, float] = {}
    for key in per_minibatch[0]:
        values = [s[key] for s in per_minibatch if isinstance(s.get(key), (int, float))]
        if not values:
            continue
        if key.endswith("_max"):
            merged[key] = max(values)
        elif key.endswith("_min"):
            merged[key] = min(values)
        elif key.startswith("num_"):
            merged[key] = sum(values)
        else:
            merged[key] = float(np.mean(values))
    merged["policy_minibatches"] = len(per_minibatch)
    return merged
