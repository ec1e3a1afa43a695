"""An actor's spool: every completed rollout kept on disk until the learner acknowledges it.

End to end: an actor writes each completed (and valid) rollout here before it sends it, under a
sequence number `seq` that names it from then on ((actor_id, seq) is the rollout's key); sends
it to replay (`sent`, with the learner's loss epoch at that moment); and forgets it only when
the learner's progress report says it was consumed for good, trained or dropped as too stale
(`acknowledge`). When the learner reports a new loss epoch (it restarted, or replay did: what
was in transit or queued may be gone), `to_resend` lists every spooled rollout sent in an
earlier epoch, and the actor sends them again; copies that did arrive are skipped by the
learner (it trains each key once). A restarted actor sends what it finds here that was never
sent, and once more what its previous incarnation had sent but the learner has not yet
acknowledged: the actor's writer confirms each batch while it sends the next (replay/writer.py,
pipelined), so the last batch sent before a SIGKILL may never have reached replay (copies that
did are skipped by the learner). So replay, the learner, the variable server and the actor
itself can each die at any moment without a completed rollout being lost or trained twice.

Folder layout (`<run_dir>/spool/actor_<id>/`):
  <seq>.rollout  one rollout not yet acknowledged (safe_records' format, which never runs code
               when read; written to a temporary name, then renamed). A spool with
               `<seq>.pkl` files (pickled by earlier versions) is refused, never unpickled.
  ledger.log   one line per event, appended with a single write:
                 "put SEQ"          completed and kept
                 "sent SEQ EPOCH"   handed to replay in loss epoch EPOCH
                 "ack SEQ"          acknowledged by the learner: forgotten
                 "rej 0 REASON"     refused by validation before it was spooled (no seq)
               and for admission control "ask K" (about to ask for K rollouts), "adm G" (G
               granted), "rel R" (R slots returned). Its counts are the actor's durable
               counters.

Admission slots: a rollout admitted but never spooled (refused by validation, or lost in
generation when the actor died) would hold its slot for ever; `owed_releases()` is what a
(restarted) actor owes back: admitted, minus spooled, minus already returned (what is left was
refused or lost in generation); an "ask" whose answer never reached the ledger counts as granted
(returning a slot too many only loosens admission).

Crash points: before the rename nothing was completed (the temporary file is deleted at the next
start); between the rename and "put" the start-up scan adds the "put"; a "sent" line lost makes
the restarted actor send it again (a copy the learner skips); an acknowledged rollout whose file
outlived the crash is deleted at the start. Plain files, no fsync: a process crash loses nothing
written; a machine crash may.

Bounded: the ledger is compacted when the spool starts and whenever it has grown enough since
(ledger.py: the same counts and sets in O(held) lines), so it never holds a line per rollout
ever made. A write that fails (ENOSPC: a full disk) raises `SpoolWriteError` naming the file:
a rollout whose file or "put" line was not written is never sent, and after a failed ledger
line the spool takes no more (a line after a torn one could be misread); the actor stops, and
its restart finds every rollout it had kept.
"""
from __future__ import annotations

import collections
import errno
import os
import threading
from typing import Dict, List, Optional, Tuple

from absl import logging

from sao_actor_learner import safe_records
from sao_actor_learner.actors.ledger import (  # noqa: F401 (LEDGER, read_ledger: re-exported)
    COMPACT_MIN_BYTES, LEDGER, OLD_PENDING_RE, PENDING_RE, read_ledger, write_compacted)
from sao_actor_learner.types import Rollout


class SpoolWriteError(OSError):
    """A spool file or ledger line could not be written (e.g. ENOSPC); the message names it."""


def spool_dir(run_dir: str, actor_id: int) -> str:
    """Where actor `actor_id` of a run keeps its spool."""
    return os.path.join(run_dir, "spool", f"actor_{actor_id}")


