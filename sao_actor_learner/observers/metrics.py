"""metrics.jsonl and the experiment trackers (TensorBoard, W&B, MLflow), written side by side.

Several processes (learner, evaluator) append to the same metrics.jsonl: each row is one
`os.write` of one line on an O_APPEND descriptor, which Linux keeps whole for regular files.
Rows carry a `kind`: "train" (one per learner step), "eval" (evaluations) or "value_pretrain".
Each row then goes to the process's experiment trackers (TensorBoard, W&B, MLflow:
observers/trackers.py), each fed from a thread of its own, so none holds up or stops the writer.

Bounded: once metrics.jsonl holds `max_bytes` (MAX_METRICS_BYTES, 256 MiB by default), the
writer that sees it renames it to metrics.jsonl.1 (replacing the one before, under an flock so
two writers do not both rotate) and starts a new file; every writer notices the rename at its
next row (the path names another inode) and reopens. So the two files hold at most about
2 * max_bytes, the newest rows; `read_metrics` reads both, older first.

Not fatal: a row that cannot be written (a full disk, ENOSPC) is logged (at most once a minute,
naming the file) and counted (`write_failures`), and the caller goes on: losing a metrics row
must not stop training. A row a full disk tore (a short write) is ended by the next row written,
which then starts with a newline, so only the torn row is lost. Tracker failures are counted
and logged by their feeds (observers/trackers.TrackerFeed).
"""
from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import time
from typing import Dict, Iterator, List, Optional, Sequence

from absl import logging

MAX_METRICS_BYTES = 256 << 20
ROTATED_SUFFIX = ".1"


def _jsonable(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsLogger:
    """Appends JSON rows to `<run_dir>/metrics.jsonl` and hands their scalars to trackers.

    role: the writing process's role (learner, evaluator); TensorBoard writes <run_dir>/tb/<role>.
    trackers: the TrackerFeeds to feed (observers/trackers.make_tracker_feeds, from --tracker);
      None: TensorBoard alone when a role is given (the default of --tracker), else none.
    max_bytes: metrics.jsonl is rotated to metrics.jsonl.1 beyond this size (module docstring).
    """

    def __init__(self, run_dir: str, role: Optional[str] = "learner",
                 default_kind: str = "train", max_bytes: int = MAX_METRICS_BYTES,
                 trackers: Optional[Sequence] = None):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.max_bytes = max_bytes
        self.write_failures = 0          # rows that could not be written
        self.rotations = 0
        self._fd: Optional[int] = None
        self._reopen()
        self._kind = default_kind
        if trackers is None and role:
            from sao_actor_learner.observers.trackers import TensorBoardTracker, TrackerFeed
            log_dir = os.path.join(run_dir, "tb", role)
            trackers = [TrackerFeed("tensorboard", lambda: TensorBoardTracker(log_dir))]
        self.trackers = list(trackers or ())

    def write(self, row: Dict) -> None:
        row = {"kind": self._kind, "time": time.time(), **row}
        row = {k: (_jsonable(v) if not isinstance(v, list) else [_jsonable(x) for x in v])
               for k, v in row.items()}
        data = (json.dumps(row) + "\n").encode()
        try:
            self._follow_rotation()
            size = os.fstat(self._fd).st_size
            if size and os.pread(self._fd, 1, size - 1) != b"\n":
                data = b"\n" + data   # after a row torn by a full disk: not glued to it
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(errno.EIO, f"short write: {written} of {len(data)} bytes")
            if self.max_bytes > 0 and os.fstat(self._fd).st_size >= self.max_bytes:
                self._rotate()
        except OSError as e:
            self._failed(self.path, e)
        if self.trackers:   # queued: a tracker's failure or delay never reaches the caller
            from sao_actor_learner.observers.trackers import row_scalars
            kind, scalars, step = row_scalars(row)
            for tracker in self.trackers:
                tracker.log_scalars(kind, scalars, step)

    def _failed(self, what: str, error: BaseException) -> None:
        self.write_failures += 1
        logging.log_every_n_seconds(
            logging.ERROR, "metrics: could not write to %s (%s); %d writes lost so far, going "
            "on without them (free space there to get metrics back)", 60, what, error,
            self.write_failures)

    def _reopen(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        old, self._fd = self._fd, fd
        if old is not None:
            os.close(old)

    def _follow_rotation(self) -> None:
        """Reopens metrics.jsonl when another writer rotated it (the path names a new file)."""
        try:
            moved = os.stat(self.path).st_ino != os.fstat(self._fd).st_ino
        except FileNotFoundError:
            moved = True
        if moved:
            self._reopen()

    def _rotate(self) -> None:
        """metrics.jsonl -> metrics.jsonl.1, unless another writer rotated it first."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                os.replace(self.path, self.path + ROTATED_SUFFIX)
                self.rotations += 1
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._reopen()

    def close(self) -> None:
        """Closes the trackers (once they have logged every row written) and the file."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_metrics(run_dir: str, kind: Optional[str] = None) -> List[Dict]:
    """All rows of `<run_dir>/metrics.jsonl` (optionally of one kind), after those of its
    rotated part metrics.jsonl.1 when there is one; skips torn lines."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = []
    for part in (path + ROTATED_SUFFIX, path):
        if not os.path.exists(part):
            continue
        with open(part) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if kind is None or row.get("kind") == kind:
                    rows.append(row)
    return rows


def write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
    os.replace(tmp, path)

