"""The version ring of the variable server: what makes a published version visible, and
what serves it.

`VersionStore.receive` takes one Publish stream (raw PublishChunk messages), checks it and
makes the version visible atomically; `fetch_chunks` frames a held version's payload as
WeightsChunk messages (version_record.frames). Checks, in order: one version and a consistent
total_bytes on every chunk, no more bytes than announced, a last chunk, the CRC-32 and/or sha256
the last chunk claims (publish_stream.py), then `validate_payload` (e.g.
security.SafetensorsValidator: names, shapes, dtypes). A refused publish leaves the previous
version visible. Versions strictly increase; the visible version may be published again only
with a byte-identical payload (a resumed learner; version_record.same_payload).

A shared-memory publish (shm.py) is one chunk naming a file on this host instead of carrying
bytes: the store opens and locks the file, runs the validator's header checks
(`validate_payload.layout_only` when it has one: the publisher checked finiteness while it
wrote the file; shm_publish.py) and makes the version visible at once, with its path, for
clients on this host to map. The first FetchWeights of that version (remote clients, local ones
whose file is gone or corrupt) starts a helper thread that copies the file into a receive buffer
and checks its CRC-32, and streams each chunk once the copy has passed it; until then the server
holds only the open file, so with local actors only it never keeps a second copy of the
weights. A version evicted before anyone fetched it over gRPC is never copied. No sha256 is
computed for such a version: its identity, for the republish check, is its size and CRC-32.

Weight bytes are copied once: chunk data is located in the raw request (wire.py) and copied
into a receive buffer reused from an evicted version (buffers.py); fetched chunks are framed
around slices of the held payload. The sha256 (the version's identity) is computed by a helper
thread while the stream arrives; the CRC-32 (wire.crc32; its speed: BENCHMARKS.md, section 4)
is the transit check. The payload is never interpreted here (no torch import).
"""
from __future__ import annotations

import collections
import dataclasses
import hmac
import itertools
import threading
import time
from typing import Callable, Deque, Dict, Iterable, Iterator, Optional, Tuple

import grpc
from absl import logging

from sao_actor_learner.protos_gen import variables_pb2
from sao_actor_learner.variables.buffers import BufferPool
from sao_actor_learner.variables.publish_stream import Sha256Behind, assemble, stream_problem
from sao_actor_learner.variables.rpc import Abort, parse_chunk
from sao_actor_learner.variables.shm_files import DEFAULT_SHM_DIR, writer_root
from sao_actor_learner.variables.shm_publish import (ShmCopy, check_layout, check_shm_chunk,
                                                     open_shm_source)
from sao_actor_learner.variables.shm_reader import ShmSource
from sao_actor_learner.variables.version_record import (SHM_COPY_TIMEOUT_S, PublishedVersion,
                                                        frames, same_payload)

# FetchWeights never streams chunks smaller than this, whatever the client asks for.
MIN_FETCH_CHUNK_BYTES = 1 << 10
_INVALID = grpc.StatusCode.INVALID_ARGUMENT


