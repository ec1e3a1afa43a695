"""Splitting a collated batch: policy minibatches (optimizer steps) and token-budget
micro-batches (gradient accumulation).

Minibatches: `policy_minibatches` = M turns one learner step into M policy optimizer steps on
consecutive slices of the batch's rows (advantages are computed once, on the whole batch). The
policy version counts learner steps (publishes), not optimizer steps.

Micro-batches: `pack_by_tokens(lengths, budget)` groups rows so that each group, padded to its
own longest row, holds at most `budget` tokens (rows sorted by length first, so rows of similar
length share a group and little is padding). A row longer than the budget is a group of its own.
Each group is collated again at its own width (`select_rows(..., trim=True)`): gradients are
accumulated over the groups and one optimizer step follows, with every loss normalised by the
whole batch's denominator, so the result equals the whole-batch step.

With micro_batch_layout=packed the groups are `pack_by_token_sum`'s (summed lengths <= budget,
first-fit decreasing) and each runs as one padding-free row (learner/packing.py).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Sequence

import numpy as np
import torch

from sao_actor_learner.types import Batch


def row_splits(batch_size: int, num_minibatches: int) -> List[np.ndarray]:
    """`num_minibatches` consecutive, near-equal, non-empty slices of range(batch_size)."""
    if not 1 <= num_minibatches <= batch_size:
        raise ValueError(f"num_minibatches={num_minibatches}: must be in [1, batch size "
                         f"{batch_size}]")
    return [rows for rows in np.array_split(np.arange(batch_size), num_minibatches)]


def pack_by_tokens(lengths: Sequence[int], budget: int) -> List[np.ndarray]:
    """Row groups whose padded size (rows x longest row) is <= budget; budget 0: one group.

    Rows are taken longest first; a group is closed when the next row would push it past the
    budget. Every row is in exactly one group; groups list rows in increasing order.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if budget < 0:
        raise ValueError(f"budget={budget}: must be >= 0 (0: the whole batch at once)")
    if budget == 0 or lengths.size == 0 or lengths.size * int(lengths.max()) <= budget:
        return [np.arange(lengths.size)]
    order = np.argsort(-lengths, kind="stable")
    groups: List[List[int]] = []
    current: List[int] = []
    width = 0
    for row in order:
        w = max(width, int(lengths[row]))
        if current and (len(current) + 1) * w > budget:
            groups.append(current)
            current, w = [], int(lengths[row])
        current.append(int(row))
        width = w
    groups.append(current)
    return [np.sort(np.asarray(g, dtype=np.int64)) for g in groups]


def pack_by_token_sum(lengths: Sequence[int], budget: int) -> List[np.ndarray]:
    """Row groups whose summed length is <= budget (packed micro-batches: one row of the
    group's real tokens, no padding); budget 0: one group.

    First-fit decreasing: rows are taken longest first (ties by row), each into the first group
    it still fits in, else into a new group; a row longer than the budget is a group of its
    own. Every row is in exactly one group; groups list rows in increasing order.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if budget < 0:
        raise ValueError(f"budget={budget}: must be >= 0 (0: the whole batch at once)")
    if budget == 0 or lengths.size == 0 or int(lengths.sum()) <= budget:
        return [np.arange(lengths.size)]
    groups: List[List[int]] = []
    room: List[int] = []
    for row in np.argsort(-lengths, kind="stable"):
        n = int(lengths[row])
        fits = [g for g in range(len(groups)) if room[g] >= n]
        if fits:
            groups[fits[0]].append(int(row))
            room[fits[0]] -= n
        else:
            groups.append([int(row)])
            room.append(budget - n)
    return [np.sort(np.asarray(g, dtype=np.int64)) for g in groups]


def micro_batch_groups(lengths: Sequence[int], budget: int, layout: str = "padded"
                       ) -> List[np.ndarray]:
    """The micro-batches of rows with these lengths under config micro_batch_layout: padded
    (`pack_by_tokens`: rows x longest row <= budget) or packed (`pack_by_token_sum`: the rows'
    tokens <= budget)."""
    if layout == "packed":
        return pack_by_token_sum(lengths, budget)
    if layout != "padded":
        raise ValueError(f"micro_batch_layout={layout!r}: must be padded or packed")
    return pack_by_tokens(lengths, budget)


def select_rows(batch: Batch, rows: Sequence[int], trim: bool = False) -> Batch:
    """The sub-batch of `rows` (tensors indexed along dim 0); with `trim`, cut to the longest
    selected row (the padding the other rows needed goes)."""
    index = torch.as_tensor(np.asarray(rows), dtype=torch.long)
    width = int(batch.lengths.index_select(0, index).max()) if trim and len(rows) else None
    fields = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            value = value.index_select(0, index.to(value.device))
            if width is not None and value.ndim == 2:
                value = value[:, :width]
            fields[f.name] = value
        else:  # the rollouts list
            fields[f.name] = [value[int(i)] for i in rows]
    return Batch(**fields)


def per_token_no_grad(batch: Batch, budget: int, layout: str,
                      per_token: Callable[[Batch], torch.Tensor]) -> torch.Tensor:
    """[B, T] float32: `per_token(micro)` ([b, t'] for each trimmed micro-batch of
    `micro_batch_groups`) written back into the whole batch's rows, without gradient (the
    policy's old log-probs, the critic's values)."""
    out = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=batch.tokens.device)
    with torch.no_grad():
        for rows in micro_batch_groups(batch.lengths.tolist(), budget, layout):
            micro = select_rows(batch, rows, trim=True)
            out[torch.as_tensor(rows, device=out.device), :micro.tokens.shape[1]] = \
                per_token(micro)
    return out
