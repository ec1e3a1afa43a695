"""When the learner writes a checkpoint: on its cadence, or when the journal has grown too big.

The journal (journal.py) holds every rollout the learner took since its newest checkpoint, and
a checkpoint is the only thing that lets it start a new segment and delete the old ones. With
`checkpoint_every=0` (a checkpoint only at the end) it would hold every rollout of the run;
with a long cadence and long rollouts, more than the disk has. So a checkpoint is also due
once the current segment holds `journal_max_bytes` (`--journal_max_mb`): the journal then
stays below about twice that (the segment after the newest checkpoint and the one after the
previous, kept for a fallback), whatever the cadence.

No torch here.
"""
from __future__ import annotations

from typing import Callable


def checkpoint_due(version: int, checkpoint_every: int, journal_bytes: Callable[[], int],
                   journal_max_bytes: int) -> bool:
    """Whether the learner checkpoints after the step that made `version`: every
    `checkpoint_every` versions (0: none on a cadence), or once `journal_bytes()` (asked only
    when the cadence does not decide and `journal_max_bytes` > 0; a collective in a learner
    group, so every rank decides alike) reaches `journal_max_bytes`."""
    if checkpoint_every and version % checkpoint_every == 0:
        return True
    return journal_max_bytes > 0 and journal_bytes() >= journal_max_bytes
