"""A version the variable server holds: its record, how two records of one version compare,
and its payload framed as FetchWeights' WeightsChunk messages (wire.encode_chunk: each framed
around a slice of the held payload, one copy, into the bytes gRPC sends).
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

from sao_actor_learner.protos_gen import variables_pb2
from sao_actor_learner.variables import wire
from sao_actor_learner.variables.shm_publish import ShmCopy

# How long FetchWeights waits for the server's copy of a shared-memory version.
SHM_COPY_TIMEOUT_S = 120.0

@dataclasses.dataclass(frozen=True)
class PublishedVersion:
    """One fully received and verified policy version. Immutable: filling in its sha256 (see
    below) replaces the record."""
    version: int
    payload: Optional[memoryview]  # read-only view of the assembled bytes; None for a
                                 # shared-memory publish until the server's copy is ready
    sha256: str                  # "" from the moment the version is visible (its CRC-32 and
                                 # the validator passed) until the digest is recorded, just
                                 # before Publish answers; always "" for a shared-memory publish
    format: str
    dropped_total: int           # the admission credit the publisher sent with it
    publish_time: float
    crc32: int = 0               # CRC-32 (zlib.crc32) of the payload
    shm_path: str = ""           # its shared-memory file on this host, if published that way
    size: int = -1               # payload bytes (-1: payload.nbytes)

    @property
    def num_bytes(self) -> int:
        return self.size if self.size >= 0 else self.payload.nbytes


def same_payload(current: PublishedVersion, record: PublishedVersion) -> Optional[bool]:
    """Whether two records of one version carry the same payload: by size, then sha256, or,
    for a shared-memory one (no sha256 there), size and CRC-32; None when that cannot be told
    yet (a sha256 still being computed)."""
    if current.num_bytes != record.num_bytes:
        return False
    if current.sha256 and record.sha256:
        return current.sha256 == record.sha256
    if current.shm_path or record.shm_path:
        return current.crc32 == record.crc32
    return None


def frames(record: PublishedVersion, payload: Optional[memoryview], chunk_bytes: int,
           copy: Optional[ShmCopy] = None) -> Iterator[bytes]:
    """The chunks of `payload`, or, while the server copies a shared-memory version, of
    `copy`'s buffer, each once the copy has passed it (cut-through: the client checks the
    CRC-32 of the whole before it uses any of it)."""
    total, offset = record.num_bytes, 0
    first = variables_pb2.WeightsChunk(version=record.version, total_bytes=total,
                                       sha256=record.sha256, format=record.format,
                                       crc32=record.crc32).SerializeToString()
    head = variables_pb2.WeightsChunk(version=record.version).SerializeToString()
    while True:
        end = min(offset + chunk_bytes, total)
        data = payload if copy is None else copy.wait_for(end, SHM_COPY_TIMEOUT_S)
        yield wire.encode_chunk(first if offset == 0 else head, (data[offset:end],))
        offset = end
        if offset >= total:
            return
