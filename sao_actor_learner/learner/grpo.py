"""The GRPO baseline (config algorithm=grpo): G rollouts per prompt, group-normalised advantages.

Actors in group mode (config group_size=G) roll out each prompt G times and insert the G
rollouts together (they share `group_id`). A learner step trains on B = P x G rollouts: P whole
groups. Every action token of rollout i in group g gets

    A_i = (R_i - mean_g R) / (std_g R + eps)       (std: unbiased, as TRL; scale_by_std=False
                                                    drops the division, as Dr. GRPO does)

No critic. The policy loss is config.policy_loss: `ppo_clip` (old log-probs recomputed by the
learner) is GRPO, `dis` is "GRPO w/ DIS"; tis, icepop and none are available too.

Staleness stays per token: a group is trained only if every member's staleness (learner version
minus the oldest version among its action tokens) is <= max_staleness; otherwise the whole group
is dropped and its rollouts counted in dropped_stale. Groups may arrive interleaved with other
actors' rollouts; `GroupAssembler` holds members until their group is complete.
"""
from __future__ import annotations

import collections
from typing import Callable, Dict, Hashable, List, Sequence, Tuple

import torch

from sao_actor_learner.safe_records import plain_class
from sao_actor_learner.types import Rollout


def group_members(group_ids: Sequence[Hashable], count: int) -> List[List[int]]:
    """The indices of each group's members (first-seen order); ValueError unless there is one
    group id per reward (`count`)."""
    if len(group_ids) != count:
        raise ValueError(f"{len(group_ids)} group ids for {count} rewards")
    index: Dict[Hashable, List[int]] = collections.defaultdict(list)
    for i, g in enumerate(group_ids):
        index[g].append(i)
    return list(index.values())


def group_normalized_advantages(rewards: torch.Tensor, group_ids: Sequence[Hashable],
                                scale_by_std: bool = True, eps: float = 1e-6
                                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-rollout GRPO advantages and the group means.

    rewards: [B] float; group_ids: B hashable ids (members of a group need not be adjacent).
    Returns (advantages [B], group_mean [B]). A group of one rollout has advantage 0; with
    scale_by_std, a group whose rewards are all equal has advantage 0 too.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    adv = torch.zeros_like(rewards)
    means = torch.zeros_like(rewards)
    for members in group_members(group_ids, rewards.shape[0]):
        idx = torch.as_tensor(members)
        r = rewards[idx]
        mean = r.mean()
        a = r - mean
        if scale_by_std and len(members) > 1:
            a = a / (r.std(unbiased=True) + eps)
        adv[idx] = a
        means[idx] = mean
    return adv, means


@plain_class   # kept in learner checkpoints (safe_records.py)
class GroupAssembler:
    """Collects rollouts into whole groups of `group_size` by group_id.

    Complete groups come out in the order they completed. `take_stale` removes every group
    (complete or not) with a stale member and returns its rollouts (`drop_stale`: how many).
    """

    def __init__(self, group_size: int):
        if group_size < 1:
            raise ValueError(f"group_size={group_size}: must be >= 1")
        self.group_size = group_size
        self._pending: "collections.OrderedDict[Hashable, List[Rollout]]" = collections.OrderedDict()
        self._complete: "collections.deque[List[Rollout]]" = collections.deque()

    @property
    def num_complete(self) -> int:
        return len(self._complete)

    @property
    def num_buffered(self) -> int:
        """Rollouts held, in complete and incomplete groups."""
        return sum(len(g) for g in self._complete) + sum(len(g) for g in self._pending.values())

    def add(self, rollouts: Sequence[Rollout]) -> None:
        for r in rollouts:
            members = self._pending.setdefault(r.group_id, [])
            members.append(r)
            if len(members) == self.group_size:
                self._complete.append(self._pending.pop(r.group_id))

    def drop_stale(self, is_stale: Callable[[Rollout], bool]) -> int:
        return len(self.take_stale(is_stale))

    def take_stale(self, is_stale: Callable[[Rollout], bool]) -> List[Rollout]:
        """Removes every group (complete or not) with a stale member; returns their rollouts."""
        dropped: List[Rollout] = []
        keep = collections.deque()
        for g in self._complete:
            if any(is_stale(r) for r in g):
                dropped += g
            else:
                keep.append(g)
        self._complete = keep
        for gid in [gid for gid, g in self._pending.items() if any(is_stale(r) for r in g)]:
            dropped += self._pending.pop(gid)
        return dropped

    def pop_complete(self, max_groups: int) -> List[List[Rollout]]:
        out = []
        while self._complete and len(out) < max_groups:
            out.append(self._complete.popleft())
        return out
