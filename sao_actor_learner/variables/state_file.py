"""A small JSON state file, replaced atomically on every change.

`save` writes the whole state to `<path>.tmp`, fsyncs it (unless fsync=False) and renames it
over `path` (os.replace), so the file always holds one complete state, the old or the new one.
A process killed at any moment (SIGKILL included) loses nothing that `save` returned for. With
fsync, a machine that dies loses at most the last save: on a journaling file system (ext4, xfs)
the rename is committed with the next save's fsync at the latest. Without fsync the page cache
holds the writes until the kernel flushes them.

Writers that race are group-committed: each `save` passes the sequence number its state was
taken at, and a save whose state a newer written one already covers returns at once.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Optional


class StateFile:
    """The state file at `path` (its folder is made if missing)."""

    def __init__(self, path: str, fsync: bool = True):
        self.path = os.path.abspath(path)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.fsync = fsync
        self._lock = threading.Lock()
        self._written = -1
        self.writes = 0

    def load(self) -> Optional[dict]:
        """The saved state, or None when the file does not exist. ValueError if it is not one
        (the message says to move it away to start from zero)."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            state = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"state file {self.path} is not JSON ({e}); it was not written by "
                             "StateFile.save. Move it away to start from zero counters") from None
        if not isinstance(state, dict):
            raise ValueError(f"state file {self.path} holds a {type(state).__name__}, not an "
                             "object; move it away to start from zero counters")
        return state

    def save(self, seq: int, text: str) -> None:
        """Writes `text`, the state as of sequence number `seq`, unless a state with a larger
        `seq` was written already (it includes this one). Returns once the file holds it.
        Raises OSError."""
        with self._lock:
            if seq <= self._written:
                return
            tmp = self.path + ".tmp"
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(text)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self.path)
            self._written = seq
            self.writes += 1
