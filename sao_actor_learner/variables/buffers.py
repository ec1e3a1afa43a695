"""Receive buffers for payloads of up to gigabytes, reused once nothing references them.

The first write to freshly allocated memory costs a page fault per 4 KiB page: several times
the copy itself (docs/FACTS.md; BENCHMARKS.md section 4).
Every new policy version has the same size, so the variable server and its clients keep the
buffer of a version they dropped and assemble a later version into it, but only when nothing
references it any more: no caller holds the bytes, and no memoryview, numpy array or tensor
views them (each of those holds a reference to the bytearray). In CPython that is exact: the
reference count of a buffer in the pool is then 2 (the pool's list and `sys.getrefcount`'s
argument), and nothing can make a new reference without an existing one.

No grpc, protobuf or torch import here.
"""
from __future__ import annotations

import sys
import threading
from typing import List, Optional

# sys.getrefcount(spares[i]) of a buffer held only by the pool: the list slot + the argument.
_REFS_WHEN_ONLY_POOLED = 2


class BufferPool:
    """Keeps up to `max_spares` dropped payload buffers for reuse. Thread-safe."""

    def __init__(self, max_spares: int = 1):
        if max_spares < 0:
            raise ValueError(f"max_spares={max_spares}: must be >= 0 (0 disables reuse)")
        self._max_spares = max_spares
        self._spares: List[bytearray] = []
        self._lock = threading.Lock()
        self.reused = 0          # take() calls answered with a spare

    def give(self, buf) -> None:
        """Offers `buf` (a bytearray the owner no longer holds) for reuse; others may still
        reference it: take() only hands it out once they no longer do."""
        if not isinstance(buf, bytearray) or not buf or not self._max_spares:
            return
        with self._lock:
            if any(spare is buf for spare in self._spares):
                return
            self._spares.append(buf)
            del self._spares[:-self._max_spares]   # keep the newest

    def take(self, size: int) -> Optional[bytearray]:
        """A spare of exactly `size` bytes that nothing else references (removed from the
        pool), or None. Its old contents are still there: the caller overwrites all of it."""
        with self._lock:
            for i in range(len(self._spares)):
                if (len(self._spares[i]) == size
                        and sys.getrefcount(self._spares[i]) == _REFS_WHEN_ONLY_POOLED):
                    self.reused += 1
                    return self._spares.pop(i)
        return None


class PayloadAssembler:
    """Collects one payload, chunk by chunk in order, into a pooled buffer of the announced size,
    or else into a new bytearray that grows as data arrives (so a false size claim allocates
    nothing up front). The caller checks that no chunk goes past `total`."""

    def __init__(self, total: int, pool: Optional[BufferPool]):
        self.total = total
        spare = pool.take(total) if pool is not None and total > 0 else None
        self._in_place = spare is not None
        self._buf = spare if spare is not None else bytearray()
        self.received = 0

    def add(self, data) -> None:
        """Appends `data` (a bytes-like)."""
        n = len(data) if isinstance(data, (bytes, bytearray)) else memoryview(data).nbytes
        end = self.received + n
        if end > self.total:
            raise ValueError(f"{end} bytes received, more than the announced {self.total}")
        if self._in_place:
            self._buf[self.received:end] = data
        else:
            self._buf += data
        self.received = end

    def payload(self) -> bytearray:
        """The assembled bytes (all `total` of them once `received == total`)."""
        return self._buf
