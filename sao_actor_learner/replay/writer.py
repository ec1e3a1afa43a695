"""Inserts rollouts into the replay table, one item per rollout, after validating them.

Variable lengths. A long-lived Reverb `TrajectoryWriter` fixes each column's shape at its first
append and rejects later items of another length; the legacy `Writer` accepts any shape but its
`flush` has no timeout (a full table hangs it forever); a new `TrajectoryWriter` per item opens a
gRPC stream per item. So this writer keeps one long-lived `TrajectoryWriter` per *length bucket*
(4 per doubling by default: 16, 20, 24, 28, 32, 40, ..., capped at max_sequence_length) and pads
each item (the rollout packed into one uint8 column with its true length in the header,
replay/item.py) to its bucket's size (< 25% more bytes; Reverb's compression shrinks the zeros).

Batches. `write_many(rollouts, timeout_s)` inserts an actor's whole generation with the
guarantees below: one free-slot check (the batch goes out whole while the table has room for it
twice over; nearer full, one rollout per check, as `write`), every rollout of the group padded to
the group's longest bucket and appended to that one bucket writer (so they land in order), one
confirmation round trip per call instead of one per rollout. Each rollout is packed, signed and
appended in turn, so Reverb's C++ threads compress and send one while Python packs the next. The
appends go straight to Reverb's C++ writer (replay/client.py), without its Python wrapper's
bookkeeping (docs/FACTS.md). A rollout may thus be padded beyond its own bucket, to its group's.

Pipelined (`send`, what the actors call: `write_many(..., wait_for_confirmation=False)`): `send`
waits only for the confirmation of the group sent before and leaves its own in flight; `flush` or
`close` wait for it (replay/streams.py: the Reverb writers, the group in flight, retired writers).

The free-slot check asks replay (one `ServerInfo` round trip) only when its last answer, less
what this writer sent since, leaves less than twice the batch, or is older than _FREE_HINT_S
(50 ms): only other writers' inserts can have taken slots since, which is a lost race (below),
made rare by the margin and the age.

Throughput and the cost per rollout of each step (the HMAC, the checks and packing, Reverb's
append) are measured by programs/benchmarks/replay_path.py: BENCHMARKS.md, section 3.

Timeouts. Reverb cannot withdraw an item once it is sent: an insert that waits in the rate limiter
lands whenever a slot frees, even after its writer is closed (checked here). So `write` first
polls the table (one `ServerInfo` round trip per poll) until it has a free slot, and sends only
then:

* `write` returns False when the table stayed full (or the server unreachable) until `timeout_s`:
  nothing was sent, so the caller may write the same rollout again later without a duplicate.
* `write` returns True once the item is handed over. When several writers see the same free
  slot, the ones that lose the race have their item wait in the server's rate limiter; it lands
  in order when the learner samples (even after this writer is closed). `write` returns True
  after `timeout_s` (+50 ms at most) anyway: the item must not be sent again (callers that keep
  a copy, the actor's spool, keep it until the learner acknowledges it, end to end). That
  bucket gets a fresh `TrajectoryWriter` so later items do not queue behind it, and the writer
  counts its own waiting items as occupied slots in later checks (`unconfirmed` counts them).
  The table itself never holds more than its capacity.
* An unreachable server is polled like a full table; `ServerInfo` takes whole seconds of timeout,
  so `write` then returns False up to ~1 s after `timeout_s`.

Validation (replay/validation.py) runs before anything is sent; a bad rollout is never inserted,
`write` returns False (`write_many`: `WriteResult.rejected` names the reason) and counts the
reason in `rejected` (see REJECT_REASONS), and never raises for bad data. With a `signer` (the
actor's ActorSigner) every item carries its run's tag and the HMAC of its header and columns
under the actor's key, which the learner's reader checks; without one the tag and signature are
zeros (a reader that checks refuses such items).

One `RolloutWriter` per actor; `write` and `write_many` are serialised by a lock, so sharing one
is safe but slow.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
from absl import logging

from sao_actor_learner.replay import item
from sao_actor_learner.replay.client import SERVER_INFO_TIMEOUT_S, connect
from sao_actor_learner.replay.streams import InsertStreams
from sao_actor_learner.replay.tables import DEFAULT_TABLE
from sao_actor_learner.replay.validation import (REJECT_REASONS, ActorSigner,  # noqa: F401
                                                 check_rollout, checked_item_parts)
from sao_actor_learner import core
from sao_actor_learner.types import Rollout

# Backoff of the free-slot poll while the table is full.
_POLL_START_S = 0.001
_POLL_MAX_S = 0.02
_MIN_BUCKET = 16
# How long close() waits for the confirmation of what a pipelined `send` left in flight.
_CLOSE_CONFIRM_S = 1.0
# How long a free-slot poll's answer is reused (less what this writer sent since).
_FREE_HINT_S = 0.05


class WriteResult(NamedTuple):
    """What `RolloutWriter.write_many` did with one rollout.

    inserted: handed to replay (it lands, possibly after waiting in the rate limiter); never
      send it again unless it is lost.
    confirmed: replay confirmed it before `write_many` returned; an inserted, unconfirmed one
      waits in replay's rate limiter (another writer took its slot) and lands later.
    rejected: the REJECT_REASONS key if validation refused it, else None. Neither inserted nor
      rejected: the table stayed full until the timeout and nothing was sent; write it again.
    """
    inserted: bool
    confirmed: bool
    rejected: Optional[str]


NOT_SENT = WriteResult(False, False, None)


def bucket_lengths(max_sequence_length: int, per_octave: int = 4,
                   min_bucket: int = _MIN_BUCKET) -> List[int]:
    """The padded lengths: `per_octave` evenly spaced steps per doubling from `min_bucket`
    (per_octave=4: 16, 20, 24, 28, 32, 40, 48, ...), capped by max_sequence_length, which is
    always the last. Padding adds less than 1/per_octave of the tokens."""
    out, p = [], min_bucket
    while p < max_sequence_length:
        step = max(1, p // per_octave)
        out.extend(b for b in range(p, 2 * p, step) if b < max_sequence_length)
        p *= 2
    out.append(max_sequence_length)
    return sorted(set(out))


class RolloutWriter(core.RolloutSink):
    """Validates rollouts and inserts each as one replay item (see the module doc).

    Args:
      client_or_address: the replay address "host:port", a ReplayClient or a `reverb.Client`.
      table: the table name.
      max_sequence_length: longer rollouts are rejected ("too_long").
      vocab_size: token ids must lie in [0, vocab_size).
      buckets_per_octave: length buckets per doubling (padding < 1/buckets_per_octave of the
        tokens; each bucket in use holds one Reverb writer and its gRPC stream).
      signer: the actor's ActorSigner (its key and the run's tag) for the items' signatures;
        None: zeros (no run tag).
    """

    def __init__(self, client_or_address: Union[str, Any], table: str = DEFAULT_TABLE,
                 max_sequence_length: int = 0, vocab_size: int = 0, *,
                 buckets_per_octave: int = 4, signer: Optional[ActorSigner] = None):
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length={max_sequence_length}: must be >= 1 (pass "
                             "SAOConfig.max_sequence_length)")
        if vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size}: must be >= 1 (pass the engine's "
                             "vocab_size)")
        self._client = connect(client_or_address)
        self._table = table
        self.max_sequence_length = int(max_sequence_length)
        self.vocab_size = int(vocab_size)
        if buckets_per_octave < 1:
            raise ValueError(f"buckets_per_octave={buckets_per_octave}: must be >= 1")
        self._buckets = np.asarray(bucket_lengths(self.max_sequence_length, buckets_per_octave))
        self._signer = signer
        self._streams = InsertStreams(self._client, table)
        self._rejected: collections.Counter = collections.Counter()
        self._inserted = 0
        self._timeouts = 0
        self._free_hint = 0                  # see _free_slots
        self._free_hint_until = 0.0
        self._lock = threading.Lock()
        self._closed = False

    # --- counters ---------------------------------------------------------------------------------
    @property
    def rejected(self) -> Dict[str, int]:
        """Refused rollouts by reason (REJECT_REASONS); a copy."""
        return dict(self._rejected)

    @property
    def inserted(self) -> int:
        """Rollouts handed to replay (`write` returned True)."""
        return self._inserted

    @property
    def timeouts(self) -> int:
        """`write` calls that found no free slot within timeout_s (nothing was sent)."""
        return self._timeouts

    @property
    def unconfirmed(self) -> int:
        """Inserted rollouts that were still waiting in the server's rate limiter when `write`
        returned (another writer took the free slot first); they land in order."""
        return self._streams.unconfirmed

    def stats(self) -> Dict[str, Any]:
        return {"inserted": self._inserted, "timeouts": self._timeouts,
                "unconfirmed": self._streams.unconfirmed, "rejected": self.rejected}

    # --- writing ----------------------------------------------------------------------------------
    # --- core.RolloutSink --------------------------------------------------------------------
    def check(self, rollout: Rollout) -> Optional[str]:
        """None when `rollout` passes validation, else the reason (nothing counted)."""
        return check_rollout(rollout, self.vocab_size, self.max_sequence_length)[1]

    def send(self, rollouts: Sequence[Rollout], timeout_s: float) -> List[bool]:
        """`write_many` without waiting for this call's confirmation (pipelined: see the module
        doc), per rollout whether it went (a refused one counts as not sent)."""
        return [result.inserted
                for result in self.write_many(rollouts, timeout_s, wait_for_confirmation=False)]

    def write(self, rollout: Rollout, timeout_s: float) -> bool:
        """Inserts `rollout` as one item; True once inserted (see the module doc).

        False if it was rejected (counted in `rejected`) or the table stayed full for `timeout_s`
        (counted in `timeouts`); in both cases nothing was sent and the writer stays usable.
        """
        return self.write_many([rollout], timeout_s)[0].inserted

    def write_many(self, rollouts: Sequence[Rollout], timeout_s: float,
                   wait_for_confirmation: bool = True) -> List[WriteResult]:
        """Inserts `rollouts` in order with the guarantees of `write`, one `WriteResult` each.

        One free-slot check and one confirmation round trip per group of rollouts that
        fits in the table's free slots (usually the whole batch), instead of one of each per
        rollout. Invalid rollouts are rejected (nothing sent, counted in `rejected`). The valid
        ones are sent in order: all at once while the table has room for them twice over, else
        one per free-slot check (nearly full, other actors compete for the slots; a lost race
        then leaves one rollout waiting in the rate limiter, as with `write`), until all are sent
        or `timeout_s` passes; those not sent by then were not sent at all (counted in
        `timeouts`): write them again later, no duplicate. The rollouts of one group are padded
        to the group's longest bucket and go through one Reverb writer, so they land in order.

        `wait_for_confirmation=False` (pipelined, what `send` does): the last group is not
        waited for, and its results say inserted, unconfirmed. The next call waits for it once
        its own group is appended (or before it polls the table or uses another bucket's
        writer); `flush` and `close` wait for it too. Groups thus still land in order, and a
        lost race is found (and handled as above) one call later.
        """
        deadline = time.monotonic() + max(0.0, float(timeout_s))
        with self._lock:
            if self._closed:
                raise RuntimeError("RolloutWriter.write_many() after close()")
            results: List[WriteResult] = [NOT_SENT] * len(rollouts)
            valid: List[Tuple[int, Dict[str, Any], bytes]] = []
            for i, rollout in enumerate(rollouts):
                cols, header, reason = checked_item_parts(rollout, self.vocab_size,
                                                          self.max_sequence_length)
                if reason is None:
                    valid.append((i, cols, header))
                else:
                    self._reject(reason, rollout)
                    results[i] = WriteResult(False, False, reason)
            sent = 0
            while sent < len(valid):
                left = len(valid) - sent
                free = int(self._free_slots(deadline, left))
                if free <= 0:
                    break
                # The rest at once while the table has room for it twice over; nearer full
                # (other actors compete for the slots) one per check, as `write` does, so a
                # lost race leaves one rollout waiting in the rate limiter, not a batch.
                group = valid[sent:sent + (left if free >= 2 * left else 1)]
                confirmed, timed_out = self._send_group(
                    [(cols, header) for _, cols, header in group], deadline, wait_for_confirmation)
                if confirmed is None:
                    break   # the deadline passed waiting for the group sent before: not sent
                for (i, _, _), ok in zip(group, confirmed):
                    results[i] = WriteResult(True, ok, None)
                self._inserted += len(group)
                self._free_hint -= len(group)
                sent += len(group)
                if timed_out:
                    break   # the deadline passed waiting for a confirmation: send no more now
            self._timeouts += len(valid) - sent
            return results

    def _pack(self, cols: Dict[str, Any], header: bytes, padded_length: int) -> np.ndarray:
        if self._signer is None:
            return item.pack(cols, padded_length, None, header_bytes=header)
        return item.pack(cols, padded_length, self._signer.sign, header_bytes=header,
                         run_tag=self._signer.run_tag)

    def _reject(self, reason: str, rollout: Any) -> None:
        self._rejected[reason] += 1
        n = self._rejected[reason]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... of each reason
            logging.warning("RolloutWriter: rejected rollout (prompt_id=%s): %s: %s [%d so far]",
                            rollout.prompt_id if isinstance(rollout, Rollout) else "?", reason, REJECT_REASONS[reason], n)

    def _free_slots(self, deadline: float, wanted: int) -> int:
        """How many inserts the table admits now: the last poll's answer minus what this writer
        sent since, while that answer is younger than _FREE_HINT_S and leaves room for `wanted`
        twice over (only other writers' inserts can have taken slots since: a lost race, which
        `write` handles, and which the margin and the age make rare); else a fresh poll
        (`_wait_for_free_slot`). Saves the ServerInfo round trip of most calls."""
        if self._free_hint >= 2 * wanted and time.monotonic() < self._free_hint_until:
            return self._free_hint
        # What is still in flight first, so that the table's size counts it; a lost race (it
        # waits in the rate limiter) means no free slot by the deadline.
        if not self._streams.settle(deadline):
            return 0
        free = int(self._wait_for_free_slot(deadline))
        self._free_hint, self._free_hint_until = free, time.monotonic() + _FREE_HINT_S
        return free

    def _wait_for_free_slot(self, deadline: float) -> int:
        """Polls the table until the rate limiter would admit an insert, or the deadline; returns
        how many inserts it would admit (0: none by the deadline)."""
        delay = _POLL_START_S
        last_error: Optional[BaseException] = None
        while True:
            self._streams.reap_retired()
            remaining = deadline - time.monotonic()
            try:
                status = self._client.table_status(
                    self._table, timeout_s=max(SERVER_INFO_TIMEOUT_S, int(np.ceil(remaining))))
                size, capacity = status.current_size, status.insert_capacity
                # Our own items still waiting in the rate limiter will take slots first.
                free = capacity - size - self._streams.waiting()
                if free > 0:
                    return free
            except KeyError:
                raise
            except Exception as e:  # unreachable or restarting server: keep trying until deadline
                last_error = e
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if last_error is not None:
                    logging.warning("RolloutWriter: replay at %s unreachable: %s",
                                    self._client.server_address, last_error)
                return 0
            time.sleep(min(delay, remaining))
            delay = min(2 * delay, _POLL_MAX_S)

    def _bucket(self, length: int) -> int:
        return int(self._buckets[np.searchsorted(self._buckets, length)])

    def _send_group(self, group: List[Tuple[Dict[str, Any], bytes]], deadline: float,
                    wait_for_confirmation: bool = True) -> Tuple[Optional[List[bool]], bool]:
        """Packs, signs and sends the checked rollouts of `group`, padded to the longest one's
        bucket, through that bucket's Reverb writer (InsertStreams.send: what it returns)."""
        padded = self._bucket(max(int(cols["tokens"].shape[0]) for cols, _ in group))
        packed = (self._pack(cols, header, padded) for cols, header in group)
        return self._streams.send(item.item_bytes(padded), packed, len(group), deadline,
                                  wait_for_confirmation)

    def flush(self, timeout_s: float) -> bool:
        """Waits for the confirmation of what a pipelined `send` left in flight; False when it
        did not come within `timeout_s` (it waits in the rate limiter and lands later)."""
        with self._lock:
            return self._streams.settle(time.monotonic() + max(0.0, float(timeout_s)))

    def close(self) -> None:
        """Closes the Reverb writers. Items already confirmed stay in replay."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._streams.close(_CLOSE_CONFIRM_S)

    def __enter__(self) -> "RolloutWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"RolloutWriter(table={self._table!r}, inserted={self._inserted}, "
                f"timeouts={self._timeouts}, rejected={dict(self._rejected)})")
