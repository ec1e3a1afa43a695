"""Inserts rollouts into the replay table, one item per rollout, after validating them.

Variable lengths. A long-lived Reverb `TrajectoryWriter` fixes each column's shape at its first
append and rejects later items of another length; the legacy `Writer` accepts any shape but its
`flush` has no timeout (a full table hangs it forever); a new `TrajectoryWriter` per item opens a
gRPC stream per item. So this writer keeps one long-lived `TrajectoryWriter` per *length bucket*
(4 per doubling by default: 16, 20, 24, 28, 32, 40, ..., capped at max_sequence_length), pads the
per-token columns to the bucket (< 25% more tokens; Reverb's compression shrinks the zeros) and
stores the true length in the `length` column, which the reader cuts back to.

Measured by programs/benchmarks/replay_path.py (2 shared cores, server in another process, 2000
rollouts of ~2k tokens, best of 5 rounds): this writer ~1.8-1.9k rollouts/s; the same writer with
a new `TrajectoryWriter` per item instead of the bucket writers ~1.2k/s; the bare legacy `Writer`
flushed per item ~6-7k/s (but no timeout is possible). A write is ~0.5 ms: the free-slot check
(one `ServerInfo` round trip, ~0.15-0.2 ms), the confirmed insert (~0.2 ms), validation and
padding (~0.1 ms). That is nothing next to generating a 2k-token rollout; batched writes would be
the next step if it ever matters. Padding does not slow the reader (same read rate either way).

Timeouts. Reverb cannot withdraw an item once it is sent: an insert that waits in the rate limiter
lands whenever a slot frees, even after its writer is closed (checked here). So `write` first
polls the table (one `ServerInfo` round trip per poll) until it has a free slot, and sends only
then:

* `write` returns False when the table stayed full (or the server unreachable) until `timeout_s`:
  nothing was sent, so the caller may write the same rollout again later without a duplicate.
* `write` returns True once the server confirms the insert. When several writers see the same
  free slot, the ones that lose the race have their item wait in the server's rate limiter; it
  lands in order when the learner samples. Their `write` returns True after `timeout_s` (+50 ms
  at most) anyway (the item has been handed over and must not be sent again) and counts it in
  `unconfirmed`; that bucket gets a fresh `TrajectoryWriter` so later items do not queue behind
  it, and the writer counts its own waiting items as occupied slots in later checks. The table
  itself never holds more than its capacity; about one more rollout per writer may wait at the
  server, briefly.
* An unreachable server is polled like a full table; `ServerInfo` takes whole seconds of timeout,
  so `write` then returns False up to ~1 s after `timeout_s`.

Validation runs before anything is sent; a bad rollout is never inserted, `write` returns False
and counts the reason in `rejected` (see REJECT_REASONS), and never raises for bad data.

One `RolloutWriter` per actor; `write` is serialised by a lock, so sharing one is safe but slow.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
from absl import logging

from sao_actor_learner.replay.tables import (DEFAULT_TABLE, LENGTH_COLUMN, LENGTH_DTYPE,
                                             SERVER_INFO_TIMEOUT_S, connect, table_status)
from sao_actor_learner.types import (SCALAR_COLUMNS, SCALAR_DTYPES, TOKEN_COLUMNS, TOKEN_DTYPES,
                                     Rollout)

# Why a rollout was refused, and what to change. Exactly one reason (the first that applies, in
# this order) is counted per refused rollout.
REJECT_REASONS: Dict[str, str] = {
    "malformed": "a column is missing, not 1-D, or not convertible to its dtype in types.py: "
                 "build rollouts with the Rollout dataclass",
    "empty": "the rollout has no tokens",
    "length_mismatch": "per-token columns (tokens, action_mask, rollout_logp, versions, rewards) "
                       "must all have the same length",
    "too_long": "the rollout is longer than max_sequence_length: raise "
                "SAOConfig.max_sequence_length or cut episodes shorter (max_new_tokens, turns)",
    "bad_action_mask": "action_mask values must be 0 or 1",
    "no_action_tokens": "no token has action_mask == 1: nothing to train on",
    "action_at_position_0": "action_mask[0] is 1, but token 0 has no preceding position to predict "
                            "it from (types.py: position 0 is never an action)",
    "token_out_of_range": "a token id is outside [0, vocab_size): check that vocab_size matches "
                          "the engine's tokenizer",
    "nonfinite_logp": "rollout_logp is NaN or inf on an action token: the engine's log-probs are "
                      "broken (temperature 0? overflow?)",
    "negative_version": "versions < 0 on an action token: the engine must tag every sampled token "
                        "with the policy version that sampled it",
    "nonfinite_reward": "rewards contain NaN or inf",
}

# After sending, wait at least this long for the server's confirmation even if timeout_s is spent.
_MIN_CONFIRM_S = 0.05
# Backoff of the free-slot poll while the table is full.
_POLL_START_S = 0.001
_POLL_MAX_S = 0.02
_MIN_BUCKET = 16


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


class RolloutWriter:
    """Validates rollouts and inserts each as one replay item (see the module doc).

    Args:
      client_or_address: a `reverb.Client` or the replay address "host:port".
      table: the table name.
      max_sequence_length: longer rollouts are rejected ("too_long").
      vocab_size: token ids must lie in [0, vocab_size).
      buckets_per_octave: length buckets per doubling (padding < 1/buckets_per_octave of the
        tokens; each bucket in use holds one Reverb writer and its gRPC stream).
    """

    def __init__(self, client_or_address: Union[str, Any], table: str = DEFAULT_TABLE,
                 max_sequence_length: int = 0, vocab_size: int = 0, *,
                 buckets_per_octave: int = 4):
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
        self._writers: Dict[int, Any] = {}   # bucket length -> reverb.TrajectoryWriter
        self._retired: List[Any] = []        # writers with an unconfirmed item, until it lands
        self._rejected: collections.Counter = collections.Counter()
        self._inserted = 0
        self._timeouts = 0
        self._unconfirmed = 0
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
        return self._unconfirmed

    def stats(self) -> Dict[str, Any]:
        return {"inserted": self._inserted, "timeouts": self._timeouts,
                "unconfirmed": self._unconfirmed, "rejected": self.rejected}

    # --- writing ----------------------------------------------------------------------------------
    def write(self, rollout: Rollout, timeout_s: float) -> bool:
        """Inserts `rollout` as one item; True once inserted (see the module doc).

        False if it was rejected (counted in `rejected`) or the table stayed full for `timeout_s`
        (counted in `timeouts`); in both cases nothing was sent and the writer stays usable.
        """
        deadline = time.monotonic() + max(0.0, float(timeout_s))
        with self._lock:
            if self._closed:
                raise RuntimeError("RolloutWriter.write() after close()")
            columns, reason = self.validate(rollout)
            if reason is not None:
                self._reject(reason, rollout)
                return False
            if not self._wait_for_free_slot(deadline):
                self._timeouts += 1
                return False
            self._send(columns, deadline)
            self._inserted += 1
            return True

    def validate(self, rollout: Rollout) -> Tuple[Optional[Dict[str, np.ndarray]], Optional[str]]:
        """(columns with exact dtypes, None) for a valid rollout, else (None, reason)."""
        try:
            cols = {name: _as_dtype(getattr(rollout, name), TOKEN_DTYPES[name])
                    for name in TOKEN_COLUMNS}
            for name in SCALAR_COLUMNS:
                value = _as_dtype(getattr(rollout, name), SCALAR_DTYPES[name])
                if value.shape != ():
                    return None, "malformed"
                cols[name] = value
        except (AttributeError, TypeError, ValueError, OverflowError):
            return None, "malformed"
        if any(cols[name].ndim != 1 for name in TOKEN_COLUMNS):
            return None, "malformed"
        length = cols["tokens"].shape[0]
        if length == 0:
            return None, "empty"
        if any(cols[name].shape[0] != length for name in TOKEN_COLUMNS):
            return None, "length_mismatch"
        if length > self.max_sequence_length:
            return None, "too_long"
        # Each check is one or two whole-array reductions; masks are built only on the slow path.
        mask = cols["action_mask"]
        if mask.view(np.uint8).max() > 1:  # int8 -1 reads as 255
            return None, "bad_action_mask"
        if not mask.any():
            return None, "no_action_tokens"
        if mask[0]:
            return None, "action_at_position_0"
        tokens = cols["tokens"]
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            return None, "token_out_of_range"
        act = mask.view(np.bool_)  # values are 0/1 (checked above): a free boolean view
        logp = cols["rollout_logp"]
        if not _all_finite(logp) and not np.isfinite(logp[act]).all():
            return None, "nonfinite_logp"
        if cols["versions"].min(where=act, initial=0) < 0:
            return None, "negative_version"
        if not _all_finite(cols["rewards"]):
            return None, "nonfinite_reward"
        cols[LENGTH_COLUMN] = np.asarray(length, dtype=LENGTH_DTYPE)
        return cols, None

    def _reject(self, reason: str, rollout: Any) -> None:
        self._rejected[reason] += 1
        n = self._rejected[reason]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... of each reason
            logging.warning("RolloutWriter: rejected rollout (prompt_id=%s): %s: %s [%d so far]",
                            getattr(rollout, "prompt_id", "?"), reason, REJECT_REASONS[reason], n)

    def _wait_for_free_slot(self, deadline: float) -> bool:
        """Polls the table until the rate limiter would admit an insert, or the deadline."""
        delay = _POLL_START_S
        last_error: Optional[BaseException] = None
        while True:
            self._reap_retired()
            remaining = deadline - time.monotonic()
            try:
                size, capacity = table_status(
                    self._client, self._table,
                    timeout_s=max(SERVER_INFO_TIMEOUT_S, int(np.ceil(remaining))))
                # Our own items still waiting in the rate limiter will take slots first.
                if size + len(self._retired) < capacity:
                    return True
            except KeyError:
                raise
            except Exception as e:  # unreachable or restarting server: keep trying until deadline
                last_error = e
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if last_error is not None:
                    logging.warning("RolloutWriter: replay at %s unreachable: %s",
                                    self._client.server_address, last_error)
                return False
            time.sleep(min(delay, remaining))
            delay = min(2 * delay, _POLL_MAX_S)

    def _bucket(self, length: int) -> int:
        return int(self._buckets[np.searchsorted(self._buckets, length)])

    def _send(self, columns: Dict[str, np.ndarray], deadline: float) -> None:
        import reverb

        length = int(columns[LENGTH_COLUMN])
        bucket = self._bucket(length)
        if bucket != length:
            for name in TOKEN_COLUMNS:
                padded = np.zeros(bucket, dtype=columns[name].dtype)
                padded[:length] = columns[name]
                columns[name] = padded
        writer = self._writers.get(bucket)
        if writer is None:
            writer = self._client.trajectory_writer(num_keep_alive_refs=1)
            self._writers[bucket] = writer
        try:
            writer.append(columns)
            history = writer.history
            writer.create_item(self._table, 1.0, {name: history[name][-1] for name in columns})
            wait_s = max(deadline - time.monotonic(), _MIN_CONFIRM_S)
            writer.flush(timeout_ms=int(wait_s * 1000))
        except reverb.errors.DeadlineExceededError:
            # Another writer took the slot: the item waits in the server's rate limiter and will
            # land. Keep this writer alive until it does; later items use a fresh one.
            self._writers.pop(bucket, None)
            self._retired.append(writer)
            self._unconfirmed += 1
            logging.log_every_n(logging.WARNING, "RolloutWriter: insert not yet confirmed after "
                                "the timeout (another writer took the free slot); it waits in "
                                "replay's rate limiter and lands when the learner samples", 100)
        except Exception as e:
            self._writers.pop(bucket, None)
            _close_quietly(writer)
            raise RuntimeError(f"RolloutWriter: inserting into table {self._table!r} at "
                               f"{self._client.server_address} failed: {e}") from e

    def _reap_retired(self) -> None:
        """Closes retired writers whose item has landed."""
        if not self._retired:
            return
        import reverb

        keep = []
        for writer in self._retired:
            try:
                writer.flush(timeout_ms=1)  # not 0: Reverb reads timeout_ms=0 as "no timeout"
            except reverb.errors.DeadlineExceededError:
                keep.append(writer)  # still waiting in the rate limiter
                continue
            except Exception as e:  # the stream broke (server gone): the item is lost
                logging.warning("RolloutWriter: an unconfirmed insert failed: %s", e)
            _close_quietly(writer)
        self._retired = keep

    def close(self) -> None:
        """Closes the Reverb writers. Items already confirmed stay in replay."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._retired:
                self._reap_retired()
            if self._retired:
                logging.warning("RolloutWriter: closing with %d inserts still waiting in replay's "
                                "rate limiter; they land when the learner samples",
                                len(self._retired))
            for writer in list(self._writers.values()) + self._retired:
                _close_quietly(writer)
            self._writers.clear()
            self._retired = []

    def __enter__(self) -> "RolloutWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"RolloutWriter(table={self._table!r}, inserted={self._inserted}, "
                f"timeouts={self._timeouts}, rejected={dict(self._rejected)})")


def _as_dtype(value: Any, dtype) -> np.ndarray:
    """`value` as an array of `dtype`; raises ValueError if the conversion changes a value."""
    array = np.asarray(value)
    if array.dtype == dtype:
        return array
    if array.dtype == object:
        raise ValueError("object array")
    converted = array.astype(dtype)
    if np.dtype(dtype).kind in "iub":  # integers must survive the cast exactly (floats may round)
        if array.dtype.kind not in "iub" and not np.all(np.isfinite(array)):
            raise ValueError(f"non-finite values cannot become {np.dtype(dtype)}")
        if not np.array_equal(converted.astype(array.dtype), array):
            raise ValueError(f"values change when cast from {array.dtype} to {np.dtype(dtype)}")
    return converted


def _all_finite(x: np.ndarray) -> bool:
    """Whether every value is finite. A finite sum proves it (NaN and inf propagate); only a
    non-finite sum (or an overflow) pays for the elementwise check."""
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(x.sum(dtype=np.float64)):
            return True
    return bool(np.isfinite(x).all())


def _close_quietly(writer: Any) -> None:
    try:
        writer.close()
    except Exception as e:  # closing must not mask the caller's error
        logging.info("RolloutWriter: closing a Reverb writer failed: %s", e)
