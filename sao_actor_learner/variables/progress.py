"""The learner's progress report: admission credit and the rollouts it consumed for good.

A report is cumulative: each one carries the learner's whole state, and the variable server
merges it into what it holds (`Progress.merged`): field by field the larger total and loss
epoch, and per actor the higher watermark with the union of the acknowledged seqs. Progress
never moves backwards, and a lost, repeated or older report (a resumed learner behind its
predecessor) changes nothing it should not: acknowledged rollouts stay acknowledged.

For each actor, `watermark` and `seqs` name the rollouts (by the actor's sequence numbers)
consumed for good, trained or dropped: every seq < watermark, and each one in seqs. An actor
keeps a rollout in its spool until it is acknowledged so; when `loss_epoch` goes up (queued
rollouts were lost), it re-inserts every spooled rollout not acknowledged.

A report may not name rollouts that cannot exist (`beyond_admitted`): the variable server
refuses one that acknowledges a seq an actor was never admitted to start, or counts more
dropped or trained rollouts than were ever admitted.

Pure: no gRPC, no threads.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterable, Mapping, Optional, Tuple

MAX_ACKS = 4096          # actors named in one report
MAX_SEQS = 65536         # seqs in one report, all actors together


@dataclasses.dataclass(frozen=True)
class ActorAcks:
    """One actor's consumed rollouts: every seq < watermark, and each of `seqs` (sorted, unique,
    each >= watermark)."""
    watermark: int = 0
    seqs: Tuple[int, ...] = ()

    def consumed(self, seq: int) -> bool:
        return seq < self.watermark or seq in self.seqs


@dataclasses.dataclass(frozen=True)
class Progress:
    """One progress report, checked and normalised; build it with `make_progress`."""
    version: int = -1
    dropped_total: int = 0
    trained_total: int = 0
    loss_epoch: int = 0
    acks: Mapping[int, ActorAcks] = dataclasses.field(default_factory=dict)

    def acked(self, actor_id: int) -> ActorAcks:
        """The actor's acknowledgements (watermark 0 and no seqs for one never named)."""
        return self.acks.get(actor_id, ActorAcks())

    def merged(self, new: "Progress") -> "Progress":
        """This report with `new` merged in (see the module docstring)."""
        acks: Dict[int, ActorAcks] = dict(self.acks)
        for actor_id, ack in new.acks.items():
            old = acks.get(actor_id, ActorAcks())
            watermark = max(old.watermark, ack.watermark)
            seqs = tuple(sorted({s for s in old.seqs + ack.seqs if s >= watermark}))
            acks[actor_id] = ActorAcks(watermark, seqs)
        return Progress(max(self.version, new.version),
                        max(self.dropped_total, new.dropped_total),
                        max(self.trained_total, new.trained_total),
                        max(self.loss_epoch, new.loss_epoch), dict(sorted(acks.items())))

    def to_state(self) -> dict:
        """JSON-ready form; `from_state` reads it back."""
        return {"version": self.version, "dropped_total": self.dropped_total,
                "trained_total": self.trained_total, "loss_epoch": self.loss_epoch,
                "acks": [[a, ack.watermark, list(ack.seqs)] for a, ack in self.acks.items()]}

    @classmethod
    def from_state(cls, state: Mapping) -> "Progress":
        try:
            return make_progress(state["version"], state["dropped_total"],
                                 state["trained_total"], state["loss_epoch"],
                                 {a: (w, seqs) for a, w, seqs in state["acks"]})
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a progress state ({type(e).__name__}: {e}): "
                             f"{state!r:.200}") from None


def beyond_admitted(report: Progress, granted_to: Callable[[int], int],
                    granted_total: int) -> Optional[str]:
    """Why `report` claims more than actors were ever admitted to start, or None when it does
    not. Every rollout an actor makes was admitted first, so an actor granted n rollouts uses
    seqs below n: a report acknowledging seq >= n for it (its watermark above n, or such a seq),
    or counting more dropped or trained rollouts than were ever granted to all actors, names
    rollouts that cannot exist. Such a report would make actors forget rollouts they make later
    (the acknowledgement persists) or lift admission for good (the credit never goes down).
    `granted_to(actor_id)`: rollouts ever granted to that actor."""
    for actor_id, ack in report.acks.items():
        granted = granted_to(actor_id)
        highest = max(ack.watermark, ack.seqs[-1] + 1 if ack.seqs else 0)
        if highest > granted:
            return (f"actor {actor_id}: acknowledges rollouts up to seq {highest - 1} (watermark "
                    f"{ack.watermark}) but the actor was admitted to start only {granted} "
                    "(seqs below that): a report may acknowledge only rollouts that were admitted")
    for name, value in (("dropped_total", report.dropped_total),
                        ("trained_total", report.trained_total)):
        if value > granted_total:
            return (f"{name}={value} exceeds the {granted_total} rollouts ever admitted to all "
                    "actors")
    return None


def make_progress(version: int, dropped_total: int, trained_total: int, loss_epoch: int,
                  acks: Mapping[int, Tuple[int, Iterable[int]]]) -> Progress:
    """A checked `Progress`. `acks`: actor id -> (watermark, seqs). Seqs below the watermark
    are dropped (the watermark covers them) and the rest sorted. ValueError names what is out
    of range: negative numbers, more than MAX_ACKS actors or MAX_SEQS seqs."""
    version, dropped_total, trained_total, loss_epoch = (
        int(version), int(dropped_total), int(trained_total), int(loss_epoch))
    if version < -1:
        raise ValueError(f"version={version}: must be >= -1 (-1: nothing trained yet)")
    for name, value in (("dropped_total", dropped_total), ("trained_total", trained_total),
                        ("loss_epoch", loss_epoch)):
        if value < 0:
            raise ValueError(f"{name}={value}: must be >= 0")
    if len(acks) > MAX_ACKS:
        raise ValueError(f"{len(acks)} acks: at most {MAX_ACKS} actors per report")
    out: Dict[int, ActorAcks] = {}
    n_seqs = 0
    for actor_id, (watermark, seqs) in acks.items():
        actor_id, watermark = int(actor_id), int(watermark)
        if actor_id < 0 or watermark < 0:
            raise ValueError(f"ack actor_id={actor_id}, watermark={watermark}: must be >= 0")
        seqs = list(seqs)
        n_seqs += len(seqs)
        if n_seqs > MAX_SEQS:
            raise ValueError(f"more than {MAX_SEQS} seqs in one report: raise the watermarks "
                             "instead (every seq below a watermark is acknowledged)")
        out[actor_id] = ActorAcks(watermark, tuple(sorted({int(s) for s in seqs
                                                           if int(s) >= watermark})))
    return Progress(version, dropped_total, trained_total, loss_epoch,
                    dict(sorted(out.items())))