class RolloutSpool:
    """The on-disk spool of one actor (see the module docstring). Not shared between processes:
    one actor process per folder at a time. Thread-safe."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.ledger_path = os.path.join(directory, LEDGER)
        os.makedirs(directory, exist_ok=True)
        self._lock = threading.Lock()
        self._ledger_lock = threading.Lock()     # ledger appends and compaction
        self._ledger: Optional[int] = None
        self._failed: Optional[SpoolWriteError] = None
        self.compactions = 0
        for name in os.listdir(directory):
            if OLD_PENDING_RE.match(name):
                raise RuntimeError(
                    f"actor spool {directory}: {name} (and maybe more) is a rollout pickled by "
                    "an earlier version; it is not read, since unpickling a copied or changed "
                    "file can run code. Resume with the version that wrote it, or start a "
                    "fresh run (without --resume; its rollouts are then lost)")
            if name.endswith(".tmp"):
                os.remove(os.path.join(directory, name))       # never completed
        state = read_ledger(directory)
        self._admitted, self._released = state["admitted"], state["released"]
        self._refused = collections.Counter(state["refused"])
        self._acked = len(state["acked"])
        self._sent_epoch: Dict[int, int] = {}     # held seq -> epoch it was last sent in
        # Held seqs a previous incarnation sent: maybe still unconfirmed when it died (to_send).
        self._sent_before_restart: set = set()
        files = {int(m.group(1)) for name in os.listdir(directory)
                 if (m := PENDING_RE.match(name))}
        for seq in files & state["acked"]:
            os.remove(self._path(seq))   # acknowledged before the crash; the file outlived it
        for seq in sorted(state["held"]):   # (a held seq without "put": compaction adds it)
            self._sent_epoch[seq] = state["sent"].get(seq, -1)   # -1: never sent
            if self._sent_epoch[seq] >= 0:
                self._sent_before_restart.add(seq)
        self._completed = len(state["completed"])
        self._sent_once = state["sent_once"]
        self._next_seq = max(state["completed"]) + 1 if state["completed"] else 0
        with self._ledger_lock:
            if os.path.exists(self.ledger_path) and os.path.getsize(self.ledger_path):
                self._compact_locked()   # a restart: compacted, and opened for appending
            else:
                self._ledger = os.open(self.ledger_path,
                                       os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                self._appended, self._compact_at = 0, COMPACT_MIN_BYTES

    # --- counters -----------------------------------------------------------------------------
    @property
    def completed(self) -> int:
        """Rollouts ever spooled (this run, all incarnations of the actor)."""
        return self._completed

    @property
    def sent_once(self) -> int:
        """Rollouts handed to replay at least once."""
        return self._sent_once

    @property
    def acknowledged(self) -> int:
        """Rollouts the learner acknowledged (forgotten here)."""
        return self._acked

    @property
    def held(self) -> int:
        """Rollouts kept, not yet acknowledged."""
        with self._lock:
            return len(self._sent_epoch)

    @property
    def refused(self) -> Dict[str, int]:
        """Rollouts refused by validation before spooling, by reason."""
        return dict(self._refused)

    def owed_releases(self) -> int:
        """Admission slots to return: admitted, minus spooled (a spooled rollout reaches the
        learner, which credits it if it drops it), minus returned. What is left was refused by
        validation or lost in generation by a crashed incarnation."""
        with self._lock:
            return max(0, self._admitted - self._completed - self._released)

    # --- admission ------------------------------------------------------------------------------
    def asking(self, count: int) -> None:
        """About to ask admission for `count` rollouts."""
        self._append(f"ask {int(count)}")

    def admitted(self, granted: int) -> None:
        """Admission granted `granted` rollouts (0 included: it answers the "ask")."""
        self._append(f"adm {int(granted)}")
        with self._lock:
            self._admitted += int(granted)

    def released(self, count: int) -> None:
        """`count` slots were returned to the variable server."""
        if count:
            self._append(f"rel {int(count)}")
            with self._lock:
                self._released += int(count)

    # --- rollouts -------------------------------------------------------------------------------
    def put(self, rollout) -> int:
        """Keeps a completed rollout; sets and returns its sequence number `rollout.seq`."""
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
        rollout.seq = seq
        path = self._path(seq)
        tmp = path + ".tmp"
        if self._failed is not None:
            raise self._failed
        try:
            with open(tmp, "wb") as f:
                f.write(safe_records.dumps(rollout))
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise SpoolWriteError(
                e.errno, f"spool file {path}: the rollout could not be written ({e}); it was "
                "not kept and is not sent. Free space on that disk (or put --run_dir on "
                "another) and restart the actor") from e
        self._append(f"put {seq}")
        with self._lock:
            self._completed += 1
            self._sent_epoch[seq] = -1
        return seq

    def refuse(self, reason: str) -> None:
        """Validation refused a rollout before it was spooled (its slot is owed back)."""
        self._append(f"rej 0 {reason.replace(' ', '_')}")
        with self._lock:
            self._refused[reason] += 1

    def sent(self, seqs: List[int], epoch: int) -> int:
        """`seqs` were handed to replay in loss epoch `epoch`; returns how many of them were
        sent for the first time."""
        if not seqs:
            return 0
        self._append("\n".join(f"sent {s} {int(epoch)}" for s in seqs))
        first = 0
        with self._lock:
            for s in seqs:
                if s in self._sent_epoch:
                    first += self._sent_epoch[s] < 0
                    self._sent_epoch[s] = int(epoch)
                self._sent_before_restart.discard(s)
            self._sent_once += first
        return first

    def acknowledge(self, consumed) -> int:
        """Forgets every held rollout `consumed(seq)` says the learner consumed for good;
        returns how many."""
        with self._lock:
            done = [s for s in self._sent_epoch if consumed(s)]
            for s in done:
                del self._sent_epoch[s]
                self._sent_before_restart.discard(s)
            self._acked += len(done)
        if done:
            self._append("\n".join(f"ack {s}" for s in sorted(done)))
            for s in done:
                try:
                    os.remove(self._path(s))
                except FileNotFoundError:
                    pass
        return len(done)

    def to_send(self, epoch: int) -> List[Tuple[int, object]]:
        """(seq, rollout) of every held rollout never sent, sent in a loss epoch before `epoch`,
        or sent by a previous incarnation of the actor and not sent since, oldest first
        (unreadable files are logged and skipped)."""
        with self._lock:
            seqs = sorted(s for s, e in self._sent_epoch.items()
                          if e < epoch or s in self._sent_before_restart)
        out = []
        for seq in seqs:
            rollout = self.load(seq)
            if rollout is not None:
                out.append((seq, rollout))
        return out

    def load(self, seq: int):
        path = self._path(seq)
        try:
            with open(path, "rb") as f:
                rollout = safe_records.loads(f.read())
            if not isinstance(rollout, Rollout):
                raise safe_records.UnsafeRecordError(f"holds a {type(rollout).__name__}")
        except Exception as e:  # noqa: BLE001 - a damaged file: keep it, say so
            logging.warning("RolloutSpool: %s is unreadable (%s); not sent", path, e)
            return None
        rollout.seq = seq
        return rollout

    def close(self) -> None:
        with self._ledger_lock:
            if self._ledger is not None:
                os.close(self._ledger)
                self._ledger = None

    def _path(self, seq: int) -> str:
        return os.path.join(self.directory, f"{seq:012d}.rollout")

    def _append(self, line: str) -> None:
        """Appends `line` to the ledger in one write; compacts it when it has grown enough.
        Raises SpoolWriteError when the line (or a compaction) is not written whole, and for
        every line after that."""
        data = (line + "\n").encode()
        with self._ledger_lock:
            if self._failed is not None:
                raise self._failed
            try:
                view = memoryview(data)
                while view:   # a short write (a full disk) is followed up: its error, or the rest
                    written = os.write(self._ledger, view)
                    if not written:
                        raise OSError(errno.EIO, f"wrote nothing of {len(view)} bytes")
                    view = view[written:]
            except OSError as e:
                self._failed = SpoolWriteError(
                    e.errno, f"spool ledger {self.ledger_path}: a line could not be written "
                    f"({e}); the spool takes no more and the actor stops. Free space on that "
                    "disk (or put --run_dir on another) and restart it: the rollouts kept in "
                    f"{self.directory} are sent again then")
                raise self._failed from e
            self._appended += len(data)
            if self._appended >= self._compact_at:
                self._compact_locked()

    def _compact_locked(self) -> None:
        """Rewrites the ledger compacted (ledger.py) and reopens it (needs the ledger lock)."""
        try:
            size = write_compacted(self.directory)
            fd = os.open(self.ledger_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            self._failed = SpoolWriteError(
                e.errno, f"spool ledger {self.ledger_path}: could not be compacted ({e}); the "
                "spool takes no more and the actor stops. Free space on that disk (or put "
                "--run_dir on another) and restart it")
            raise self._failed from e
        old, self._ledger = self._ledger, fd
        if old is not None:
            os.close(old)
        self.compactions += 1
        self._appended = 0
        self._compact_at = max(COMPACT_MIN_BYTES, 2 * size)
