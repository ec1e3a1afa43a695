"""The learner's data position: what it has sampled since its last checkpoint, and resuming.

A learner checkpoint (builder.save_learner_checkpoint) holds the policy, critic, optimisers,
version, counters and RNG state at the end of a step. Replay hands out each rollout once, so the
rollouts the learner took after that checkpoint exist nowhere else when it crashes. The journal
keeps them: `JournaledReader` wraps the learner's reader and appends each rollout, as it arrives
from replay (RolloutReader's `on_fetched`), to `<checkpoints>/journal/after_step_<N>.log` (N:
the version of the checkpoint it follows), before the learner can use it.

Resuming (after a crash, a `kill -9`, or `--resume`): the learner is rebuilt from the newest
complete checkpoint, then its reader first hands back the journalled rollouts, in order, before
sampling replay again. The learner is deterministic given its state and its data (one thread,
no dropout) and never asks for more rollouts than it uses, so it redoes the lost steps exactly:
the same batches, staleness drops, weights and version numbers (a republished version must be
byte-identical, which the variable server checks). No version number is reused for other
weights. With no checkpoint yet, the redo starts from the initial weights (version 0).

Rollouts in transit when the learner is killed (replay removed them as it sent them; the journal
had not yet written them) are not lost: their actors still hold them (they keep every rollout
until the learner acknowledges it) and re-insert them when the restarted learner starts a new
loss epoch (learner.py).

Each journal record is one write: a 12-byte header (magic, length, crc32) and the pickled list
of rollouts. A record torn by a crash mid-write fails its crc and is ignored.

No torch here.
"""
from __future__ import annotations

import collections
import os
import pickle
import re
import shutil
import struct
import threading
import time
import zlib
from typing import Any, Callable, List, Optional, Sequence, Tuple

from absl import logging

from sao_actor_learner import core

_MAGIC = b"SAOJ"
_HEADER = struct.Struct("<4sII")      # magic, payload length, crc32 of the payload
_SEGMENT_RE = re.compile(r"^after_step_(\d{6,})\.log$")
_CHECKPOINT_RE = re.compile(r"^step_(\d{6,})$")
LEARNER_STATE_FILE = "learner_state.pt"


def journal_dir(checkpoint_root: str, rank: int = 0) -> str:
    """Rank 0's journal is checkpoints/journal; rank r's of a learner group journal_rank<r>."""
    return os.path.join(checkpoint_root, "journal" if rank == 0 else f"journal_rank{rank}")


def segment_path(directory: str, after_step: int) -> str:
    return os.path.join(directory, f"after_step_{after_step:06d}.log")


def read_segment(path: str) -> Tuple[List[List[Any]], int]:
    """(the records of one journal segment, the byte length of its intact prefix)."""
    records: List[List[Any]] = []
    good = 0
    if not os.path.exists(path):
        return records, 0
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos + _HEADER.size <= len(data):
        magic, length, crc = _HEADER.unpack_from(data, pos)
        start, end = pos + _HEADER.size, pos + _HEADER.size + length
        if magic != _MAGIC or end > len(data) or zlib.crc32(data[start:end]) != crc:
            logging.warning("journal %s: torn or corrupt record at byte %d (of %d); ignoring "
                            "the rest", path, pos, len(data))
            break
        records.append(pickle.loads(data[start:end]))
        pos = good = end
    return records, good


