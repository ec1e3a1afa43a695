"""Delayed delivery: rollouts that wait out an injected delay while their actor generates on.

With injected per-rollout delays (actors/delays.py, a drift experiment) each rollout is sent
`delay` seconds after its batch was generated, as if its episode had taken that much longer. A
delivery thread holds the waiting rollouts in a heap and sends each when it is due, soonest
first, through the actor's own send function, while the actor's main loop asks admission and
generates the next batch: one slow episode holds up only itself. At most `max_waiting` rollouts
wait at once (`wait_for_room` blocks the main loop until another batch fits).

The rollouts are spooled before they are handed over, so one still waiting when the actor stops
stays in the spool, unsent, and a restarted actor sends it.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Callable, List, Optional, Sequence

import numpy as np

# Without an explicit bound, this many actor batches may wait out their delays at once.
MAX_WAITING_BATCHES = 4


def default_max_waiting(actor_batch: int) -> int:
    """The most rollouts an actor lets wait at once when none is given: MAX_WAITING_BATCHES
    actor batches (the actor and the staleness planner both use it)."""
    return MAX_WAITING_BATCHES * actor_batch


class DelayedDelivery:
    """The delivery thread (see the module docstring).

    Args:
      send: called from the delivery thread with a list of due rollouts; returns when they are
        handed to replay (or the actor stops).
      delays: n -> n delays in seconds.
      max_waiting: the most rollouts waiting at once.
      stop: the actor's stop event (the thread returns soon after it is set).
      on_delivered: called with (rollout, delay) after each send, in the thread.
    """

    def __init__(self, send: Callable[[List], None], delays: Callable[[int], np.ndarray],
                 max_waiting: int, stop: threading.Event,
                 on_delivered: Optional[Callable[[object, float], None]] = None):
        if max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting}: must be >= 1")
        self._send = send
        self._delays = delays
        self.max_waiting = int(max_waiting)
        self._stop = stop
        self._on_delivered = on_delivered
        self._cv = threading.Condition()
        self._heap: list = []              # (ready_time, seq, delay, rollout)
        self._seq = itertools.count()
        self.waiting = 0                   # handed over, not yet sent
        self._thread: Optional[threading.Thread] = None
        self._closing = False
        self._error: Optional[BaseException] = None

    def schedule(self, rollouts: Sequence) -> None:
        """Hands over a batch: each rollout is sent `delay` seconds from now."""
        delays = np.asarray(self._delays(len(rollouts)), dtype=np.float64)
        now = time.monotonic()
        with self._cv:
            self._raise_error()
            for r, d in zip(rollouts, delays):
                heapq.heappush(self._heap, (now + float(d), next(self._seq), float(d), r))
            self.waiting += len(rollouts)
            if self._thread is None:
                self._closing = False
                self._thread = threading.Thread(target=self._loop, name="delayed-delivery",
                                                daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def wait_for_room(self, batch: int) -> None:
        """Blocks while `batch` more rollouts would exceed max_waiting (or until stop)."""
        with self._cv:
            while self.waiting + batch > self.max_waiting and not self._stop.is_set():
                self._raise_error()
                self._cv.wait(0.5)
            self._raise_error()

    def close(self, drain: bool) -> None:
        """Stops the thread; with `drain`, first lets it send everything handed over (unless
        stop comes first). Re-raises an error of the thread."""
        if self._thread is None:
            return
        with self._cv:
            while drain and self.waiting > 0 and not self._stop.is_set() and self._error is None:
                self._cv.wait(0.5)
            self._closing = True
            self._cv.notify_all()
        self._thread.join()
        self._thread = None
        if drain:
            self._raise_error()

    def notify(self) -> None:
        """Wakes the thread (the actor was stopped)."""
        with self._cv:
            self._cv.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the delivery thread failed: {self._error!r}") from self._error

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._stop.is_set() or self._closing:
                        return
                    due_in = self._heap[0][0] - time.monotonic() if self._heap else 1.0
                    if due_in > 0:
                        self._cv.wait(min(due_in, 1.0))
                        continue
                    _, _, delay, rollout = heapq.heappop(self._heap)
                self._send([rollout])
                if self._on_delivered is not None:
                    self._on_delivered(rollout, delay)
                with self._cv:
                    self.waiting -= 1
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - re-raised in the actor's main loop
            with self._cv:
                self._error = e
                self._cv.notify_all()
