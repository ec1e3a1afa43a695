"""Exactly-once consumption of the rollouts table: read, keep, then acknowledge (issue 7).

A table made with `make_rollouts_table(..., acknowledged=True)` lets each rollout be sampled
`ACK_TIMES_SAMPLED` (4) times; the last sample removes it. `AckedReader` takes rollouts one at a
time from the head of the FIFO:

  1. a first sample reads the head rollout, which stays in the table;
  2. `on_peeked(rollout)` runs (the learner's journal writes it to disk);
  3. the reader takes the rollout's further samples up to the one that removes it: the
     acknowledgement.

A consumer killed before 3 leaves the rollout at the head, partly sampled; the next consumer
reads it and takes it from there (`times_sampled` says whether its read was the one that removed
it): nothing is lost in transit (with the plain table, replay removes what it sends, and a
learner killed while it arrives loses it). Each rollout carries its replay key
(`rollout.replay_key`); keys the consumer already holds (`skip_keys`: those journalled before a
crash, and those it took recently) are acknowledged and skipped, so a rollout is not used twice
either, also when replay returns to a checkpoint older than some of its samples.

One sampler stream per `sample` call (issue 8). All samples of a call come through one Reverb
sampler (one gRPC stream, one sample in flight) instead of a new sampler per sample (a thread and
a stream each, ~0.4-1 ms). Reverb's sampler asks for the next sample as soon as the previous one
is taken from it, so replay may have served one sample more than the reader has taken: when the
reader has the 1st sample of a rollout, the 2nd may be served; closing the stream at the end of a
call may leave one served sample of the next rollout unread. Hence 4 samples per rollout: a
rollout the reader first sees at its 1st or 2nd sample (always, while no consumer crashes) gets
its 4th, removing sample only after the reader has taken the one after its first, i.e. after
`on_peeked`. tests/test_replay_acked.py pins this prefetch depth of the installed Reverb. The
reader asks for a sample only when it knows one is there (the rollout it is acknowledging, or
`table_size` / a `ServerInfo` poll says the table holds another), so it never blocks in Reverb.

Only a second crash right after a first can lose a rollout: the new consumer's first read of a
rollout the crashed one had read is also the removing one, and it dies before its journal has it.

One consumer per table: the samples must meet the same rollout. When the head changes under a
reader (replay restarted from a checkpoint without the rollout it was acknowledging, or a second
consumer), it keeps what it read and takes the new head rollout when it wants one or when its
own samples may have removed it (then holding it for the next call: `buffered`); else it leaves
it in replay and logs a warning.

Cost (programs/benchmarks/replay_path.py; 2 shared cores at load 1-2.5, ~2k-token rollouts):
4 sample round trips of one stream per rollout, ~0.63 ms (~1.6k rollouts/s; ~0.13 ms of each
sample is the round trip itself, even for tiny rollouts), against ~0.1 ms per rollout for
RolloutReader's batched fetch. Tables restored from an older checkpoint with 2 samples per
rollout are read the old way: a new sampler per sample, ~1.1 ms per rollout (1.5-2.5 ms under
load).

Reverb imports TensorFlow: this module imports it only when a reader is made.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Callable, Deque, Iterable, List, Optional, Set, Tuple, Union

from absl import logging

from sao_actor_learner.replay.reader import decode_item
from sao_actor_learner.replay.tables import (DEFAULT_TABLE, SERVER_INFO_TIMEOUT_S, connect,
                                             table_info_proto)
from sao_actor_learner.types import Rollout

_NUM_INFO_TENSORS = 5          # key, probability, table_size, priority, times_sampled
_POLL_START_S = 0.001
_POLL_MAX_S = 0.01
RECENT_KEYS = 1 << 16           # keys remembered to skip rollouts replay hands out again
# The fewest samples per rollout the one-stream protocol needs (see the module docstring); a table
# with 2 (an older checkpoint) is read with a new sampler per sample.
STREAM_MIN_TIMES_SAMPLED = 4


class _Interrupted(Exception):
    def __init__(self, cause: BaseException, rollout: Optional[Rollout]) -> None:
        super().__init__(str(cause))
        self.cause, self.rollout = cause, rollout


class AckedReader:
    """Reads an acknowledged rollouts table exactly once (see the module docstring).

    Args:
      client_or_address: a `reverb.Client` or the replay address "host:port".
      table: the table name.
      on_peeked: called with each rollout after it is read and before it is acknowledged.
      skip_keys: replay keys of rollouts this consumer already has.
    """

    def __init__(self, client_or_address: Union[str, Any], table: str = DEFAULT_TABLE,
                 on_peeked: Optional[Callable[[Rollout], None]] = None,
                 skip_keys: Iterable[int] = ()) -> None:
        self._client = connect(client_or_address)
        self._table = table
        self._on_peeked = on_peeked
        self._recent: Deque[int] = collections.deque(maxlen=RECENT_KEYS)
        self._recent_set: Set[int] = set()
        for key in skip_keys:
            self._remember(int(key))
        self._held: Deque[Rollout] = collections.deque()   # taken beyond a call's n
        self._stream = None            # the open Reverb sampler of the current call
        self._times_sampled = 0        # the table's max_times_sampled, once known
        self.sampled = 0               # rollouts returned by sample()
        self.skipped = 0               # rollouts read again and skipped (already held)

    @property
    def buffered(self) -> int:
        """Rollouts taken from replay (and handed to on_peeked) but not yet returned: only when
        the head changed under the reader (see the module docstring); they come first next."""
        return len(self._held)

    def queue_size(self) -> int:
        """Rollouts in the table (one being read or acknowledged included)."""
        return self._table_state()[0]

    def sample(self, n: int, timeout_s: float, min_items: int = 1) -> List[Rollout]:
        """Up to `n` rollouts, oldest first; returns once `min(min_items, n)` are here and the
        table holds no more, or when `timeout_s` passes (maybe with none)."""
        if n < 0:
            raise ValueError(f"n={n}: must be >= 0")
        want = max(1, min(int(min_items), n)) if n else 0
        deadline = time.monotonic() + max(0.0, float(timeout_s))
        out: List[Rollout] = []
        while self._held and len(out) < n:
            out.append(self._held.popleft())
        if len(out) < n:
            available = self._available()
            while available < 0 and time.monotonic() < deadline:   # replay does not answer
                time.sleep(min(_POLL_MAX_S, max(0.0, deadline - time.monotonic())))
                available = self._available()
            if available >= 0 and self._times_sampled >= STREAM_MIN_TIMES_SAMPLED:
                self._sample_stream(n, want, deadline, out, available)
            elif available >= 0:
                self._sample_per_item(n, want, deadline, out, available)
        self.sampled += len(out)
        return out

    # --- replay state -----------------------------------------------------------------------------
    def _table_state(self) -> Tuple[int, int]:
        """(rollouts in the table, its max_times_sampled): one ServerInfo round trip."""
        info = table_info_proto(self._client, self._table, SERVER_INFO_TIMEOUT_S)
        return int(info.current_size), int(info.max_times_sampled)

    def _available(self) -> int:
        """Rollouts in the table (noting its max_times_sampled); -1 if replay is unreachable."""
        try:
            size, times_sampled = self._table_state()
        except KeyError:
            raise
        except Exception as e:  # unreachable or restarting server: report it, retry later
            logging.log_every_n(logging.WARNING, "AckedReader: replay at %s unreachable: %s",
                                100, self._client.server_address, e)
            return -1
        if times_sampled != self._times_sampled:
            if times_sampled != 2 and times_sampled < STREAM_MIN_TIMES_SAMPLED:
                raise RuntimeError(
                    f"AckedReader: table {self._table!r} has max_times_sampled={times_sampled}; "
                    "an acknowledged table (make_rollouts_table(acknowledged=True), "
                    f"ReplayServer(acknowledged=True)) has {STREAM_MIN_TIMES_SAMPLED} (or 2, "
                    "from an older checkpoint): serve replay with replay_exactly_once, or read "
                    "it with RolloutReader")
            self._times_sampled = times_sampled
        return size

    def _wait_for_items(self, want: int, out: List[Rollout], deadline: float,
                        delay: float) -> Tuple[int, float]:
        """Polls until the table holds a rollout: (rollouts there, next delay); 0 when the call
        should return now (it has `want`, or the deadline passed)."""
        if len(out) >= want or time.monotonic() >= deadline:
            return 0, delay
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        return max(0, self._available()), min(2 * delay, _POLL_MAX_S)

    # --- one stream per call ----------------------------------------------------------------------
    def _sample_head(self):
        """One sample of the head rollout (flat: info tensors, then the item's columns): the
        next one of this reader's open stream (opened if need be), or, for a table read the
        old way, of a new sampler."""
        raw_client = self._client._client  # pylint: disable=protected-access
        if not self._times_sampled:
            self._available()
        if self._times_sampled < STREAM_MIN_TIMES_SAMPLED:
            sampler = raw_client.NewSampler(self._table, 1, 1)
            try:
                return sampler.GetNextTrajectory()
            finally:
                del sampler
        if self._stream is None:
            # Unlimited samples, one in flight (buffer 1), one worker: see the module docstring.
            self._stream = raw_client.NewSampler(self._table, -1, 1)
        return self._stream.GetNextTrajectory()

    def _close_stream(self) -> None:
        """Drops the stream; a sample replay served it but the reader did not take is lost
        (its rollout stays in the table, one sample further: see the module docstring)."""
        stream, self._stream = self._stream, None
        del stream

    def _sample_stream(self, n: int, want: int, deadline: float, out: List[Rollout],
                       available: int) -> None:
        """Takes rollouts into `out` (up to n) through one sampler stream, each acknowledged."""
        last = self._times_sampled
        current: Optional[int] = None  # key of the rollout being acknowledged
        delay = _POLL_START_S
        try:
            while True:
                if current is None:        # between rollouts
                    if len(out) >= n:
                        break
                    if available < 1:
                        available, delay = self._wait_for_items(want, out, deadline, delay)
                        if self._times_sampled != last:   # replay restarted, other table
                            break
                        if available < 1 and (len(out) >= want
                                              or time.monotonic() >= deadline):
                            break
                        continue
                    delay = _POLL_START_S
                try:
                    flat = self._sample_head()
                except Exception as e:  # noqa: BLE001 - replay went away (a restart)
                    self._close_stream()
                    logging.warning("AckedReader: sampling interrupted (%s)", e)
                    if not out:
                        raise RuntimeError(f"AckedReader: sampling table {self._table!r} at "
                                           f"{self._client.server_address} failed: {e}") from None
                    break
                key, table_size, times = int(flat[0]), int(flat[2]), int(flat[4])
                if key == current:         # acknowledging it
                    if times >= last:
                        current, available = None, table_size - 1
                    continue
                if current is not None:
                    logging.warning("AckedReader: table %r changed while acknowledging rollout "
                                    "%d (replay restarted? a second consumer?)", self._table,
                                    current)
                    current = None
                if len(out) >= n and times + 1 < last:
                    # Not wanted now, and neither this sample nor the one replay may have
                    # served after it removes it: leave it in replay.
                    break
                taken = self._take(flat)
                if taken is not None:
                    (out if len(out) < n else self._held).append(taken)
                if times >= last:          # this read removed it
                    available = table_size - 1
                else:
                    current = key
        finally:
            self._close_stream()

    def _take(self, flat) -> Optional[Rollout]:
        """The rollout of a first read: handed to on_peeked and remembered, unless we hold it
        already (then skipped: None)."""
        key = int(flat[0])
        if key in self._recent_set:
            self.skipped += 1
            logging.log_every_n(logging.WARNING, "AckedReader: skipped rollout %d, read before "
                                "(replay handed it out again)", 100, key)
            return None
        rollout = decode_item(flat[_NUM_INFO_TENSORS:])
        rollout.replay_key = key
        if self._on_peeked is not None:
            self._on_peeked(rollout)
        self._remember(key)
        return rollout

    # --- a new sampler per sample (a table with max_times_sampled 2) -----------------------------
    def _sample_per_item(self, n: int, want: int, deadline: float, out: List[Rollout],
                         available: int) -> None:
        delay = _POLL_START_S
        while len(out) < n and self._times_sampled < STREAM_MIN_TIMES_SAMPLED:
            if available < 1:
                available, delay = self._wait_for_items(want, out, deadline, delay)
                if available < 1 and (len(out) >= want or time.monotonic() >= deadline):
                    break
                continue
            delay = _POLL_START_S
            try:
                taken = self._take_one()
            except _Interrupted as e:   # replay went away (a restart): keep what we have
                logging.warning("AckedReader: sampling interrupted (%s)", e.cause)
                if e.rollout is not None:
                    out.append(e.rollout)
                if not out:
                    raise RuntimeError(f"AckedReader: sampling table {self._table!r} at "
                                       f"{self._client.server_address} failed: {e.cause}") \
                        from None
                break
            out.extend(taken)
            available = max(0, self._available())

    def _take_one(self) -> List[Rollout]:
        """Reads the head, hands it to on_peeked, acknowledges it; returns what became ours
        (nothing if it was skipped).

        Raises _Interrupted when replay fails; its `rollout` is the one already handed to
        on_peeked (and remembered, so a later read of it is skipped), if any."""
        try:
            flat = self._sample_head()
        except Exception as e:  # noqa: BLE001 - nothing was read
            raise _Interrupted(e, None) from None
        key, times_sampled = int(flat[0]), int(flat[4])
        if times_sampled >= 2:
            # A consumer read it and died before acknowledging: this read was the second and
            # removed it. Skip it if we hold it already (our journal), else it is ours now.
            taken = self._take(flat)
            return [taken] if taken is not None else []
        skip = key in self._recent_set
        rollout = None
        if not skip:
            rollout = self._take(flat)
        try:
            ack = self._sample_head()
        except Exception as e:  # noqa: BLE001 - read and kept, not acknowledged: it comes back
            raise _Interrupted(e, rollout) from None
        out: List[Rollout] = []
        if not skip:
            out.append(rollout)
        else:
            self.skipped += 1
            logging.log_every_n(logging.WARNING, "AckedReader: skipped rollout %d, read before "
                                "(replay handed it out again)", 100, key)
        if int(ack[0]) != key:
            # The head changed between the two reads: replay restarted from a checkpoint that
            # lacks the rollout just read (or another consumer took it). We keep the one we
            # read; the one the acknowledgement met is ours if that read removed it, else it
            # stays (read once) and comes back.
            logging.warning("AckedReader: table %r changed between reading rollout %d and "
                            "acknowledging it (replay restarted? a second consumer?)",
                            self._table, key)
            if int(ack[4]) >= 2:
                taken = self._take(ack)
                if taken is not None:
                    out.append(taken)
        return out

    def _remember(self, key: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            self._recent_set.discard(self._recent[0])
        self._recent.append(key)
        self._recent_set.add(key)

    def close(self) -> None:
        """Drops the stream, if one is open (no background threads)."""
        self._close_stream()

    def __enter__(self) -> "AckedReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