class VersionStore:
    """The newest `keep_versions` published versions. Thread-safe.

    Args:
      keep_versions: how many newest versions stay fetchable by number (>= 1).
      max_payload_bytes: the largest payload a publisher may announce.
      validate_payload: called as validate_payload(version, payload, format) once a publish
        arrived whole with correct checksums; raising ValueError refuses the version. A
        shared-memory publish calls its `layout_only` instead when it has one.
      shm_root: shared-memory publishes may name files under this directory only; None refuses
        them (UNIMPLEMENTED: the publisher then streams the bytes).
    """

    def __init__(self, keep_versions: int = 2, max_payload_bytes: int = 16 << 30,
                 validate_payload: Optional[Callable[[int, memoryview, str], None]] = None,
                 shm_root: Optional[str] = writer_root(DEFAULT_SHM_DIR)):
        if keep_versions < 1:
            raise ValueError(f"keep_versions={keep_versions}: must be >= 1")
        if max_payload_bytes < 1:
            raise ValueError(f"max_payload_bytes={max_payload_bytes}: must be >= 1")
        self._max_payload_bytes = max_payload_bytes
        self._validate_payload = validate_payload
        self._validate_layout = getattr(validate_payload, "layout_only", validate_payload)
        self._shm_root = shm_root
        self._copies: Dict[int, ShmCopy] = {}   # shared-memory versions being copied (or
                                                  # whose copy failed), until evicted
        self._lock = threading.Lock()
        self._versions: Deque[PublishedVersion] = collections.deque(maxlen=keep_versions)
        self.buffers = BufferPool(max_spares=1)   # an evicted version's buffer, for reuse
        self.counters: Dict[str, int] = collections.Counter()

    def latest(self) -> Optional[PublishedVersion]:
        """The newest visible version, or None before any publish."""
        with self._lock:
            return self._versions[-1] if self._versions else None

    def _check_newer(self, version: int, allow_current: bool = False) -> None:
        """FAILED_PRECONDITION unless `version` is newer than the visible one (needs the lock);
        allow_current: the visible version itself passes too (checked again at commit)."""
        if not self._versions:
            return
        current = self._versions[-1].version
        if version < current or (version == current and not allow_current):
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                        f"Publish version={version} is not newer than the current version "
                        f"{current}: versions must strictly increase; publish version > "
                        f"{current}")

    def _check_newer_now(self, version: int) -> None:
        """`_check_newer(version, allow_current=True)` under the lock (fail early, checked
        again at commit)."""
        with self._lock:
            self._check_newer(version, allow_current=True)

    # ------------------------------------------------------------------ Publish

    def receive(self, chunks: Iterable[bytes]) -> Tuple[PublishedVersion, bool]:
        """Receives one Publish stream of raw PublishChunk messages; returns (the version now
        visible, whether it repeated the visible one: then its dropped_total is the larger of
        the two). Raises Abort naming what was wrong."""
        start = time.monotonic()
        chunks = iter(chunks)
        first_raw = next(chunks, None)
        if first_raw is not None:
            chunk, data = parse_chunk(variables_pb2.PublishChunk, first_raw, "PublishChunk #0")
            if chunk.HasField("shm_path"):
                return self._receive_shm(chunk, data, chunks, start)
            chunks = itertools.chain((first_raw,), chunks)
        digest = Sha256Behind()
        try:
            record, republished, n_chunks = self._receive(chunks, digest)
        finally:
            digest.close()
        logging.info("VariableServer: published version %d (%d bytes, %d chunks, sha256 %s…) "
                     "in %.3f s%s", record.version, record.num_bytes, n_chunks,
                     record.sha256[:12], time.monotonic() - start,
                     " (a repeat of the visible version)" if republished else "")
        return record, republished

    def _receive(self, chunks: Iterable[bytes], digest: Sha256Behind):
        stream = assemble(chunks, digest, self._max_payload_bytes, self.buffers,
                          self._check_newer_now)
        first, last, assembly, crc, n_chunks = stream
        version = first.version
        problem = stream_problem(stream)
        # After a verified CRC-32 the version becomes visible while the helper thread finishes
        # hashing, and Publish answers once the digest is recorded; a claimed sha256, or a
        # repeat of the visible version (compared by digest), needs the digest first.
        with self._lock:
            republish = bool(self._versions) and self._versions[-1].version == version
        actual = ""
        if not problem and (last.sha256 or republish):
            actual = digest.hexdigest()
            if last.sha256 and not hmac.compare_digest(last.sha256.lower().encode(),
                                                       actual.encode()):
                problem = (f"sha256 mismatch (last chunk says {last.sha256[:80]!r}, payload "
                           f"hashes to {actual}); the payload was corrupted in transit and was "
                           "discarded")
        if problem:
            self.buffers.give(assembly.payload())
            raise Abort(_INVALID, f"Publish version={version}: {problem}")
        payload = memoryview(assembly.payload()).toreadonly()
        del assembly, stream
        if self._validate_payload is not None:
            try:
                self._validate_payload(version, payload, first.format)
            except ValueError as e:
                self.buffers.give(payload.obj)
                raise Abort(_INVALID, f"Publish version={version}: payload rejected: {e}; "
                            "the version was discarded") from None
        record = PublishedVersion(version=version, payload=payload, sha256=actual,
                                  format=first.format, dropped_total=first.dropped_total,
                                  publish_time=time.time(), crc32=crc)
        with self._lock:
            current = self._republished_locked(record)
            if current is not None:
                self.buffers.give(payload.obj)     # reusable once `record` is gone
                return current, True, n_chunks
            self._append_locked(record)               # the atomic swap
        if not actual:                                # visible; clients may be fetching it
            actual = digest.hexdigest()
            with self._lock:
                for i, held in enumerate(self._versions):
                    if held.version == version and not held.sha256:
                        self._versions[i] = record = dataclasses.replace(held, sha256=actual)
        return record, False, n_chunks

    def _republished_locked(self, record: PublishedVersion) -> Optional[PublishedVersion]:
        """When `record` repeats the visible version: the visible one, its credit (and shared-
        memory path) refreshed; None when it is a newer version. Abort when it repeats it with
        another payload, or cannot be compared yet. Needs the lock."""
        current = self._versions[-1] if self._versions else None
        if current is None or current.version != record.version:
            return None
        same = same_payload(current, record)
        if same is None:
            raise Abort(grpc.StatusCode.UNAVAILABLE,
                        f"Publish version={record.version}: another Publish of this version "
                        "is still being hashed; publish from one learner, one version at a time")
        if not same:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                        f"Publish version={record.version} repeats the current version with "
                        "a different payload; publish a newer version instead")
        self.counters["republished"] += 1
        self._versions[-1] = current = dataclasses.replace(
            current, dropped_total=max(current.dropped_total, record.dropped_total),
            shm_path=record.shm_path or current.shm_path)
        return current

    def _append_locked(self, record: PublishedVersion) -> None:
        """Makes `record` the visible version, evicting the oldest held one. Needs the lock."""
        self._check_newer(record.version)
        if len(self._versions) == self._versions.maxlen:
            # Evicted: its buffer receives a later version once no fetch streams it.
            evicted = self._versions[0]
            if evicted.payload is not None:
                self.buffers.give(evicted.payload.obj)
            copy = self._copies.pop(evicted.version, None)
            if copy is not None and not copy.started:
                copy.source.close()               # never fetched over gRPC: never copied
        self._versions.append(record)
        self.counters["published"] += 1

    # ------------------------------------------------------------------ shared-memory publish

    def _receive_shm(self, chunk, data, rest: Iterator[bytes],
                     start: float) -> Tuple[PublishedVersion, bool]:
        """One shared-memory publish (see the module doc); returns as `receive`."""
        version, size = chunk.version, chunk.total_bytes
        extra = sum(1 for _ in rest)
        what = f"Publish version={version} (shm_path={chunk.shm_path!r})"
        check_shm_chunk(chunk, data, extra, self._shm_root, self._max_payload_bytes, what)
        self._check_newer_now(version)                    # fail early, checked again at commit
        source = open_shm_source(chunk.shm_path, size, self._shm_root, what)
        try:
            if self._validate_layout is not None:
                check_layout(source, self._validate_layout, version, chunk.format, what)
            record = PublishedVersion(version=version, payload=None, sha256="",
                                      format=chunk.format, dropped_total=chunk.dropped_total,
                                      publish_time=time.time(), crc32=chunk.crc32,
                                      shm_path=chunk.shm_path, size=size)
            with self._lock:
                current = self._republished_locked(record)
                if current is None:
                    self._append_locked(record)            # the atomic swap
                    self.counters["shm_published"] += 1
                    self._copies[version] = ShmCopy(size, source)   # copied on demand
        except BaseException:
            source.close()
            raise
        if current is not None:
            source.close()
            return current, True
        logging.info("VariableServer: published version %d (%d bytes) from shared memory %s "
                     "in %.3f s", version, size, chunk.shm_path, time.monotonic() - start)
        return record, False

    def _start_copy_locked(self, record: PublishedVersion, copy: "ShmCopy") -> None:
        """Starts the server's copy of a shared-memory version unless it runs already (the
        first FetchWeights of it, or wait_copied). Needs the lock."""
        if copy.started:
            return
        copy.started = True
        threading.Thread(target=self._copy_shm, args=(record, copy.source, copy), daemon=True,
                         name=f"variable-server-shm-copy-{record.version}").start()

    def _copy_shm(self, record: PublishedVersion, source: ShmSource, copy: "ShmCopy") -> None:
        """The server's own copy of a shared-memory version (what FetchWeights streams, as the
        copy passes each chunk)."""
        try:
            buf = self.buffers.take(record.num_bytes) or bytearray(record.num_bytes)
            copy.start(buf)
            source.read_into(buf, record.crc32, progress=copy.advance)
            payload = memoryview(buf).toreadonly()
            with self._lock:
                for i, held in enumerate(self._versions):
                    if held.version == record.version and held.payload is None and \
                            held.crc32 == record.crc32:
                        self._versions[i] = dataclasses.replace(held, payload=payload)
                        self.counters["shm_copied"] += 1
                        break
                else:                                  # evicted meanwhile
                    self.buffers.give(buf)
                self._copies.pop(record.version, None)
            copy.finish()
        except (OSError, ValueError) as e:
            logging.error("VariableServer: version %d: could not copy %s: %s; FetchWeights "
                          "cannot serve it", record.version, record.shm_path, e)
            with self._lock:
                self.counters["shm_copy_failed"] += 1
            copy.finish(str(e))
            if copy.buf is not None:
                self.buffers.give(copy.buf)            # reused once no stream views it
        finally:
            source.close()

    def wait_copied(self, version: int, timeout_s: float = SHM_COPY_TIMEOUT_S) -> bool:
        """Waits until `version` has its bytes on the server (at once for a gRPC publish; a
        shared-memory one's copy is started if no fetch started it); False when it is not held
        or its copy failed or timed out."""
        with self._lock:
            copy = self._copies.get(version)
            record = next((v for v in self._versions if v.version == version), None)
            if copy is not None and record is not None:
                self._start_copy_locked(record, copy)
        if copy is not None and not copy.wait_done(timeout_s):
            return False
        with self._lock:
            record = next((v for v in self._versions if v.version == version), None)
            return record is not None and record.payload is not None

    def close(self) -> None:
        """Lets go of the shared-memory files of versions never copied (the writer may then
        reuse or remove them)."""
        with self._lock:
            for copy in self._copies.values():
                if not copy.started:
                    copy.source.close()
                    copy.started = True
                    copy.finish("the server stopped")

    # ------------------------------------------------------------------ FetchWeights

    def fetch_chunks(self, version: int, chunk_bytes: int) -> Iterator[bytes]:
        """Serialized WeightsChunk messages of `version` (< 0: the newest), each framed around
        a slice of the payload (wire.encode_chunk: one copy, into the bytes gRPC sends).
        Raises Abort (UNAVAILABLE before any publish, NOT_FOUND for a version not held) before
        the first chunk."""
        with self._lock:
            if not self._versions:
                raise Abort(grpc.StatusCode.UNAVAILABLE,
                            "FetchWeights: nothing has been published yet; poll LatestVersion "
                            "until version >= 0")
            if version < 0:
                record = self._versions[-1]
            else:
                record = next((v for v in self._versions if v.version == version), None)
                if record is None:
                    held = [v.version for v in self._versions]
                    raise Abort(grpc.StatusCode.NOT_FOUND,
                                f"FetchWeights version={version}: not held; the server keeps "
                                f"versions {held}; ask for version=-1 (the newest)")
            self.counters["fetches"] += 1
            copy = self._copies.get(record.version) if record.payload is None else None
            if copy is not None and not copy.error:
                self._start_copy_locked(record, copy)
        chunk_bytes = max(MIN_FETCH_CHUNK_BYTES, chunk_bytes)
        if record.payload is not None:
            return frames(record, record.payload, chunk_bytes)
        if copy is None or copy.error:               # a shared-memory version, not copied
            raise Abort(grpc.StatusCode.UNAVAILABLE,
                        f"FetchWeights version={record.version}: published through shared "
                        "memory and the server has no copy of it "
                        f"({copy.error if copy else 'evicted'}); ask again for the newest")
        return frames(record, None, chunk_bytes, copy)
