"""An actor's outbox: its rollouts from the writer's check until the learner acknowledges them.

`accept` takes a generated batch:
  1. the sink's check: an invalid rollout (a broken engine's NaN log-probs, ids outside the
     vocabulary) is refused, counted by reason, and its admission slot owed back to the server
     (`owed_releases`, handed with the actor's next admission request);
  2. the spool keeps every valid rollout under its sequence number (actors/spool.py);
  3. `_send` hands them to replay, retrying while the table is full, at once or after their
     injected delay (actors/delivery.py).
And continually (`poll_acks`): the learner's acknowledgements, through the variable server, let
the spool forget what was trained or dropped, and a new loss epoch makes the outbox send again
whatever it still holds from before it (`send_held`, also what a previous incarnation of the
actor never sent).
"""
from __future__ import annotations

import threading
import time
from typing import Dict, List

from absl import logging

from sao_actor_learner import core
from sao_actor_learner.actors.delivery import DelayedDelivery
from sao_actor_learner.actors.spool import RolloutSpool
from sao_actor_learner.types import Rollout
from sao_actor_learner.variables.channel import VariableClientError


class Outbox:
    """What happens to an actor's rollouts after generation (see the module docstring).

    Args:
      actor_id: the actor's id (acknowledgements are asked for it).
      sink: the core.RolloutSink (the replay writer); closed by `close`.
      spool: the actor's RolloutSpool.
      variables: the actor's core.ActorCoordination (its `acknowledged`).
      stop: the actor's stop event: sending gives up once it is set (what is left stays in the
        spool, unsent).
      delay_sampler: n -> n injected delays in seconds (actors/delays.py); None: send at once.
      max_waiting: with delays, the most rollouts waiting at once.
      ack_period_s: how often `poll_acks` asks which rollouts the learner consumed.
    """

    def __init__(self, actor_id: int, sink: core.RolloutSink, spool: RolloutSpool,
                 variables: core.ActorCoordination, stop: threading.Event,
                 delay_sampler=None, max_waiting: int = 32, ack_period_s: float = 0.5):
        self._actor_id = actor_id
        self._sink, self._spool, self._variables = sink, spool, variables
        self._stop = stop
        self._ack_period_s = ack_period_s
        self._lock = threading.Lock()        # counters, _in_delivery, _release_owed
        self._counters: Dict[str, float] = {
            "rollouts_inserted": spool.sent_once, "rollouts_resent": 0,
            "rollouts_acknowledged": spool.acknowledged, "injected_delay_s": 0.0}
        self.loss_epoch = 0                  # the learner's, as last acknowledged
        self._last_ack_poll = 0.0
        self._in_delivery: set = set()       # seqs handed to delivery, not yet sent
        # Admission slots to return with the next Admit: rollouts refused by the check, and at a
        # restart those lost in the generation of a crashed incarnation (spool.owed_releases).
        self._release_owed = spool.owed_releases()
        self._delivery = None if delay_sampler is None else DelayedDelivery(
            self._send, delay_sampler, max_waiting, stop, self._delivered)

    @property
    def counters(self) -> Dict[str, float]:
        """rollouts_inserted (sent at least once), rollouts_resent, rollouts_acknowledged,
        injected_delay_s (delays waited out)."""
        with self._lock:
            return dict(self._counters)

    # --- admission slots owed -------------------------------------------------------------------
    def owed_releases(self) -> int:
        """Admission slots to hand back with the next admission request."""
        with self._lock:
            return self._release_owed

    def released(self, count: int) -> None:
        """`count` owed slots reached the server (an admission request carried them)."""
        with self._lock:
            self._release_owed -= count
        self._spool.released(count)

    # --- sending --------------------------------------------------------------------------------
    def accept(self, rollouts: List[Rollout]) -> None:
        """Checks, spools and sends (or schedules) a generated batch."""
        self._deliver(self._spool_valid(rollouts))

    def _spool_valid(self, rollouts: List[Rollout]) -> List[Rollout]:
        """The rollouts that pass the sink's check, each spooled (its seq set); the others are
        refused, counted, and their admission slots owed back."""
        valid = []
        for r in rollouts:
            reason = self._sink.check(r)
            if reason is None:
                self._spool.put(r)
                valid.append(r)
            else:
                self._spool.refuse(reason)
                with self._lock:
                    self._release_owed += 1
        return valid

    def _deliver(self, rollouts: List[Rollout]) -> None:
        if self._delivery is None:
            self._send(rollouts)
            return
        with self._lock:
            self._in_delivery.update(r.seq for r in rollouts)
        self._delivery.schedule(rollouts)

    def _send(self, rollouts: List[Rollout]) -> None:
        """Hands `rollouts` (spooled) to replay, retrying while the table is full, until all are
        in or the actor stops (what is left stays in the spool, unsent)."""
        pending = list(rollouts)
        while pending and not self._stop.is_set():
            epoch = self.loss_epoch       # read before sending: a bump meanwhile re-sends
            sent = self._sink.send(pending, timeout_s=1.0)
            done = [r for r, ok in zip(pending, sent) if ok]
            first = self._spool.sent([r.seq for r in done], epoch)
            with self._lock:
                self._counters["rollouts_inserted"] += first
                self._counters["rollouts_resent"] += len(done) - first
            pending = [r for r, ok in zip(pending, sent) if not ok]
            if self.loss_epoch > epoch:    # sent into an epoch that has ended: again
                pending = done + pending
        with self._lock:
            self._in_delivery.difference_update(r.seq for r in rollouts)

    def _delivered(self, rollout: Rollout, delay: float) -> None:
        with self._lock:
            self._counters["injected_delay_s"] += delay

    def wait_for_room(self, batch: int) -> None:
        """With delays: blocks while `batch` more rollouts would exceed the most waiting (or
        until the actor stops)."""
        if self._delivery is not None:
            self._delivery.wait_for_room(batch)

    # --- acknowledgements -----------------------------------------------------------------------
    def poll_acks(self, force: bool = False) -> None:
        """At most every ack_period_s (`force`: now): forgets what the learner consumed; on a
        new loss epoch sends again what is held from before it."""
        if not force and time.monotonic() - self._last_ack_poll < self._ack_period_s:
            return
        self._last_ack_poll = time.monotonic()
        try:
            info = self._variables.acknowledged(self._actor_id)
        except VariableClientError as e:
            if not e.retryable:
                raise
            return   # the variable server is away; next time
        forgotten = self._spool.acknowledge(info.consumed)
        with self._lock:
            self._counters["rollouts_acknowledged"] += forgotten
        if info.loss_epoch > self.loss_epoch:
            self.loss_epoch = info.loss_epoch
            self.send_held()

    def send_held(self) -> None:
        """Sends every held rollout never sent, or sent before the current loss epoch (not those
        waiting in delivery)."""
        with self._lock:
            skip = set(self._in_delivery)
        held = [r for seq, r in self._spool.to_send(self.loss_epoch) if seq not in skip]
        if held:
            logging.info("actor %d: sending %d held rollouts (loss epoch %d)", self._actor_id,
                         len(held), self.loss_epoch)
            self._send(held)

    # --- the end --------------------------------------------------------------------------------
    def notify_stop(self) -> None:
        """Wakes the delivery thread (the actor was stopped)."""
        if self._delivery is not None:
            self._delivery.notify()

    def finish(self, drain: bool) -> None:
        """Stops the delivery thread: with `drain`, once it has sent what waits (unless the actor
        stops first; re-raises its error); without, at once (what waits stays in the spool)."""
        if self._delivery is not None:
            self._delivery.close(drain=drain)

    def close(self) -> None:
        """Closes the sink (once, when the actor's run ends; nothing is sent after it)."""
        # A Reverb writer left open is flushed by its C++ destructor with no timeout: collected
        # at interpreter exit, after replay has stopped, it waited forever for a confirmation
        # (a hang, 1 exit in ~60).
        self._sink.close()
