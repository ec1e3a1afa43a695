"""Policy versions through shared memory, for readers on the publisher's host.

The learner's publisher writes each version once, as a safetensors file, into a directory of its
own under /dev/shm; the variable server, told the file's path, size and CRC-32 (a one-message
Publish), checks its header and makes the version visible; actors on the same host map the file
instead of streaming it over gRPC. The server also reads the file into its own memory (in the
background, CRC-checked) to serve FetchWeights, so remote actors, and local ones whose file is
missing or corrupt, keep the gRPC path. docs/DESIGN.md, section 6 "Shared memory on one host",
says why each piece is there; docs/FACTS.md, "Python and Linux", lists the Linux behaviours
relied on.

Files: the directory layout, its owner file and the sweep of dead runs' directories are in
variables/shm_files.py (its names are importable from here too).

Reuse instead of fresh files. On tmpfs the first write to a page allocates and zeroes it, and a
process's first access to a mapped page is a page fault: both cost several times a warm memcpy
(FACTS.md). So the writer keeps `keep` versions and writes the next one into the file of the
oldest (renamed to the new temporary name first), through a mapping it keeps, and readers keep
their mappings of the files they have seen (by inode): in the steady state a version costs the
writer one copy and a CRC-32 and a reader one CRC-32, with no page faults. A file may be
rewritten only while no reader uses it, which locks arbitrate (flock, per open file):

- a reader holds LOCK_SH on a file from before it checks it until nothing in its process
  references the version any more (`ShmReader.release_unused`, reference counts as in
  buffers.py); it checks, holding the lock, that the version's path still names the inode it
  locked, and then the CRC-32;
- the writer renames the oldest file away (so no new reader finds it), then takes LOCK_EX
  without waiting; if a reader still holds it, the writer unlinks it instead and writes a fresh
  file. Unlinking a mapped file is safe on Linux: the mapping, and the reader's data, stay
  valid until it is unmapped (FACTS.md, Python and Linux).

Checksum: CRC-32 (wire.crc32: ISA-L when installed, the same values as zlib.crc32), computed by
the writer as it copies, chunk by chunk while the chunk is in cache, and checked by every reader
before use. It is the transit check the gRPC path already uses, so the server's record, the
file and a gRPC fetch all carry one checksum; no faster hash is installed (no xxhash); its speed
against a memcpy: BENCHMARKS.md, section 4. The writer also refuses NaN/inf in float tensors as it
copies (security.has_nonfinite, from cache), the check the server makes on gRPC publishes.

Clean-up. `ShmWriter.close()` (also at interpreter exit) removes its directory; the directories
of writers killed before they could are swept by the next writer (shm_files.sweep_dead_runs).

No grpc, protobuf or torch import here.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import errno
import fcntl
import mmap
import os
import queue
import shutil
import threading
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from sao_actor_learner.variables import wire
from sao_actor_learner.variables.security import (PayloadRejected, has_nonfinite,
                                                  safetensors_header)
from sao_actor_learner.variables.shm_files import (
    DEFAULT_SHM_DIR, OWNER_FILE, SUFFIX, TMP_SUFFIX, ShmUnavailable, check_private_root,
    make_run_directory, remove_if_empty, sweep_dead_runs, version_file_name, writer_root)

# The layout's names (shm_files.py) stay importable from here.
__all__ = ["COPY_CHUNK_BYTES", "DEFAULT_SHM_DIR", "OWNER_FILE", "PIPELINE_MIN_BYTES", "SUFFIX",
           "TMP_SUFFIX", "ShmFile", "ShmUnavailable", "ShmWriter", "check_private_root",
           "remove_if_empty", "sweep_dead_runs", "version_file_name", "writer_root"]

# Bytes copied, checksummed and checked for finiteness at a time: small enough to stay in the
# cache between the copy and the two reads after it, large enough that Python's per-chunk cost
# stays small (~1000 chunks per GB).
COPY_CHUNK_BYTES = 1 << 20
# From this size, and only with 4 or more CPUs, the writer's checks run in a helper thread behind
# the copy. With fewer CPUs the thread only competes with the other processes for the same
# cores, so each chunk is checked inline right after its copy.
PIPELINE_MIN_BYTES = (8 << 20) if wire.MANY_CPUS else 1 << 62


@dataclasses.dataclass(frozen=True)
class ShmFile:
    """One version written by ShmWriter: what a Publish announces."""
    version: int
    path: str
    size: int
    crc32: int


# ------------------------------------------------------------------------------ writer

class _WriterFile:
    """One file of the writer: its path now, the writer's fd and writable shared mapping."""

    def __init__(self, path: str, fd: int, size: int):
        self.path, self.fd, self.size = path, fd, size
        self.version = -1
        self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self.mm)

    def close(self) -> None:
        try:
            self.view.release()
            self.mm.close()
        except BufferError:     # a view is still alive (an exception's traceback): unmapped
            pass                # when the last one goes
        os.close(self.fd)


