"""The learner's side of the progress protocol with the variable server (rank 0 only).

What the learner tells the server, and through it the actors (docs/DESIGN.md section 3):
  - `publish`: a new version's weights, with the admission credit so far;
  - `report`: a small message without weights: the version, the admission credit (rollouts
    admitted that will never count toward a version: dropped as too stale, or consumed by
    critic-only steps), the rollouts trained, the loss epoch and the acknowledgements of every
    consumed key (actors drop what is acknowledged);
  - loss epochs: `start_loss_epoch` when the learner starts (what a predecessor had in transit
    may be gone) and whenever the replay stream broke (`notice_interruptions`): actors re-insert
    every rollout they still hold that was sent before it.

A learner group's other ranks hold a LearnerProgress without a publisher: every call is then a
no-op, but the loss epoch is still counted (it is part of every rank's state).
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

from absl import logging

from sao_actor_learner import core


class LearnerProgress:
    """Publishes versions and reports progress to the variable server.

    Args:
      publisher: a core.WeightPublisher (publish, report_progress), or None (nothing is sent).
      serialize: state dict -> payload buffers for the publisher.
      counters: () -> the report's fields besides the loss epoch: version, dropped_total,
        trained_total, acks (called only when there is a publisher).
    """

    def __init__(self, publisher: Optional[core.WeightPublisher],
                 serialize: Optional[Callable[[dict], object]],
                 counters: Callable[[], dict]):
        self.publisher = publisher
        self._serialize = serialize
        self._counters = counters
        self._lock = threading.Lock()
        self.loss_epoch = 0                 # bumped when rollouts in transit may have been lost
        self.interruptions_seen = 0         # of the rollout source's interruptions
        self.resume_publish_conflicts = 0   # republished versions the server refused

    def report(self):
        """Sends the counters (a small message, no weights); the server's answer, or None when
        there is no publisher or the server is away (restarting: the next report retries)."""
        if self.publisher is None:
            return None
        with self._lock:
            try:
                return self.publisher.report_progress(loss_epoch=self.loss_epoch,
                                                      **self._counters())
            except Exception as e:   # the variable server is away (restarting): next time
                logging.log_every_n_seconds(logging.WARNING, "progress report failed: %s", 30, e)
                return None

    def start_loss_epoch(self) -> None:
        """Starts a new loss epoch (above any the server holds) and reports it."""
        self.loss_epoch += 1
        result = self.report()
        if result is not None and result.loss_epoch > self.loss_epoch:
            self.loss_epoch = result.loss_epoch + 1      # a predecessor got further
            self.report()
        logging.info("learner: loss epoch %d", self.loss_epoch)

    def notice_interruptions(self, interruptions: int) -> None:
        """`interruptions`: the rollout source's count so far. A new one (replay restarted, the
        network broke, or items left the table that the learner never fetched: replay/loss.py)
        starts a loss epoch."""
        if interruptions > self.interruptions_seen:
            self.interruptions_seen = interruptions
            logging.warning("learner: replay lost rollouts (the stream broke, or items left the "
                            "table that the learner never fetched; %d times so far): starting a "
                            "loss epoch", interruptions)
            self.start_loss_epoch()

    def publish(self, version: int, weights: Callable[[], dict], dropped_total: int,
                resumed: bool) -> None:
        """Publishes `version`'s weights (`weights()`, the sync state dict). A `resumed` learner
        redoes the steps its crashed predecessor published (journal.py): the server refuses
        versions older than its newest ("not newer") and accepts its newest again only with
        identical weights; a different payload means the redo diverged (counted and logged)."""
        if self.publisher is None:
            return
        payload = self._serialize(weights())
        try:
            self.publisher.publish(version, payload, dropped_total=dropped_total)
        except core.VersionConflict as e:
            if not resumed:
                raise
            if "different payload" in str(e):
                self.resume_publish_conflicts += 1
                logging.warning("resumed learner: version %d differs from the one published "
                                "before the crash (the redo diverged): %s", version, e)
            else:
                logging.info("resumed learner: version %d was published before the crash",
                             version)
