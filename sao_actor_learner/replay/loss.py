"""Replay items that left the table without reaching the learner: a drain, a theft, a reset.

Reverb's port has no authentication (docs/DESIGN.md section 5): whoever reaches it can sample
items away, delete them or reset the table. Their rollouts stay in the actors' spools, but the
actors send them again only at a new loss epoch, and until then their admission slots stay
taken: after about (max_staleness + 1) x batch_size lost items the run would wait forever.

The learner's reader is the table's only legitimate consumer, so the table's own counters
say exactly how many items left it: `removed = inserts - current_size` (Reverb's rate limiter
counts completed inserts; sampling with max_times_sampled=1, a delete and a reset all shrink the
table without an insert). Every item removed must reach the reader, which counts what it
fetched (refused items too). `ReplayLossDetector.observe` compares the two:

- The first observation sets the baseline `offset = removed - fetched` (items taken before this
  reader existed: a previous learner's, which its restart's loss epoch covers). The reader makes
  it before its first fetch, so nothing of its own is in transit then.
- Items in transit (removed, not yet fetched) take milliseconds; so an observation is judged
  only once it is `timeout_s` old: everything removed by then must have been fetched by now.
  If `removed_then - offset > fetched_now`, the difference was taken by someone else: the
  verdict names it, and the offset absorbs it (each lost item is reported once).
- Fewer removals than fetches (`removed - offset < fetched`) means the baseline counted items
  of ours in transit, or the server came back from a checkpoint with items we already fetched:
  the offset is lowered (the lowest consistent with what was seen).
- A learner group: every rank's reader adds its fetches to one group-wide counter and rank 0's
  detector reads that total as `fetched` (a rank's fetch counted a moment after the item left
  the table is in transit like any other). A hung rank's uncounted fetches look like a theft:
  the loss epoch that follows is harmless (copies are skipped by key).
- Inserts going down means the table was reset (or replay restarted from an older checkpoint):
  what it held is gone; the verdict says so and the baseline starts again.

The learner turns a verdict into a loss epoch (the reader counts it as an interruption): actors
re-send every unacknowledged rollout sent before it, the learner skips the copies it already
has, and the re-sent rollouts are trained (or dropped as stale, which returns their admission
slots as credit). A drained table is so noticed `timeout_s` (plus one poll) after the drain.

What stays possible: a thief still reads what it takes (sampling is the only read there is,
and it is noticed); a copy it inserts again later is fetched and skipped as a duplicate (the
learner skips keys it consumed) or refused if altered (the signature). Junk inserts raise
`inserts` and, once the reader has fetched and refused them, `fetched` alike: not a loss.
Pure bookkeeping: no Reverb, no clock of its own.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Deque, Optional, Tuple

__all__ = ["LossVerdict", "ReplayLossDetector", "check_loss_timeout", "loss_detector"]


def check_loss_timeout(timeout_s: float) -> float:
    """timeout_s as a float; ValueError saying what to change when it is invalid."""
    value = float(timeout_s)
    if not value >= 0:
        raise ValueError(f"replay_loss_timeout_s={timeout_s}: must be >= 0 seconds (0: no "
                         "check of the table's counters)")
    return value


@dataclasses.dataclass(frozen=True)
class LossVerdict:
    """Items that left the table without reaching this reader (`missing`; -1: unknown, the
    table was reset), and why, for the log."""
    missing: int
    why: str


class ReplayLossDetector:
    """Compares the table's removals with the reader's fetches (see the module docstring).

    observe(now, inserts, current_size, fetched) -> LossVerdict or None. `fetched` must be read
    before the table's counters (so it never counts an item the counters do not show removed).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = check_loss_timeout(timeout_s)
        self._offset: Optional[int] = None
        self._inserts = 0
        self._pending: Deque[Tuple[float, int]] = collections.deque()   # (time, removed)
        self.missing_total = 0      # items reported missing so far
        self.resets = 0             # resets (or restores) seen

    def observe(self, now: float, inserts: int, current_size: int,
                fetched: int) -> Optional[LossVerdict]:
        removed = inserts - current_size
        if self._offset is None or inserts < self._inserts:
            reset = self._offset is not None
            self._offset, self._inserts = removed - fetched, inserts
            self._pending.clear()
            if reset:
                self.resets += 1
                return LossVerdict(-1, f"the table's insert count went back to {inserts}: it "
                                       "was reset (or replay restarted from an older "
                                       "checkpoint); the items it held are gone")
            return None
        self._inserts = inserts
        if removed - self._offset < fetched:      # ours were in transit at the baseline
            self._offset = removed - fetched
            self._pending.clear()
        self._pending.append((now, removed))
        judged = None
        while self._pending and now - self._pending[0][0] >= self.timeout_s:
            judged = self._pending.popleft()
        if judged is None:
            return None
        missing = judged[1] - self._offset - fetched
        if missing <= 0:
            return None
        self._offset += missing
        self._pending.clear()
        self.missing_total += missing
        return LossVerdict(missing, f"{missing} items left the table that this reader never "
                                    f"fetched within {self.timeout_s:g} s (someone else sampled "
                                    "or deleted them)")


def loss_detector(timeout_s: float, judge: bool = True) -> Optional[ReplayLossDetector]:
    """The learner reader's detector: None when off (timeout 0) or when this reader is not the
    judge. A learner group's ranks share the table: they count their fetches in one group-wide
    counter (RolloutReader's `fetch_counter`) and rank 0 alone compares it with the table."""
    return ReplayLossDetector(timeout_s) if timeout_s > 0 and judge else None
