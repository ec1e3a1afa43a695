"""Admission control: how many rollouts actors may start, as a pure object (no gRPC, no threads).

AReaL's rule bounds staleness at the source: with v the newest policy version, eta the
staleness limit and B the rollouts per learner step, actors may have started at most

    capacity(v) = (max(v, 0) + eta + 1) * B + credit

rollouts, where `credit` counts the rollouts the learner dropped for good (too stale): without
it, actors whose quota went to dropped rollouts would wait for a version that never comes.
Slots of admitted rollouts that will never arrive (refused by the writer, lost with a crashed
actor) come back as `released` with a later request.

The caller serialises calls (the variable server holds its lock) and persists `state()`.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping

# Per-actor counts kept for stats and restarts; beyond this many ids, the rest share one bucket.
MAX_TRACKED_ACTORS = 4096
OTHER_ACTORS = "<other>"


@dataclasses.dataclass(frozen=True)
class AdmitDecision:
    granted: int          # how many of the requested rollouts may start now (0..count)
    started_total: int    # rollouts started so far, all actors, this grant included
    capacity: int         # the bound the grant was checked against


class Admission:
    """The admission counters and AReaL's rule.

    Args:
      batch_size: B, rollouts per learner step (>= 1).
      max_staleness: eta, the staleness limit in versions (>= 0).
      enabled: False grants every request in full (the counters still count).
    """

    def __init__(self, batch_size: int, max_staleness: int, enabled: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1 (rollouts per learner step)")
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0; 0 means strictly "
                             "on-policy")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.enabled = enabled
        self.started_total = 0                       # started, less the released slots
        self.started_by_actor: Dict[str, int] = {}   # granted per actor (never decreases)
        self.released_total = 0                      # slots given back
        self.credit = 0                              # the learner's dropped_total (max seen)

    def capacity(self, version: int) -> int:
        """The bound on `started_total` at policy `version` (< 0: nothing published, as 0)."""
        return (max(version, 0) + self.max_staleness + 1) * self.batch_size + self.credit

    def add_credit(self, dropped_total: int) -> bool:
        """Raises the credit to `dropped_total` (it never goes down: a learner that restarted
        with a smaller count cannot take back slots it gave). True if it changed."""
        if dropped_total < 0:
            raise ValueError(f"dropped_total={dropped_total}: must be >= 0")
        if dropped_total <= self.credit:
            return False
        self.credit = dropped_total
        return True

    def admit(self, actor_id: str, count: int, released: int, version: int) -> AdmitDecision:
        """Returns `released` slots (at most what was started), then grants up to `count`
        rollouts to `actor_id`: all of them when disabled, else as many as keep
        `started_total <= capacity(version)`."""
        if count < 1:
            raise ValueError(f"count={count}: must be >= 1 (rollouts the actor wants to start)")
        if released < 0:
            raise ValueError(f"released={released}: must be >= 0 (admitted rollouts the actor "
                             "will never insert)")
        released = min(released, self.started_total)
        self.started_total -= released
        self.released_total += released
        capacity = self.capacity(version)
        granted = count if not self.enabled else max(0, min(count, capacity - self.started_total))
        self.started_total += granted
        if actor_id not in self.started_by_actor and \
                len(self.started_by_actor) >= MAX_TRACKED_ACTORS:
            actor_id = OTHER_ACTORS
        self.started_by_actor[actor_id] = self.started_by_actor.get(actor_id, 0) + granted
        return AdmitDecision(granted, self.started_total, capacity)

    def granted_to(self, actor_id: str) -> int:
        """Rollouts ever granted to `actor_id` (those of the shared bucket for an id beyond
        MAX_TRACKED_ACTORS): an upper bound on the rollouts that actor can have made."""
        if actor_id in self.started_by_actor:
            return self.started_by_actor[actor_id]
        return self.started_by_actor.get(OTHER_ACTORS, 0)

    @property
    def granted_total(self) -> int:
        """Rollouts ever granted to any actor (released slots included: never decreases)."""
        return sum(self.started_by_actor.values())

    def state(self) -> dict:
        """The counters (JSON-ready); `from_state` restores them."""
        return {"started_total": self.started_total,
                "started_by_actor": dict(self.started_by_actor),
                "released_total": self.released_total, "credit": self.credit}

    @classmethod
    def from_state(cls, state: Mapping, batch_size: int, max_staleness: int,
                   enabled: bool = True) -> "Admission":
        """An Admission with the given rule and the counters of `state()`; ValueError if `state`
        is not one."""
        admission = cls(batch_size, max_staleness, enabled)
        try:
            counts = {k: int(state[k]) for k in ("started_total", "released_total", "credit")}
            by_actor = {str(k): int(v) for k, v in dict(state["started_by_actor"]).items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not an admission state ({type(e).__name__}: {e}): {state!r:.200}")
        if min([*counts.values(), *by_actor.values(), 0]) < 0:
            raise ValueError(f"admission state has negative counts: {state!r:.200}")
        admission.started_total = counts["started_total"]
        admission.released_total = counts["released_total"]
        admission.credit = counts["credit"]
        admission.started_by_actor = by_actor
        return admission
