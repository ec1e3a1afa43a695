"""The reading side of shared-memory weights (shm.py writes them): an actor's ShmReader maps a
version's file, locks it against reuse and checks its CRC-32 before handing it out; the variable
server's ShmSource holds a published file until it has copied it for gRPC clients.

No grpc, protobuf or torch import here.
"""
from __future__ import annotations

import collections
import fcntl
import mmap
import os
import sys
import threading
from typing import Optional, Tuple

import numpy as np

from sao_actor_learner.variables import wire
from sao_actor_learner.variables.shm import COPY_CHUNK_BYTES, SUFFIX

# madvise(MADV_POPULATE_READ) (Linux 5.14): fills a mapping's page tables in one call, read-only,
# without copying private pages. Older kernels refuse it; then pages fault in on first access.
try:
    _MADV_POPULATE_READ = mmap.MADV_POPULATE_READ   # Python >= 3.12 names it
except AttributeError:
    _MADV_POPULATE_READ = 22                        # its value in linux/mman.h
# sys.getrefcount(entry.array) of an array only its cache entry references: the attribute + the
# argument.
_REFS_WHEN_UNUSED = 2


# ------------------------------------------------------------------------------ reader

class _Mapping:
    """A reader's mapping of one file (one inode): private copy-on-write, so tensors viewing it
    behave as ordinary memory for this process and a stray write never reaches the file; pages
    never written show what the writer writes later (Linux)."""

    def __init__(self, fd: int, size: int, key: Tuple[int, int]):
        self.fd, self.size, self.key = fd, size, key
        self.mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            self.mm.madvise(_MADV_POPULATE_READ)
        except (OSError, ValueError, AttributeError):
            pass
        self.array = np.frombuffer(self.mm, dtype=np.uint8)   # what readers are handed
        self.locked = False

    def unused(self) -> bool:
        """Nothing but this mapping references the array (no caller, no view of it, no tensor):
        exact in CPython, as in buffers.BufferPool."""
        return sys.getrefcount(self.array) == _REFS_WHEN_UNUSED

    def lock(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.locked = True
        return True

    def unlock(self) -> None:
        if self.locked:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.locked = False

    def linked(self) -> bool:
        try:
            return os.fstat(self.fd).st_nlink > 0
        except OSError:
            return False

    def close(self) -> None:
        self.unlock()
        del self.array
        self.mm.close()
        os.close(self.fd)


class ShmReader:
    """Loads versions from shared-memory files for one process (the actor's VariableClient).

    `load(path, size, crc32)` returns a read-write numpy uint8 array of the payload (copy-on-write
    over the file: see _Mapping), or None and why not: "missing" (no such file here), "replaced"
    (the file was reused for a newer version before it could be locked), "size", "corrupt" (CRC
    mismatch) or "unreadable". The array stays valid, and its version's file is not reused, while
    anything in this process references it (or a view of it); `release_unused()` lets the writer
    reuse files nothing references any more. Mappings are kept per inode (at most `max_mappings`)
    and reused when the writer reuses their file, so a version costs no page faults. Thread-safe.
    """

    def __init__(self, max_mappings: int = 8):
        self._max = max_mappings
        self._mappings: "collections.OrderedDict[Tuple[int, int], _Mapping]" = \
            collections.OrderedDict()
        self._lock = threading.Lock()

    def load(self, path: str, size: int, crc32: int) -> Tuple[Optional[np.ndarray], str]:
        with self._lock:
            payload, why = self._load(path, size, crc32, reuse=True)
            if why == "corrupt":
                # A page this process wrote into stays private: map the file afresh, once.
                payload, why = self._load(path, size, crc32, reuse=False)
            return payload, why

    def _load(self, path: str, size: int, crc32: int,
              reuse: bool) -> Tuple[Optional[np.ndarray], str]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None, "missing"
        except OSError:
            return None, "unreadable"
        try:
            st = os.fstat(fd)
            if st.st_size != size or size <= 0:
                return None, "size"
            key = (st.st_dev, st.st_ino)
            mapping = self._mappings.get(key)
            if mapping is not None and (not reuse or mapping.size != size):
                if not mapping.unused():
                    return None, "corrupt" if not reuse else "size"
                self._drop(mapping)
                mapping = None
            if mapping is None:
                mapping = _Mapping(fd, size, key)
                fd = -1                                 # the mapping owns it now
                self._mappings[key] = mapping
            self._mappings.move_to_end(key)
            was_locked = mapping.locked
            if not mapping.lock():
                return None, "replaced"                 # the writer is rewriting it
            try:
                now = os.stat(path)
                same = (now.st_dev, now.st_ino) == key
            except OSError:
                same = False
            if not same:                                # reused before we locked it
                if not was_locked and mapping.unused():
                    mapping.unlock()
                return None, "replaced"
            if wire.parallel_crc32(mapping.array) != crc32:
                if not was_locked and mapping.unused():
                    mapping.unlock()
                return None, "corrupt"
            return mapping.array, ""
        except OSError:
            return None, "unreadable"
        finally:
            if fd >= 0:
                os.close(fd)
            self._trim()

    def release_unused(self) -> None:
        """Unlocks the files of versions nothing in this process references (the writer may
        reuse them), and unmaps those of deleted files."""
        with self._lock:
            for mapping in list(self._mappings.values()):
                if mapping.unused():
                    mapping.unlock()
                    if not mapping.linked():
                        self._drop(mapping)
            self._trim()

    def _trim(self) -> None:
        for mapping in list(self._mappings.values()):
            if len(self._mappings) <= self._max:
                break
            if mapping.unused():
                self._drop(mapping)

    def _drop(self, mapping: _Mapping) -> None:
        self._mappings.pop(mapping.key, None)
        mapping.close()

    @property
    def mapped(self) -> int:
        with self._lock:
            return len(self._mappings)

    @property
    def locked(self) -> int:
        with self._lock:
            return sum(m.locked for m in self._mappings.values())

    def close(self) -> None:
        """Unmaps what nothing references; the rest is unmapped when its last reference goes."""
        with self._lock:
            for mapping in list(self._mappings.values()):
                if mapping.unused():
                    self._drop(mapping)
                else:                       # lets the writer reuse the file; the array keeps
                    mapping.unlock()        # the mapping (and its own dup of the fd)
                    os.close(mapping.fd)
            self._mappings.clear()


# ------------------------------------------------------------------------------ the server's copy

class ShmSource:
    """The variable server's hold on a published file: opened and locked LOCK_SH (so it is not
    reused) from the Publish until `read_into` has copied it, which works even after the writer
    unlinked it (the open file keeps it)."""

    def __init__(self, path: str, size: int, allowed_root: str):
        real = os.path.realpath(path)
        root = os.path.realpath(allowed_root)
        if not os.path.isabs(path) or os.path.commonpath([real, root]) != root or \
                not real.endswith(SUFFIX):
            raise ValueError(f"shm_path {path!r}: must be a {SUFFIX} file under {allowed_root}")
        self.path, self.size = path, size
        self.fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(self.fd)
            if st.st_size != size:
                raise ValueError(f"shm_path {path!r} has {st.st_size} bytes, the publish says "
                                 f"{size}")
            try:
                fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ValueError(f"shm_path {path!r} is being rewritten (LOCK_EX held): "
                                 "publish each version's file only once it is whole") from None
        except BaseException:
            os.close(self.fd)
            raise

    def header_view(self) -> Tuple[memoryview, mmap.mmap]:
        """A read-only view of the whole file (a mapping: only the pages read are touched) and
        the mapping, for the caller to release and close."""
        mm = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        return memoryview(mm), mm

    def read_into(self, buf, crc32: int, chunk_bytes: int = COPY_CHUNK_BYTES,
                  progress=None) -> None:
        """Copies the file into `buf` (a writable bytes-like of `size` bytes) and checks its
        CRC-32; ValueError on a mismatch or a short read. `progress(bytes copied)` is called
        after each chunk."""
        view = memoryview(buf).cast("B")
        crc, offset = 0, 0
        while offset < self.size:
            n = os.preadv(self.fd, [view[offset:min(offset + chunk_bytes, self.size)]], offset)
            if n <= 0:
                raise ValueError(f"{self.path}: read {offset} of {self.size} bytes")
            crc = wire.crc32(view[offset:offset + n], crc)
            offset += n
            if progress is not None:
                progress(offset)
        if crc != crc32:
            raise ValueError(f"{self.path}: CRC-32 {crc:#010x}, the publish says {crc32:#010x}; "
                             "the file is corrupt")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)       # releases the lock
            self.fd = -1
