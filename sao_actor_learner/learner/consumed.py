"""The rollouts a learner has consumed for good (trained, or dropped as too stale), by key.

Delivery from actors is at least once: an actor keeps every rollout until the learner
acknowledges it, and re-inserts what is not acknowledged when the learner reports a loss epoch
(a replay restart, a learner restart). Training is exactly once because the learner skips every
key (actor_id, seq) it has already consumed (`contains`).

Per actor the set is a watermark (every seq below it is consumed) plus the consumed seqs above
it; the watermark advances over every run of consecutive seqs, so with FIFO delivery the set
stays small. `acks()` is what the progress report tells the actors. Pure.
"""
from __future__ import annotations

from typing import Dict, Set, Tuple


class ConsumedKeys:
    """Consumed (actor_id, seq) keys: per actor a watermark and the seqs above it."""

    def __init__(self) -> None:
        self._watermark: Dict[int, int] = {}
        self._above: Dict[int, Set[int]] = {}

    def contains(self, key: Tuple[int, int]) -> bool:
        """Whether `key` was consumed; a key with seq < 0 (no spool named it) never is."""
        actor, seq = int(key[0]), int(key[1])
        if seq < 0:
            return False
        return seq < self._watermark.get(actor, 0) or seq in self._above.get(actor, ())

    def add(self, key: Tuple[int, int]) -> None:
        actor, seq = int(key[0]), int(key[1])
        if seq < 0:
            return   # not from a spool: nothing to acknowledge
        watermark = self._watermark.get(actor, 0)
        if seq < watermark:
            return
        above = self._above.setdefault(actor, set())
        above.add(seq)
        while watermark in above:
            above.discard(watermark)
            watermark += 1
        self._watermark[actor] = watermark

    def merge(self, state: dict) -> None:
        """Adds every key of another set (its `state_dict()`): the union of the two."""
        for actor, watermark in state.get("watermark", {}).items():
            actor = int(actor)
            w = max(self._watermark.get(actor, 0), int(watermark))
            above = {x for x in self._above.get(actor, set()) |
                     {int(x) for x in state.get("above", {}).get(actor, ())} if x >= w}
            while w in above:
                above.discard(w)
                w += 1
            self._watermark[actor], self._above[actor] = w, above

    def acks(self, max_seqs: int = 65536) -> Dict[int, Tuple[int, list]]:
        """actor -> (watermark, consumed seqs above it), at most `max_seqs` seqs in all (the
        lowest ones: a seq left out is only re-sent and skipped again)."""
        out, budget = {}, max_seqs
        for actor in sorted(self._watermark):
            seqs = sorted(self._above.get(actor, ()))[:max(budget, 0)]
            budget -= len(seqs)
            out[actor] = (self._watermark[actor], seqs)
        return out

    def __len__(self) -> int:
        return sum(self._watermark.values()) + sum(len(s) for s in self._above.values())

    def state_dict(self) -> dict:
        return {"watermark": dict(self._watermark),
                "above": {a: sorted(s) for a, s in self._above.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._watermark = {int(a): int(w) for a, w in state.get("watermark", {}).items()}
        self._above = {int(a): set(int(x) for x in s) for a, s in state.get("above", {}).items()}