class ShmWriter:
    """Writes policy versions into shared-memory files, keeping the newest `keep` (publisher side).

    Args:
      root: the directory holding the run directories (`writer_root(shm_dir)`); made if missing.
      run_name: the run directory's name starts with it (e.g. the run folder's name).
      keep: versions kept readable (>= 2); the oldest file is reused for the next version once
        no reader holds it. Keep more than the variable server's keep_versions so the versions
        it can still serve by number keep their files.
      check_finite: refuse NaN/inf in BF16/F16/F32/F64 tensors while copying.

    Raises ShmUnavailable when the directory cannot be made. Not thread-safe: one publisher.
    """

    def __init__(self, root: str, run_name: str = "run", keep: int = 3,
                 check_finite: bool = True, chunk_bytes: int = COPY_CHUNK_BYTES):
        if keep < 2:
            raise ValueError(f"keep={keep}: must be >= 2 (a reader of the newest version must "
                             "never race the writer of the next)")
        if chunk_bytes < 8 or chunk_bytes % 8:
            raise ValueError(f"chunk_bytes={chunk_bytes}: must be a positive multiple of 8")
        self.keep = keep
        self.check_finite = check_finite
        self.chunk_bytes = chunk_bytes
        self.root = root
        self.directory, self.swept = make_run_directory(root, run_name)
        self._files: Deque[_WriterFile] = collections.deque()
        self._closed = False
        self.counters: Dict[str, int] = collections.Counter()
        atexit.register(self.close)

    def write(self, version: int, parts: Sequence) -> ShmFile:
        """Writes the payload (the bytes-likes in `parts`, back to back: e.g. the buffers of
        ckpt.state_dict_to_buffers) as `version` and renames it into place; returns what to
        announce. Raises PayloadRejected for NaN/inf (nothing is published), ShmUnavailable when
        /dev/shm has no room (the caller publishes over gRPC instead)."""
        if self._closed:
            raise ShmUnavailable(errno.EBADF, f"ShmWriter({self.directory}) is closed")
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(v.nbytes for v in views)
        if total <= 0:
            raise ValueError("an empty payload cannot be written to shared memory")
        final = os.path.join(self.directory, version_file_name(version))
        target = self._take_file(version, final + TMP_SUFFIX, total)
        try:
            crc = self._fill(target.view, views, total)
            fcntl.flock(target.fd, fcntl.LOCK_UN)   # readers may lock it once it has its name
            os.replace(target.path, final)          # the version's file appears whole
        except BaseException:
            self._discard(target)
            raise
        target.path, target.version = final, version
        self._files.append(target)
        self.counters["written"] += 1
        return ShmFile(version, final, total, crc)

    def _take_file(self, version: int, tmp: str, size: int) -> _WriterFile:
        """A file named `tmp` of `size` bytes, locked LOCK_EX: the oldest kept file when no
        reader holds it (or the file of the same version, rewritten), else a new one."""
        same = [f for f in self._files if f.version == version]
        candidate = None
        if same:
            candidate = same[0]
            self._files.remove(candidate)
        elif len(self._files) >= self.keep:
            candidate = self._files.popleft()
        if candidate is not None:
            try:
                os.rename(candidate.path, tmp)      # new readers can no longer open it
            except OSError:                         # removed under us: start afresh
                candidate.close()
                candidate = None
        if candidate is not None:
            if candidate.size == size:
                try:
                    fcntl.flock(candidate.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    candidate.path = tmp
                    self.counters["reused"] += 1
                    return candidate
                except BlockingIOError:             # a reader still holds that version
                    self.counters["held_by_reader"] += 1
            # Readers that map it keep their pages until they unmap it (FACTS.md).
            os.unlink(tmp)
            candidate.close()
        return self._create(tmp, size)

    def _create(self, path: str, size: int) -> _WriterFile:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            # Allocates the pages now: a full /dev/shm is an ENOSPC here, not a SIGBUS at the
            # first write into a sparse mapping.
            os.posix_fallocate(fd, 0, size)
            fcntl.flock(fd, fcntl.LOCK_EX)
            file = _WriterFile(path, fd, size)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise ShmUnavailable(e.errno, f"shared-memory file {path} ({size} bytes): {e}") \
                from None
        self.counters["created"] += 1
        return file

    def _discard(self, file: _WriterFile) -> None:
        try:
            os.unlink(file.path)
        except OSError:
            pass
        file.close()

    def _fill(self, dst: memoryview, views: List[memoryview], total: int) -> int:
        """Copies the payload into `dst` chunk by chunk; returns its CRC-32. Each chunk, just
        after its copy (so still in cache), goes into the CRC and, inside float tensors, the
        finiteness check; with enough CPUs a helper thread runs those checks behind the copy
        (ISA-L and numpy release the GIL)."""
        source = _Cursor(views)
        spans: List[Tuple[int, int, Optional[str], str]] = []
        head = min(total, 8)
        source.copy_into(dst[:head])
        data_start = head
        if head == 8:
            data_start = min(total, 8 + int.from_bytes(dst[:8], "little"))
            source.copy_into(dst[8:data_start])
            spans = self._tensor_spans(dst[:data_start], data_start, total)
        checks = _Checks(threaded=total >= PIPELINE_MIN_BYTES)
        try:
            checks.add(dst[:data_start], None, "")
            position = data_start
            for begin, end, dtype, name in spans + [(total, total, None, "")]:
                for start, stop, kind in ((position, begin, None), (begin, end, dtype)):
                    for offset in range(start, stop, self.chunk_bytes):
                        piece = dst[offset:min(offset + self.chunk_bytes, stop)]
                        source.copy_into(piece)
                        checks.add(piece, kind, name)
                position = max(position, end)
            return checks.result()
        finally:
            checks.close()

    def _tensor_spans(self, header_bytes, data_start: int, total: int):
        """(begin, end, dtype or None, name) of each tensor, in payload offsets and in order,
        from a safetensors header; [] when it is not one (the server refuses the payload). A
        dtype only where the finiteness check applies and the span is whole items."""
        try:
            header, start = safetensors_header(header_bytes)
        except PayloadRejected:
            return []
        spans, position = [], data_start
        try:
            entries = sorted((e["data_offsets"][0], e["data_offsets"][1], e["dtype"], name)
                             for name, e in header.items() if name != "__metadata__")
        except (TypeError, KeyError, IndexError):
            return []
        for begin, end, dtype, name in entries:
            begin, end = start + begin, start + end
            if not (isinstance(begin, int) and isinstance(end, int)) or \
                    not position <= begin <= end <= total:
                return []
            size = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}.get(dtype)
            check = self.check_finite and size is not None and (end - begin) % size == 0
            spans.append((begin, end, dtype if check else None, name))
            position = end
        return spans

    @property
    def files(self) -> List[str]:
        """Paths of the kept versions, oldest first."""
        return [f.path for f in self._files]

    def close(self) -> None:
        """Unmaps every file and removes the run directory (readers that still map a file keep
        it until they unmap it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        while self._files:
            self._files.popleft().close()
        shutil.rmtree(self.directory, ignore_errors=True)
        remove_if_empty(self.root)


class _Checks:
    """The CRC-32 of a sequence of pieces and the finiteness check of those inside float
    tensors, in order, inline or in one helper thread (a bounded queue behind the caller)."""

    def __init__(self, threaded: bool):
        self.crc = 0
        self.error: Optional[str] = None
        self._queue: Optional[queue.Queue] = None
        self._thread = None
        if threaded:
            self._queue = queue.Queue(maxsize=32)
            self._thread = threading.Thread(target=self._run, name="shm-writer-checks",
                                            daemon=True)
            self._thread.start()

    def _check(self, piece, kind: Optional[str], name: str) -> None:
        self.crc = wire.crc32(piece, self.crc)
        if kind is not None and self.error is None and has_nonfinite(piece, kind):
            self.error = (f"tensor {name!r} holds NaN or infinite values; nothing was "
                          "published")

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._check(*item)

    def add(self, piece, kind: Optional[str], name: str) -> None:
        if self._queue is None:
            self._check(piece, kind, name)
        else:
            self._queue.put((piece, kind, name))

    def result(self) -> int:
        """The CRC-32 once every piece is checked; PayloadRejected for a non-finite value."""
        self.close()
        if self.error is not None:
            raise PayloadRejected(self.error)
        return self.crc

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


class _Cursor:
    """Sequential reads of the concatenation of `views`."""

    def __init__(self, views: List[memoryview]):
        self._views = views
        self._part = 0
        self._offset = 0

    def copy_into(self, dst: memoryview) -> None:
        filled, need = 0, dst.nbytes
        while filled < need:
            view = self._views[self._part]
            take = min(need - filled, view.nbytes - self._offset)
            if take:
                dst[filled:filled + take] = view[self._offset:self._offset + take]
                filled += take
                self._offset += take
            if self._offset == view.nbytes:
                self._part, self._offset = self._part + 1, 0
