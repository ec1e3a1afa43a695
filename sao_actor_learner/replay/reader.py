"""The learner's replay reader (a core.RolloutSource): samples rollouts from the replay table,
with a timeout Reverb's client lacks.

`reverb.Client.sample` (and the sampler under it) has no timeout: it blocks forever on an empty
table. And a sampler left running prefetches: items leave the table (and free rate-limiter slots
for the actors) before the learner asked for them. So the reader only asks Reverb for items the
table already holds: `sample` learns the table size (from the last item fetched, which reports
the size when it was taken: only this reader takes items, so at least that many are still there;
else one `ServerInfo` round trip every 1 ms, backing off to 10 ms, while the table is empty)
and a background thread fetches exactly min(wanted, available) items with one Reverb sampler,
which therefore does not block. Should another consumer take those items first, the
fetch blocks in the background thread, never in `sample`: `sample` returns what it has when
`timeout_s` passes, and items that arrive later wait in the reader's buffer for the next call
(`buffered`).

Its throughput against a bare Reverb sampler, and the cost of each part per item (the HMAC, the
checks, a sampler per call): BENCHMARKS.md section 3 (programs/benchmarks/replay_path.py).

Decoded rollouts have the exact dtypes of types.py; their per-token columns are views into the
sampled item (replay/item.py), not copies; the writer's padding is never read.

Trust: with a `verifier` (replay/validation.py) every item is checked as it arrives (columns,
dtypes, lengths, vocabulary range, finite log-probs, versions, and the run's signature); a bad
one is dropped there and counted in `rejected` by reason: it never reaches `on_fetched`, the
learner's journal or a batch. Anything can reach an unauthenticated Reverb port.

`queue_size()` raises TimeoutError when the server does not answer within 1 s; `sample` treats an
unreachable server as an empty table: it logs and returns [] (after at least 1 s, the shortest
`ServerInfo` timeout). A fetch that fails (the server went away mid-stream, items in transit
may be lost) counts in `interruptions` and raises from the next `sample`; so does a server that
answers again after a gap (it may have restarted and lost its queue). With a `loss_detector`
(replay/loss.py) `sample` also compares the table's counters with what this reader fetched (one
`ServerInfo` round trip at most every 0.5 s): items that someone else took, or a reset, count
as an interruption too (and in `lost_to_others`).
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Union

import numpy as np
from absl import logging

from sao_actor_learner import core
from sao_actor_learner.replay import item
from sao_actor_learner.replay.client import connect
from sao_actor_learner.replay.loss import ReplayLossDetector
from sao_actor_learner.replay.tables import DEFAULT_TABLE, ITEM_COLUMNS
from sao_actor_learner.replay.validation import REJECT_REASONS, RolloutVerifier
from sao_actor_learner.types import Rollout

# Reverb's sampler returns (key, probability, table_size, priority, times_sampled) before the data.
_NUM_INFO_TENSORS = 5
_TABLE_SIZE = 2
_POLL_START_S = 0.001
_POLL_MAX_S = 0.01
_LOSS_CHECK_S = 0.5     # at most this often, sample() checks the table's counters


def decode_item(flat: Sequence[np.ndarray]) -> Rollout:
    """A `Rollout` from one sampled item's columns, unchecked (trusted input; the learner reads
    through a RolloutVerifier instead)."""
    if len(flat) != len(ITEM_COLUMNS):
        raise ValueError(f"replay item has {len(flat)} columns, expected {len(ITEM_COLUMNS)} "
                         f"({', '.join(ITEM_COLUMNS)}): was it written by RolloutWriter?")
    return Rollout(**item.parse(flat[0]).columns)


class RolloutReader(core.RolloutSource):
    """Samples rollouts in FIFO order, each once, never blocking past its timeout.

    Call `sample` from one thread (the learner's); one reader per consumer.

    Args:
      client_or_address: the replay address "host:port" (works from any process), a
        ReplayClient or a `reverb.Client`.
      table: the table name.
      on_fetched: called with each rollout in the fetch thread as soon as it has arrived from
        replay (which has already removed it), before `sample` can return it; the learner's
        journal records it there (learner/journal.py), leaving only the transfer itself as the
        window in which a killed learner loses rollouts.
      verifier: checks every item (see the module docstring); None: trusted input (decode_item).
      loss_detector: a replay.loss.ReplayLossDetector (items taken by others, resets: the
        module docstring), or None.
      fetch_counter: where the table's legitimate consumers count their fetches when there are
        several (a learner group's ranks): called with the number of items this reader just
        took, returns the total of every reader; (0) reads it. The loss detector (rank 0's)
        then judges that total. None: this reader is the table's only consumer.
    """

    def __init__(self, client_or_address: Union[str, Any], table: str = DEFAULT_TABLE,
                 on_fetched: Optional[Callable[[Rollout], None]] = None,
                 verifier: Optional[RolloutVerifier] = None,
                 loss_detector: Optional[ReplayLossDetector] = None,
                 fetch_counter: Optional[Callable[[int], int]] = None):
        self._client = connect(client_or_address)
        self._table = table
        self._on_fetched = on_fetched
        self._buffer: Deque[Rollout] = collections.deque()
        self._cond = threading.Condition()
        self._request = 0          # items the fetch thread is asked for / still fetching
        self._error: Optional[BaseException] = None
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._verifier = verifier
        self._rejected: Dict[str, int] = collections.Counter()
        self._interruptions = 0    # fetches that failed mid-stream, and gaps of unreachability
        self._unreachable = False
        self._known_left = 0       # the table's size after the last item fetched (_available)
        self.sampled = 0           # rollouts returned by sample()
        self.fetched = 0           # items taken from the table (refused ones too)
        self._loss = loss_detector
        self._fetch_counter = fetch_counter
        self._loss_check_at = 0.0  # time.monotonic() of the next counter check
        self.lost_to_others = 0    # items the loss detector found taken by someone else

    @property
    def interruptions(self) -> int:
        """Fetches that failed mid-stream, gaps of unreachability, and losses the loss detector
        found (the module docstring)."""
        with self._cond:
            return self._interruptions

    @property
    def rejected(self) -> Dict[str, int]:
        """Items refused by the verifier, by reason (REJECT_REASONS); a copy."""
        with self._cond:
            return dict(self._rejected)

    @property
    def buffered(self) -> int:
        """Rollouts already taken from the table and waiting for the next `sample`."""
        return len(self._buffer)

    def queue_size(self) -> int:
        """Rollouts currently in the table (not counting `buffered`); TimeoutError when the
        server does not answer within 1 s."""
        return self._client.table_status(self._table).current_size

    def sample(self, n: int, timeout_s: float, min_items: int = 1) -> List[Rollout]:
        """Up to `n` rollouts, oldest first.

        Returns as soon as `min(min_items, n)` are here (by default: as soon as there is one, with
        all the table holds up to n), or when `timeout_s` passes with fewer (maybe none).
        """
        if n < 0:
            raise ValueError(f"n={n}: must be >= 0")
        if self._closed:
            raise RuntimeError("RolloutReader.sample() after close()")
        if n == 0:
            return []
        self._check_for_loss()
        want = max(1, min(int(min_items), n))
        deadline = time.monotonic() + max(0.0, float(timeout_s))
        delay = _POLL_START_S
        own_fetch = False  # a fetch this call submitted: it asks only for items in the table
        while True:
            with self._cond:
                self._raise_fetch_error()
                have, busy = len(self._buffer), self._request > 0
            # Done with n, or with enough once our own fetch (fast: its items exist) is complete;
            # a fetch left blocked by an earlier call is not waited for.
            if have >= n or (have >= want and not (busy and own_fetch)):
                break
            if not busy:
                k = min(n - have, self._available())
                if k > 0:
                    self._submit(k)
                    own_fetch = busy = True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            with self._cond:
                if busy:
                    if self._request > 0:  # checked under the lock: the end-of-fetch notify
                        self._cond.wait(timeout=remaining)  # cannot slip in before the wait
                else:
                    self._cond.wait(timeout=min(delay, remaining))
                    delay = min(2 * delay, _POLL_MAX_S)
        with self._cond:
            self._raise_fetch_error()
            out = [self._buffer.popleft() for _ in range(min(n, len(self._buffer)))]
        self.sampled += len(out)
        return out

    def _check_for_loss(self) -> None:
        """At most every _LOSS_CHECK_S: the table's counters against what this reader fetched
        (replay/loss.py); a loss counts as an interruption (the learner starts a loss epoch)."""
        now = time.monotonic()
        if self._loss is None or now < self._loss_check_at:
            return
        self._loss_check_at = now + _LOSS_CHECK_S
        try:   # read first: never ahead of the table's counters
            if self._fetch_counter is not None:
                fetched = self._fetch_counter(0)
            else:
                with self._cond:
                    fetched = self.fetched
            status = self._client.table_status(self._table)
        except Exception:  # noqa: BLE001 - unreachable: _available counts the gap
            return
        verdict = self._loss.observe(now, status.inserts, status.current_size, fetched)
        if verdict is not None:
            logging.warning("RolloutReader: replay lost items: %s", verdict.why)
            with self._cond:
                self._interruptions += 1
                self.lost_to_others += max(verdict.missing, 0)

    def _available(self) -> int:
        """Items the table holds at least: what the last fetch saw left behind it (only this
        reader takes items, so the table cannot have fewer since), else one ServerInfo poll."""
        with self._cond:
            left, self._known_left = self._known_left, 0
        if left > 0:
            return left
        try:
            size = self._client.table_status(self._table).current_size
        except KeyError:
            raise
        except Exception as e:  # unreachable or restarting server: report empty, retry
            logging.log_every_n(logging.WARNING, "RolloutReader: replay at %s unreachable: %s",
                                100, self._client.server_address, e)
            self._unreachable = True
            return 0
        if self._unreachable:   # back after a gap: it may have restarted, losing its items
            self._unreachable = False
            with self._cond:
                self._interruptions += 1
        return size

    def _submit(self, k: int) -> None:
        with self._cond:
            self._request = k
            if self._thread is None:
                self._thread = threading.Thread(target=self._fetch_loop, daemon=True,
                                                name=f"RolloutReader[{self._table}]")
                self._thread.start()
            self._cond.notify_all()

    def _raise_fetch_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"RolloutReader: sampling table {self._table!r} at "
                               f"{self._client.server_address} failed: {error}") from error

    def _fetch_loop(self) -> None:
        """The fetch thread: takes `self._request` items from the table into the buffer."""
        while True:
            with self._cond:
                while self._request == 0 and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                k = self._request
            try:
                # A sampler for exactly k items, all in one request (buffer size k). The pybind
                # sampler is what `Client.sample` wraps; used directly to fetch k items per
                # round trip instead of one.
                sampler = self._client.sampler(self._table, k, k)
                for _ in range(k):
                    sample = sampler.GetNextTrajectory()
                    with self._cond:
                        self.fetched += 1
                    if self._fetch_counter is not None:
                        self._fetch_counter(1)
                    left = int(sample[_TABLE_SIZE]) - 1   # the table's size when it was taken
                    rollout = self._decode(sample[_NUM_INFO_TENSORS:])
                    if rollout is None:
                        continue
                    if self._on_fetched is not None:
                        self._on_fetched(rollout)
                    with self._cond:
                        if self._closed:
                            logging.warning("RolloutReader: dropped a rollout that arrived after "
                                            "close()")
                        else:
                            self._buffer.append(rollout)
                with self._cond:
                    self._known_left = left
                del sampler
            except Exception as e:  # handed to the caller by the next sample()
                with self._cond:
                    self._error = e
                    self._interruptions += 1
            finally:
                with self._cond:
                    self._request = 0
                    self._cond.notify_all()

    def _decode(self, flat) -> Optional[Rollout]:
        """The item as a Rollout, or None (refused, counted)."""
        if self._verifier is None:
            return decode_item(flat)
        rollout, reason = self._verifier.decode(flat)
        if reason is not None:
            with self._cond:
                self._rejected[reason] += 1
                n = self._rejected[reason]
            if n & (n - 1) == 0:   # the 1st, 2nd, 4th, ... of each reason
                logging.warning("RolloutReader: refused a replay item: %s: %s [%d so far]",
                                reason, REJECT_REASONS[reason], n)
        return rollout

    def close(self) -> None:
        """Stops the fetch thread. Buffered rollouts (taken from the table) are dropped."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            dropped, busy = len(self._buffer), self._request > 0
            self._buffer.clear()
            self._cond.notify_all()
        if dropped:
            logging.warning("RolloutReader: close() dropped %d buffered rollouts", dropped)
        if busy:
            logging.warning("RolloutReader: close() while a fetch waits in Reverb (another "
                            "consumer took its items); its thread is left to finish as a daemon")
        elif self._thread is not None:
            self._thread.join(timeout=1.0)

    def __enter__(self) -> "RolloutReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RolloutReader(table={self._table!r}, sampled={self.sampled})"
