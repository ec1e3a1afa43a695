"""How a learner step draws its rollouts: single rollouts, or whole groups, within the bound.

Staleness (docs/METHOD.md, asynchrony): a rollout trained at version v has staleness
v - (the oldest version among its action tokens). Nothing staler than `max_staleness` is trained
on: `RolloutSampler` drops such rollouts (and `GroupSampler` drops a whole group when any member
is too stale), counts them, and tells `on_drop` (the learner reports the new admission credit).
Both return early when `stop` is set, and call `on_wait` (when set) before each request to the
source, so the learner notices a broken or drained replay while it waits for a batch.

Exactly once: every rollout taken (into a batch) or dropped is added to `consumed` (its key,
learner/consumed.py), and a rollout whose key is already there is skipped and counted in
`duplicates` (delivery from actors is at least once). A rollout with an action token newer
than the learner's version cannot have been sampled by any engine: refused and counted
(`rejected["version_from_future"]`).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, List, Optional, Tuple

from sao_actor_learner import core
from sao_actor_learner.learner.consumed import ConsumedKeys
from sao_actor_learner.learner.grpo import GroupAssembler
from sao_actor_learner.types import Rollout

DropCallback = Callable[[List[Rollout]], None]


def too_stale(staleness: int, max_staleness: int) -> bool:
    """The learner's drop rule: a rollout this many versions stale is not trained on when
    it exceeds eta = max_staleness. The samplers and the staleness planner both use it."""
    return staleness > max_staleness


class RolloutSampler:
    """n rollouts no staler than max_staleness from `source`, oldest first.

    Args:
      source: the learner's RolloutSource (replay through the journal).
      max_staleness: eta.
      on_drop: called with the rollouts just dropped as too stale (None: nobody).
    """

    def __init__(self, source: core.RolloutSource, max_staleness: int,
                 on_drop: Optional[DropCallback] = None):
        self.source = source
        self.max_staleness = max_staleness
        self.on_drop = on_drop
        self.on_wait: Optional[Callable[[], None]] = None   # before each request to the source
        self.consumed = ConsumedKeys()
        self.dropped = 0                   # rollouts dropped for staleness, in total
        self.duplicates = 0                # rollouts skipped: their key was already consumed
        self.from_future = 0               # rollouts refused: a version newer than the learner's

    def is_stale(self, rollout: Rollout, version: int) -> bool:
        return too_stale(rollout.staleness(version), self.max_staleness)

    def _drop(self, rollouts: List[Rollout]) -> None:
        self.dropped += len(rollouts)
        for r in rollouts:
            self.consumed.add(r.key)
        if self.on_drop is not None:
            self.on_drop(rollouts)

    def _admissible(self, got: List[Rollout], version: int) -> List[Rollout]:
        """`got` without duplicates (consumed keys, or repeated within `got`) and without
        rollouts from the future; both counted."""
        out, seen = [], set()
        for r in got:
            key = r.key
            if self.consumed.contains(key) or (key[1] >= 0 and key in seen):
                self.duplicates += 1
                continue
            mask = r.action_mask.astype(bool)
            if mask.any() and int(r.versions[mask].max()) > version:
                self.from_future += 1
                self.consumed.add(key)
                continue
            seen.add(key)
            out.append(r)
        return out

    def sample(self, n: int, version: int, stop: threading.Event
               ) -> Tuple[List[Rollout], float, int]:
        """(rollouts, seconds spent waiting, dropped now)."""
        fresh: List[Rollout] = []
        waited, dropped = 0.0, 0
        while len(fresh) < n and not stop.is_set():
            if self.on_wait is not None:
                self.on_wait()
            t0 = time.time()
            got = self._admissible(self.source.sample(n - len(fresh), timeout_s=1.0), version)
            waited += time.time() - t0
            stale = [r for r in got if self.is_stale(r, version)]
            taken = [r for r in got if not self.is_stale(r, version)]
            for r in taken:
                self.consumed.add(r.key)
            fresh.extend(taken)
            if stale:
                dropped += len(stale)
                self._drop(stale)
        return fresh, waited, dropped

    def state_dict(self) -> dict:
        return {"dropped": self.dropped, "duplicates": self.duplicates,
                "from_future": self.from_future, "consumed": self.consumed.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.dropped = int(state.get("dropped", 0))
        self.duplicates = int(state.get("duplicates", 0))
        self.from_future = int(state.get("from_future", 0))
        self.consumed.load_state_dict(state.get("consumed", {}))


class GroupSampler(RolloutSampler):
    """n // group_size whole groups (members share group_id), none with a member staler than
    max_staleness; groups may arrive interleaved, `GroupAssembler` holds members until their
    group is complete."""

    def __init__(self, source: core.RolloutSource, max_staleness: int, group_size: int,
                 on_drop: Optional[DropCallback] = None):
        super().__init__(source, max_staleness, on_drop)
        self.group_size = group_size
        self.assembler = GroupAssembler(group_size)

    def sample(self, n: int, version: int, stop: threading.Event
               ) -> Tuple[List[Rollout], float, int]:
        G = self.group_size
        want = n // G
        groups: List[List[Rollout]] = []
        waited, dropped = 0.0, 0
        while len(groups) < want and not stop.is_set():
            stale = self.assembler.take_stale(lambda r: self.is_stale(r, version))
            if stale:
                dropped += len(stale)
                self._drop(stale)
            groups += self.assembler.pop_complete(want - len(groups))
            if len(groups) >= want:
                break
            missing = (want - len(groups)) * G - self.assembler.num_buffered
            if self.on_wait is not None:
                self.on_wait()
            t0 = time.time()
            got = self._admissible(self.source.sample(max(missing, G), timeout_s=1.0), version)
            for r in got:     # held by the assembler from now on (its state is checkpointed)
                self.consumed.add(r.key)
            self.assembler.add(got)
            waited += time.time() - t0
        return [r for g in groups for r in g], waited, dropped

    def state_dict(self) -> dict:
        return {**super().state_dict(), "assembler": self.assembler}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if state.get("assembler") is not None:
            self.assembler = state["assembler"]
