"""A shared-memory Publish at the variable server: its checks, and the server's copy of the file.

A shared-memory publish (shm.py) is one chunk naming a file on the server's host instead of
carrying bytes. `check_shm_chunk` checks the chunk, `open_shm_source` opens and locks the file
(shm_reader.ShmSource), `check_layout` runs the validator's header checks on it.
variables/store.py then makes the version visible and keeps a `ShmCopy`: the open file until a
gRPC client first needs the bytes, then the server's copy of them as it progresses, which
FetchWeights streams chunk by chunk as the copy passes it.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import grpc

from sao_actor_learner.variables.rpc import Abort
from sao_actor_learner.variables.shm_reader import ShmSource

_INVALID = grpc.StatusCode.INVALID_ARGUMENT


def check_shm_chunk(chunk, data: memoryview, extra: int, shm_root: Optional[str],
                    max_payload_bytes: int, what: str) -> None:
    """Abort unless the server takes shared-memory publishes (`shm_root`) and `chunk` (with
    `data` and `extra` chunks after it) is a well-formed one; `what` names it in the message."""
    version, size = chunk.version, chunk.total_bytes
    if shm_root is None:
        raise Abort(grpc.StatusCode.UNIMPLEMENTED, f"{what}: this server takes no "
                    "shared-memory publishes; stream the payload instead")
    if extra or data.nbytes or not chunk.last or not chunk.HasField("crc32"):
        raise Abort(_INVALID, f"{what}: a shared-memory publish is one chunk with last=true, "
                    "crc32 and no data")
    if version < 0 or chunk.dropped_total < 0:
        raise Abort(_INVALID, f"{what}: version and dropped_total must be >= 0")
    if not 0 < size <= max_payload_bytes:
        raise Abort(_INVALID if size <= 0 else grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{what}: total_bytes={size} must be in [1, max_payload_bytes="
                    f"{max_payload_bytes}]")


def open_shm_source(path: str, size: int, shm_root: str, what: str) -> ShmSource:
    """The file of a shared-memory publish, opened and locked; Abort when it is not one the
    server may read (INVALID_ARGUMENT) or cannot be read on this host (UNIMPLEMENTED)."""
    try:
        return ShmSource(path, size, shm_root)
    except ValueError as e:
        raise Abort(_INVALID, f"{what}: {e}") from None
    except OSError as e:                              # e.g. the publisher is on another host
        raise Abort(grpc.StatusCode.UNIMPLEMENTED, f"{what}: the file cannot be read on "
                    f"the server's host ({e}); stream the payload instead") from None


def check_layout(source: ShmSource, validate_layout: Callable[[int, memoryview, str], None],
                 version: int, fmt: str, what: str) -> None:
    """Runs `validate_layout(version, header, fmt)` on the file's header pages; Abort naming
    the ValueError it raised."""
    view, mapping = source.header_view()   # reads the header's pages only
    problem = ""
    try:
        validate_layout(version, view, fmt)
    except ValueError as e:
        problem = str(e)
    finally:
        view.release()
        try:
            mapping.close()
        except BufferError:    # a view outlives the call: unmapped when it goes
            pass
    if problem:
        raise Abort(_INVALID, f"{what}: payload rejected: {problem}; the version "
                    "was discarded")


class ShmCopy:
    """The server's copy of a shared-memory version: the open, locked file until a gRPC client
    first needs the bytes, then how far the copy got, and its error once it failed.
    FetchWeights streams what is copied (`wait_for`)."""

    def __init__(self, size: int, source: ShmSource):
        self.size = size
        self.source = source
        self.started = False     # set, under the store's lock, by the one who starts the copy
        self.buf: Optional[bytearray] = None
        self.copied = 0
        self.error = ""
        self.done = False
        self._cond = threading.Condition()

    def start(self, buf: bytearray) -> None:
        with self._cond:
            self.buf = buf

    def advance(self, copied: int) -> None:
        with self._cond:
            self.copied = copied
            self._cond.notify_all()

    def finish(self, error: str = "") -> None:
        with self._cond:
            self.error, self.done = error, True
            self._cond.notify_all()

    def wait_for(self, end: int, timeout_s: float) -> memoryview:
        """A view of the buffer once its first `end` bytes are copied; Abort (UNAVAILABLE) when
        the copy failed or took longer than `timeout_s`."""
        with self._cond:
            self._cond.wait_for(lambda: self.copied >= end or self.error, timeout_s)
            if self.error or self.copied < end:
                raise Abort(grpc.StatusCode.UNAVAILABLE,
                            f"FetchWeights: the server's copy of a shared-memory version "
                            f"failed ({self.error or 'timed out'}); ask again for the newest")
            return memoryview(self.buf).toreadonly()

    def wait_done(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.done, timeout_s)