class ReaderJournal:
    """Append-only segments of sample() results (see the module docstring)."""

    def __init__(self, directory: str, after_step: int) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._lock = threading.Lock()
        self._fd: Optional[int] = None
        self.after_step = -1
        self._open(after_step)

    def _open(self, after_step: int) -> None:
        path = segment_path(self.directory, after_step)
        _, good = read_segment(path)
        if os.path.exists(path) and os.path.getsize(path) != good:
            with open(path, "r+b") as f:   # drop a torn tail before appending after it
                f.truncate(good)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        old, self._fd, self.after_step = self._fd, fd, after_step
        if old is not None:
            os.close(old)

    def record(self, rollouts: Sequence[Any]) -> None:
        """Appends one sample() result (one write)."""
        payload = pickle.dumps(list(rollouts), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            os.write(self._fd, _HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload)

    def rotate(self, after_step: int, commit: Callable[[], Any],
               carry: Sequence[Sequence[Any]] = ()) -> Any:
        """Moves on to the segment that follows checkpoint `after_step`; returns commit()'s.

        `commit()` writes the checkpoint itself (atomically). The new segment, holding `carry`
        (records not yet handed back to the learner), is on disk before the checkpoint, and the
        old segments are deleted after it: a crash at any point leaves a checkpoint whose
        segment holds every rollout sampled after it.
        """
        path = segment_path(self.directory, after_step)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            for records in carry:
                payload = pickle.dumps(list(records), protocol=pickle.HIGHEST_PROTOCOL)
                f.write(_HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload)
        os.replace(tmp, path)
        result = commit()
        with self._lock:
            self._open(after_step)
        for name in os.listdir(self.directory):
            m = _SEGMENT_RE.match(name)
            if m and int(m.group(1)) != after_step:
                os.remove(os.path.join(self.directory, name))
        return result

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class JournaledReader(core.RolloutSource):
    """The learner's reader (a core.RolloutSource), journalling every rollout it takes from replay, and handing back
    the journalled `replay` first.

    reader: a RolloutReader-like object, or a factory `make(on_fetched)` building one that calls
      `on_fetched(rollout)` as each rollout arrives from replay (RolloutReader's `on_fetched`):
      then rollouts are journalled at once, even those a crash leaves in the reader's buffer;
      a plain reader's `sample()` results are journalled when they are returned.
    replay: journalled records to hand back, in order, before sampling replay again (a
      deterministic learner then redoes exactly the steps it lost: only the order of the
      rollouts matters, as the learner never asks for more than it uses).
    """

    def __init__(self, reader: Any, journal: ReaderJournal,
                 replay: Sequence[Sequence[Any]] = ()) -> None:
        self.journal = journal
        self._lock = threading.Lock()
        self._unreturned: "collections.deque" = collections.deque()  # journalled, not returned
        if callable(reader) and not hasattr(reader, "sample"):
            self._reader = reader(self._fetched)
            self._journal_at_fetch = True
        else:
            self._reader = reader
            self._journal_at_fetch = False
        self._replay: List[Any] = [r for record in replay for r in record]
        self.replayed = 0              # rollouts handed back from the journal

    @property
    def replaying(self) -> bool:
        """Whether journalled rollouts are still waiting to be handed back."""
        return bool(self._replay)

    def _fetched(self, rollout: Any) -> None:
        """In the reader's fetch thread: journal the rollout before anyone can use it."""
        with self._lock:
            self.journal.record([rollout])
            self._unreturned.append(rollout)

    def sample(self, n: int, timeout_s: float, min_items: int = 1) -> List[Any]:
        if self._replay and n > 0:
            got, self._replay = self._replay[:n], self._replay[n:]
            self.replayed += len(got)
            return got           # already in the journal segment being appended to
        try:
            got = self._reader.sample(n, timeout_s, min_items=min_items)
        except RuntimeError as e:
            # Replay went away mid-fetch (a restart): its items that reached the reader stay
            # buffered for the next call; wait a little and report nothing now.
            logging.warning("replay sampling failed (%s); retrying", e)
            time.sleep(min(max(timeout_s, 0.0), 0.5))
            return []
        if self._journal_at_fetch:
            with self._lock:
                if got:   # usually the oldest ones; removed wherever they are
                    returned = {id(r) for r in got}
                    self._unreturned = collections.deque(
                        r for r in self._unreturned if id(r) not in returned)
                if len(self._unreturned) > 4096:
                    logging.log_every_n_seconds(
                        logging.WARNING, "JournaledReader: %d journalled rollouts were never "
                        "returned by the reader", 60, len(self._unreturned))
        elif got:
            self.journal.record(got)
        return got

    def checkpoint(self, after_step: int, commit: Callable[[], Any]) -> Any:
        """Writes checkpoint `after_step` with `commit()` and starts the journal segment after
        it, carrying what the learner has not used yet (journalled rollouts still to hand back,
        and fetched ones still in the reader's buffer); returns commit()'s result."""
        with self._lock:
            carry = [r for r in (self._replay, list(self._unreturned)) if r]
            return self.journal.rotate(after_step, commit, carry=carry)

    def queue_size(self) -> int:
        """Rollouts waiting in replay; -1 while replay does not answer (it is restarting): a
        metric must not take the learner down."""
        try:
            return self._reader.queue_size()
        except (TimeoutError, RuntimeError) as e:
            logging.log_every_n_seconds(logging.WARNING, "replay unreachable for queue_size: %s",
                                        30, e)
            return -1

    @property
    def buffered(self) -> int:
        return getattr(self._reader, "buffered", 0)

    @property
    def rejected(self) -> dict:
        return dict(getattr(self._reader, "rejected", {}))

    @property
    def interruptions(self) -> int:
        return getattr(self._reader, "interruptions", 0)

    @property
    def sampled(self) -> int:
        return getattr(self._reader, "sampled", 0) + self.replayed

    def close(self) -> None:
        closer = getattr(self._reader, "close", None)
        if closer is not None:
            closer()
        self.journal.close()


# --- resuming -----------------------------------------------------------------------------------
class ResumePoint:
    """Where a learner picks up in `checkpoint_root`: the newest complete checkpoint (None: the
    initial weights), its step, and the rollouts journalled after it."""

    def __init__(self, checkpoint_root: str, rank: int = 0) -> None:
        self.checkpoint_root = checkpoint_root
        self.checkpoint, self.step = latest_checkpoint(checkpoint_root)
        self.journal_dir = journal_dir(checkpoint_root, rank)
        self.replay, _ = read_segment(segment_path(self.journal_dir, self.step))

    @property
    def resuming(self) -> bool:
        """Whether there is anything to resume from (else a fresh start)."""
        return self.checkpoint is not None or bool(self.replay)

    def reader(self, reader: Any) -> JournaledReader:
        """`reader` (or a factory, see JournaledReader) wrapped to journal from here on, after
        handing back `replay`."""
        return JournaledReader(reader, ReaderJournal(self.journal_dir, self.step), self.replay)

    def restore(self, learner: Any) -> None:
        """Loads the checkpoint's learner state into `learner` (whose policy was built from the
        checkpoint's weights) and marks it resumed."""
        if self.checkpoint is not None:
            import torch   # only here: the rest of this module needs no torch
            learner.restore(torch.load(os.path.join(self.checkpoint, LEARNER_STATE_FILE),
                                       weights_only=False))
        elif self.replay:
            learner.resumed_from = 0
        if self.resuming:
            logging.info("learner: resumed from %s (version %d); redoing %d journalled rollouts",
                         self.checkpoint or "the initial weights", learner.version,
                         sum(len(r) for r in self.replay))


# --- checkpoint folders -------------------------------------------------------------------------
def checkpoint_path(checkpoint_root: str, step: int) -> str:
    return os.path.join(checkpoint_root, f"step_{step:06d}")


def latest_checkpoint(checkpoint_root: str) -> Tuple[Optional[str], int]:
    """(path, step) of the newest complete learner checkpoint, or (None, 0)."""
    best: Tuple[Optional[str], int] = (None, 0)
    if not os.path.isdir(checkpoint_root):
        return best
    for name in os.listdir(checkpoint_root):
        m = _CHECKPOINT_RE.match(name)
        path = os.path.join(checkpoint_root, name)
        if m and os.path.exists(os.path.join(path, LEARNER_STATE_FILE)) and \
                int(m.group(1)) >= best[1]:
            best = (path, int(m.group(1)))
    return best


def prune_checkpoints(checkpoint_root: str, keep: int) -> None:
    """Deletes all but the newest `keep` complete checkpoints (keep=0: none deleted) and any
    unfinished temporary folders."""
    steps = []
    for name in os.listdir(checkpoint_root):
        path = os.path.join(checkpoint_root, name)
        if name.startswith("step_") and ".tmp" in name:
            shutil.rmtree(path, ignore_errors=True)
            continue
        m = _CHECKPOINT_RE.match(name)
        if m:
            steps.append(int(m.group(1)))
    if keep > 0:
        for step in sorted(steps)[:-keep]:
            shutil.rmtree(checkpoint_path(checkpoint_root, step), ignore_errors=True)
