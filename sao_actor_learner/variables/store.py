"""The publish path and the version ring of the variable server.

`VersionStore.receive` assembles one Publish stream (raw PublishChunk messages), checks it
and makes the version visible atomically; `fetch_chunks` frames a held version's payload as
WeightsChunk messages. Checks, in order: one version and a consistent total_bytes on every
chunk, no more bytes than announced, a last chunk, the CRC-32 and/or sha256 the last chunk
claims, then `validate_payload` (e.g. security.SafetensorsValidator: names, shapes, dtypes).
A refused publish leaves the previous version visible. Versions strictly increase; the visible
version may be published again only with a byte-identical payload (a resumed learner).

Weight bytes are copied once: chunk data is located in the raw request (wire.py) and copied
into a receive buffer reused from an evicted version (buffers.py); fetched chunks are framed
around slices of the held payload. The sha256 (the version's identity) is computed by a helper
thread while the stream arrives; the CRC-32 (wire.crc32, ~20 GB/s) is the transit check. The
payload is never interpreted here (no torch import).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import queue
import threading
import time
from typing import Callable, Deque, Dict, Iterable, Iterator, Optional, Tuple

import grpc
from absl import logging

from sao_actor_learner.protos_gen import variables_pb2
from sao_actor_learner.variables import wire
from sao_actor_learner.variables.buffers import BufferPool, PayloadAssembler
from sao_actor_learner.variables.rpc import Abort, parse_chunk

# FetchWeights never streams chunks smaller than this, whatever the client asks for.
MIN_FETCH_CHUNK_BYTES = 1 << 10
_INVALID = grpc.StatusCode.INVALID_ARGUMENT


@dataclasses.dataclass(frozen=True)
class PublishedVersion:
    """One fully received and verified policy version. Immutable: filling in its sha256 (see
    below) replaces the record."""
    version: int
    payload: memoryview          # read-only view of the assembled bytes
    sha256: str                  # "" from the moment the version is visible (its CRC-32 and
                                 # the validator passed) until the digest is recorded, just
                                 # before Publish answers
    format: str
    dropped_total: int           # the admission credit the publisher sent with it
    publish_time: float
    crc32: int = 0               # CRC-32 (zlib.crc32) of the payload

    @property
    def num_bytes(self) -> int:
        return self.payload.nbytes


class _Sha256Behind:
    """The sha256 of a stream of buffers, hashed by a helper thread while the caller receives
    and copies the next ones (hashlib releases the GIL): on two cores a publish then takes
    about max(receive + copy + CRC, sha256) instead of their sum. At most `max_pending`
    buffers wait (each one is kept alive until hashed)."""

    def __init__(self, max_pending: int = 8):
        self._pending: "queue.Queue" = queue.Queue(maxsize=max_pending)
        self._digest = hashlib.sha256()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="variable-server-sha256")
        self._thread.start()

    def _run(self) -> None:
        while True:
            data = self._pending.get()
            if data is None:
                return
            self._digest.update(data)

    def update(self, data) -> None:
        self._pending.put(data)

    def hexdigest(self) -> str:
        """Waits for the buffers given so far, then the hex digest. Ends the helper thread."""
        self.close()
        return self._digest.hexdigest()

    def close(self) -> None:
        """Ends the helper thread (after hashing what is queued). Idempotent."""
        if self._thread.is_alive():
            self._pending.put(None)
            self._thread.join()


class VersionStore:
    """The newest `keep_versions` published versions. Thread-safe.

    Args:
      keep_versions: how many newest versions stay fetchable by number (>= 1).
      max_payload_bytes: the largest payload a publisher may announce.
      validate_payload: called as validate_payload(version, payload, format) once a publish
        arrived whole with correct checksums; raising ValueError refuses the version.
    """

    def __init__(self, keep_versions: int = 2, max_payload_bytes: int = 16 << 30,
                 validate_payload: Optional[Callable[[int, memoryview, str], None]] = None):
        if keep_versions < 1:
            raise ValueError(f"keep_versions={keep_versions}: must be >= 1")
        if max_payload_bytes < 1:
            raise ValueError(f"max_payload_bytes={max_payload_bytes}: must be >= 1")
        self._max_payload_bytes = max_payload_bytes
        self._validate_payload = validate_payload
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

    # ------------------------------------------------------------------ Publish

    def receive(self, chunks: Iterable[bytes]) -> Tuple[PublishedVersion, bool]:
        """Receives one Publish stream of raw PublishChunk messages; returns (the version now
        visible, whether it repeated the visible one: then its dropped_total is the larger of
        the two). Raises Abort naming what was wrong."""
        start = time.monotonic()
        digest = _Sha256Behind()
        try:
            record, republished, n_chunks = self._receive(chunks, digest)
        finally:
            digest.close()
        logging.info("VariableServer: published version %d (%d bytes, %d chunks, sha256 %s…) "
                     "in %.3f s%s", record.version, record.num_bytes, n_chunks,
                     record.sha256[:12], time.monotonic() - start,
                     " (a repeat of the visible version)" if republished else "")
        return record, republished

    def _assemble(self, chunks: Iterable[bytes], digest: _Sha256Behind):
        """(first chunk, last chunk, assembly, CRC-32, number of chunks) of a whole stream."""
        assembly: Optional[PayloadAssembler] = None
        crc, n_chunks = 0, 0
        first = last = None
        for raw in chunks:
            chunk, data = parse_chunk(variables_pb2.PublishChunk, raw, f"PublishChunk #{n_chunks}")
            if last is not None:
                raise Abort(_INVALID, f"Publish: chunk #{n_chunks} arrived after the chunk with "
                            "last=true; end the stream after the last chunk")
            if first is None:
                first = chunk
                if chunk.version < 0:
                    raise Abort(_INVALID, f"Publish version={chunk.version}: must be >= 0")
                if chunk.total_bytes < 0 or chunk.total_bytes > self._max_payload_bytes:
                    raise Abort(_INVALID if chunk.total_bytes < 0
                                else grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"Publish total_bytes={chunk.total_bytes}: must be in "
                                f"[0, max_payload_bytes={self._max_payload_bytes}] (set on the "
                                "first chunk to the size of the whole payload)")
                if chunk.dropped_total < 0:
                    raise Abort(_INVALID, f"Publish dropped_total={chunk.dropped_total}: must "
                                "be >= 0")
                with self._lock:   # fail early, checked again at commit
                    self._check_newer(chunk.version, allow_current=True)
                assembly = PayloadAssembler(chunk.total_bytes, self.buffers)
            elif chunk.version != first.version:
                raise Abort(_INVALID, f"Publish: chunk #{n_chunks} has version={chunk.version} "
                            f"but the first chunk had version={first.version}; every chunk of "
                            "one publish carries the same version")
            elif chunk.total_bytes not in (0, first.total_bytes):
                raise Abort(_INVALID, f"Publish: chunk #{n_chunks} has total_bytes="
                            f"{chunk.total_bytes} but the first chunk said {first.total_bytes}")
            if assembly.received + data.nbytes > first.total_bytes:
                raise Abort(_INVALID, f"Publish: received {assembly.received + data.nbytes} "
                            f"bytes by chunk #{n_chunks}, more than total_bytes="
                            f"{first.total_bytes} announced on the first chunk")
            assembly.add(data)
            digest.update(data)
            crc = wire.crc32(data, crc)
            n_chunks += 1
            if chunk.last:
                last = chunk
        if first is None:
            raise Abort(_INVALID, "Publish: the stream had no chunks; send at least one "
                        "PublishChunk with last=true")
        return first, last, assembly, crc, n_chunks

    def _receive(self, chunks: Iterable[bytes], digest: _Sha256Behind):
        first, last, assembly, crc, n_chunks = self._assemble(chunks, digest)
        version = first.version
        problem = ""
        if last is None:
            problem = (f"the stream ended after {n_chunks} chunks ({assembly.received} bytes) "
                       "without a chunk with last=true; the publish is incomplete and was "
                       "discarded")
        elif assembly.received != first.total_bytes:
            problem = (f"received {assembly.received} bytes but total_bytes="
                       f"{first.total_bytes}; the payload is truncated and was discarded")
        elif not last.sha256 and not last.HasField("crc32"):
            problem = ("the last chunk has no sha256 and no crc32; set either to the checksum of "
                       "the whole payload (hex sha256, or zlib.crc32)")
        elif last.HasField("crc32") and last.crc32 != crc:
            problem = (f"crc32 mismatch (last chunk says {last.crc32:#010x}, payload has "
                       f"{crc:#010x}); the payload was corrupted in transit and was discarded")
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
        del assembly
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
            current = self._versions[-1] if self._versions else None
            if current is not None and current.version == version:
                if not current.sha256 or not record.sha256:
                    raise Abort(grpc.StatusCode.UNAVAILABLE,
                                f"Publish version={version}: another Publish of this version "
                                "is still being hashed; publish from one learner, one version "
                                "at a time")
                if current.sha256 != record.sha256:
                    raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"Publish version={version} repeats the current version with "
                                "a different payload; publish a newer version instead")
                self.counters["republished"] += 1
                self._versions[-1] = current = dataclasses.replace(
                    current, dropped_total=max(current.dropped_total, record.dropped_total))
                self.buffers.give(payload.obj)     # reusable once `record` is gone
                return current, True, n_chunks
            self._check_newer(version)
            if len(self._versions) == self._versions.maxlen:
                # Evicted: its buffer receives a later version once no fetch streams it.
                self.buffers.give(self._versions[0].payload.obj)
            self._versions.append(record)             # the atomic swap
            self.counters["published"] += 1
        if not actual:                                # visible; clients may be fetching it
            actual = digest.hexdigest()
            with self._lock:
                for i, held in enumerate(self._versions):
                    if held.version == version and not held.sha256:
                        self._versions[i] = record = dataclasses.replace(held, sha256=actual)
        return record, False, n_chunks

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
        return self._frames(record, max(MIN_FETCH_CHUNK_BYTES, chunk_bytes))

    @staticmethod
    def _frames(record: PublishedVersion, chunk_bytes: int) -> Iterator[bytes]:
        payload, total, offset = record.payload, record.num_bytes, 0
        first = variables_pb2.WeightsChunk(version=record.version, total_bytes=total,
                                           sha256=record.sha256, format=record.format,
                                           crc32=record.crc32).SerializeToString()
        head = variables_pb2.WeightsChunk(version=record.version).SerializeToString()
        while True:
            end = min(offset + chunk_bytes, total)
            yield wire.encode_chunk(first if offset == 0 else head, (payload[offset:end],))
            offset = end
            if offset >= total:
                return
