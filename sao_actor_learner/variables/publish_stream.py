"""One streamed Publish of the variable server, received and checked (variables/store.py makes
the version visible).

`assemble` copies the chunk data of a stream of raw PublishChunk messages into one receive
buffer (located in the raw request, wire.py; the buffer reused from an evicted version,
buffers.py), with the CRC-32 as it goes and the sha256 in a helper thread (`Sha256Behind`). It
refuses, as they arrive: a chunk after the last, a negative version or credit, a total_bytes
beyond the limit, a chunk of another version or total_bytes, more bytes than announced.
`stream_problem` then says what is wrong with the whole: no last chunk, fewer bytes than
announced, no checksum, a CRC-32 mismatch.

The payload is never interpreted here (no torch import).
"""
from __future__ import annotations

import hashlib
import queue
import threading
from typing import Callable, Iterable, NamedTuple, Optional

import grpc

from sao_actor_learner.protos_gen import variables_pb2
from sao_actor_learner.variables import wire
from sao_actor_learner.variables.buffers import BufferPool, PayloadAssembler
from sao_actor_learner.variables.rpc import Abort, parse_chunk

_INVALID = grpc.StatusCode.INVALID_ARGUMENT


class Sha256Behind:
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


class StreamedPayload(NamedTuple):
    """A Publish stream as `assemble` received it."""
    first: variables_pb2.PublishChunk
    last: Optional[variables_pb2.PublishChunk]   # None: the stream had no last chunk
    assembly: PayloadAssembler
    crc32: int                                   # of the bytes received
    n_chunks: int


def assemble(chunks: Iterable[bytes], digest: Sha256Behind, max_payload_bytes: int,
             buffers: BufferPool, check_newer: Callable[[int], None]) -> StreamedPayload:
    """Receives a whole stream of raw PublishChunk messages (see the module doc); raises Abort
    naming what was wrong. `check_newer(version)` is called on the first chunk (it raises Abort
    for a version older than the visible one: fail early, checked again at commit)."""
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
            if chunk.total_bytes < 0 or chunk.total_bytes > max_payload_bytes:
                raise Abort(_INVALID if chunk.total_bytes < 0
                            else grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"Publish total_bytes={chunk.total_bytes}: must be in "
                            f"[0, max_payload_bytes={max_payload_bytes}] (set on the "
                            "first chunk to the size of the whole payload)")
            if chunk.dropped_total < 0:
                raise Abort(_INVALID, f"Publish dropped_total={chunk.dropped_total}: must "
                            "be >= 0")
            check_newer(chunk.version)
            assembly = PayloadAssembler(chunk.total_bytes, buffers)
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
    return StreamedPayload(first, last, assembly, crc, n_chunks)


def stream_problem(stream: StreamedPayload) -> str:
    """What is wrong with a whole stream before its sha256 is known ("" when nothing)."""
    first, last, assembly, crc = stream.first, stream.last, stream.assembly, stream.crc32
    if last is None:
        return (f"the stream ended after {stream.n_chunks} chunks ({assembly.received} bytes) "
                "without a chunk with last=true; the publish is incomplete and was discarded")
    if assembly.received != first.total_bytes:
        return (f"received {assembly.received} bytes but total_bytes="
                f"{first.total_bytes}; the payload is truncated and was discarded")
    if not last.sha256 and not last.HasField("crc32"):
        return ("the last chunk has no sha256 and no crc32; set either to the checksum of "
                "the whole payload (hex sha256, or zlib.crc32)")
    if last.HasField("crc32") and last.crc32 != crc:
        return (f"crc32 mismatch (last chunk says {last.crc32:#010x}, payload has "
                f"{crc:#010x}); the payload was corrupted in transit and was discarded")
    return ""
