"""The Reverb side of the rollout writer (replay/writer.py): its insert streams.

One long-lived `TrajectoryWriter` (one gRPC stream) per item size, that is per length bucket;
the group a pipelined call left in flight; and the writers retired with items still waiting in
replay's rate limiter.

Pipelined. A wait for the confirmation of every group drains the stream each time (measured:
BENCHMARKS.md, section 3). So a pipelined `send` waits only for the group sent before (normally
confirmed long ago) and leaves its own in flight; `settle` (the writer's `flush` and `close`)
waits for it. The group before is always confirmed before a group goes to another bucket's
writer, so the rollouts still land in order. What is in flight is lost if this process dies: the
actor's spool then sends every rollout its predecessor sent and nobody acknowledged once more
(actors/spool.py; the learner skips copies).

Retired writers. Reverb cannot withdraw an item once it is sent. When a confirmation does not
come in time (another writer took the free slot), the unconfirmed items (always the last ones:
one stream lands its items in order) keep their writer alive, retired, until they land, and later
items of that bucket use a fresh writer; `waiting()` counts them, and the writer's free-slot
check counts them as occupied slots.

Not thread-safe: the RolloutWriter that owns it serialises every call under its lock.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

from absl import logging

from sao_actor_learner.replay.client import FlushTimeout, ReplayClient, TrajectoryWriter

# After sending, wait at least this long for the server's confirmation even if timeout_s is spent.
MIN_CONFIRM_S = 0.05


class InsertStreams:
    """The Reverb writers of one RolloutWriter (see the module doc).

    Args:
      client: the ReplayClient that makes the trajectory writers.
      table: the table every item goes to.
    """

    def __init__(self, client: ReplayClient, table: str):
        self._client = client
        self._table = table
        self._writers: Dict[int, TrajectoryWriter] = {}   # item bytes -> its writer
        self._retired: List[Any] = []        # writers with an unconfirmed item, until it lands
        self._retired_waiting: List[int] = []  # how many items each one still waits for
        self._in_flight: Optional[Tuple[int, Any, int]] = None  # (size, writer, count): settle
        self.unconfirmed = 0                 # items ever left waiting in the rate limiter

    def send(self, size: int, items: Iterable[Any], count: int, deadline: float,
             wait_for_confirmation: bool = True) -> Tuple[Optional[List[bool]], bool]:
        """Appends the `count` packed `items` (each `size` bytes, packed as the iteration asks
        for it) through the writer of that size, each as soon as it is packed (Reverb's C++
        threads compress and send it while the next one is packed). Then waits once (until the
        deadline, at least MIN_CONFIRM_S) for their confirmation or, pipelined, only for that of
        the group sent before, so the stream never runs dry. Returns (per item whether replay
        confirmed it, pipelined: all False; whether the wait timed out), or (None, True) when
        nothing was sent (the deadline passed waiting for another stream's items, which must
        land first). When the wait times out, the unconfirmed items keep their writer alive,
        retired, until they land, and later items use a fresh one."""
        writer = self._writers.get(size)
        if writer is None:
            writer = self._client.trajectory_writer(num_keep_alive_refs=1)
            self._writers[size] = writer
        if self._in_flight is not None and self._in_flight[1] is not writer:
            # Another stream: its items land first, so that all land in order.
            if not self.settle(deadline):
                return None, True
        before = 0 if self._in_flight is None else self._in_flight[2]
        self._in_flight = None
        try:
            for packed in items:
                writer.append_item(self._table, [packed])
            wait_s = max(deadline - time.monotonic(), MIN_CONFIRM_S)
            writer.flush(timeout_ms=int(wait_s * 1000),
                         block_until_num_items=0 if wait_for_confirmation else count)
            if not wait_for_confirmation:
                self._in_flight = (size, writer, count)
                return [False] * count, False
        except FlushTimeout:
            # Another writer took the slot: the items wait in the server's rate limiter and will
            # land. Keep this writer alive until they do; later items use a fresh one.
            waiting = min(self._retire(size, writer, before + count), count)
            return [True] * (count - waiting) + [False] * waiting, True
        except Exception as e:
            raise self._broken(size, writer, "inserting into", e) from e
        return [True] * count, False

    def settle(self, deadline: float) -> bool:
        """Waits for the confirmation of the group a pipelined call left in flight (until the
        deadline, at least MIN_CONFIRM_S; usually it came long ago). False when it did not
        come: it waits in the rate limiter (a lost race), and its writer is retired."""
        if self._in_flight is None:
            return True
        size, writer, count = self._in_flight
        self._in_flight = None
        try:
            writer.flush(timeout_ms=int(max(deadline - time.monotonic(), MIN_CONFIRM_S) * 1000))
        except FlushTimeout:
            self._retire(size, writer, count)
            return False
        except Exception as e:
            raise self._broken(size, writer, "confirming inserts into", e) from e
        return True

    def _broken(self, size: int, writer: Any, doing: str, error: BaseException) -> RuntimeError:
        """Drops and closes `writer`, whose stream broke (the server went away); the error to
        raise."""
        self._writers.pop(size, None)
        close_quietly(writer)
        return RuntimeError(f"RolloutWriter: {doing} table {self._table!r} at "
                            f"{self._client.server_address} failed: {error}")

    def _retire(self, size: int, writer: Any, sent: int) -> int:
        """Retires `writer`, whose flush timed out: some of its last `sent` items wait in the
        rate limiter; it stays alive until they land, and later items of its bucket use a
        fresh writer. Returns how many wait."""
        waiting = waiting_items(writer, sent)
        if self._writers.get(size) is writer:
            self._writers.pop(size)
        self._retired.append(writer)
        self._retired_waiting.append(waiting)
        self.unconfirmed += waiting
        logging.log_every_n(logging.WARNING, "RolloutWriter: insert not yet confirmed after "
                            "the timeout (another writer took the free slot); it waits in "
                            "replay's rate limiter and lands when the learner samples", 100)
        return waiting

    def waiting(self) -> int:
        """Our items still waiting in replay's rate limiter."""
        return sum(self._retired_waiting)

    def reap_retired(self) -> None:
        """Closes retired writers whose items have landed."""
        if not self._retired:
            return
        keep, keep_waiting = [], []
        for writer, waiting in zip(self._retired, self._retired_waiting):
            try:
                writer.flush(timeout_ms=1)  # not 0: Reverb reads timeout_ms=0 as "no timeout"
            except FlushTimeout:
                keep.append(writer)  # still waiting in the rate limiter
                keep_waiting.append(waiting)
                continue
            except Exception as e:  # the stream broke (server gone): never confirmed
                logging.warning("RolloutWriter: an unconfirmed insert failed: %s", e)
            close_quietly(writer)
        self._retired, self._retired_waiting = keep, keep_waiting

    def close(self, confirm_s: float) -> None:
        """Waits up to `confirm_s` for what is in flight, then closes every writer. Items already
        confirmed stay in replay; retired ones' items land when the learner samples."""
        try:
            self.settle(time.monotonic() + confirm_s)
        except RuntimeError as e:   # the server is gone: what was in flight is resent
            logging.warning("%s", e)
        if self._retired:
            self.reap_retired()
        if self._retired:
            logging.warning("RolloutWriter: closing with %d inserts still waiting in replay's "
                            "rate limiter; they land when the learner samples", self.waiting())
        for writer in list(self._writers.values()) + self._retired:
            close_quietly(writer)
        self._writers.clear()
        self._retired, self._retired_waiting = [], []


def waiting_items(writer: Any, sent: int) -> int:
    """How many of the last `sent` items of `writer` replay has not confirmed yet (>= 1: called
    after a flush timed out). One probe (`flush` with 1 ms) per count tried."""
    for waiting in range(1, sent):
        try:
            writer.flush(block_until_num_items=waiting, timeout_ms=1)
            return waiting
        except FlushTimeout:
            continue
    return sent


def close_quietly(writer: Any) -> None:
    """Closes a Reverb writer; a failure is logged, never raised (it must not mask the caller's
    error)."""
    try:
        writer.close()
    except Exception as e:  # closing must not mask the caller's error
        logging.info("RolloutWriter: closing a Reverb writer failed: %s", e)
