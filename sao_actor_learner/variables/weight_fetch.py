"""How a VariableClient (client.py) gets the bytes of one version: streamed from the server and
verified (`fetch_weights`), or mapped from the publisher's shared-memory file (`ShmLoader`).

Streaming copies the weight bytes once, gRPC's own copies aside: chunk data is located in the
received bytes without protobuf's two copies (wire.py) and assembled into the buffer of a version
the client dropped once nothing references that any more (buffers.py); the payload is checked
against the server's CRC-32 (its sha256 when a server sends no CRC).

Shared memory: when the server names a version's file (the learner published it that way on the
server's host), a client on that host maps the file instead (shm_reader.ShmReader: no copy, the
CRC-32 checked first). With weight_transport "auto" a file whose directory does not exist here
is another host's: gRPC for that directory from then on, quietly. A missing, replaced or corrupt
file falls back to gRPC and is counted (shm_fallbacks, shm_fallback_<why>).
"""
from __future__ import annotations

import hashlib
import os
import time
from typing import MutableMapping, Optional, Tuple

import grpc
import numpy as np
from absl import logging

from sao_actor_learner.protos_gen import variables_pb2
from sao_actor_learner.variables import wire
from sao_actor_learner.variables.buffers import BufferPool, PayloadAssembler
from sao_actor_learner.variables.channel import SERVICE
from sao_actor_learner.variables.shm_reader import ShmReader


class CorruptFetch(Exception):
    """A fetched payload failed verification (size, version or checksum); nothing was kept."""


def fetch_weights(channel: grpc.Channel, buffers: BufferPool, chunk_bytes: int,
                  wait_for_ready: bool, deadline: float,
                  version: int = -1) -> Tuple[int, bytearray, str]:
    """Streams the newest version (or `version` >= 0) over `channel`'s FetchWeights into a
    buffer from `buffers`, asking `chunk_bytes` per chunk (0: the server's default), and
    verifies size, version and checksum (the server's CRC-32; its sha256 when it sends no CRC).
    Returns (version, payload, the sha256 the server gave). Raises grpc.RpcError on transport
    errors and CorruptFetch when verification fails (the buffer goes back to `buffers`)."""
    stream = channel.unary_stream(
        f"{SERVICE}/FetchWeights",
        request_serializer=variables_pb2.FetchRequest.SerializeToString,
        response_deserializer=None)(
            variables_pb2.FetchRequest(version=version, chunk_bytes=chunk_bytes),
            timeout=max(deadline - time.monotonic(), 0.001), wait_for_ready=wait_for_ready)
    assembly: Optional[PayloadAssembler] = None
    digest = None
    crc = 0
    version, claimed_sha, claimed_crc = None, "", None
    for raw in stream:
        try:
            rest, data = wire.split_data_field(raw)
            chunk = variables_pb2.WeightsChunk.FromString(rest)
        except Exception as e:  # noqa: BLE001 - MalformedMessage, protobuf DecodeError
            stream.cancel()
            raise CorruptFetch(f"malformed WeightsChunk ({len(raw)} bytes): {e}") from None
        if version is None:
            version, claimed_sha = chunk.version, chunk.sha256
            claimed_crc = chunk.crc32 if chunk.HasField("crc32") else None
            if claimed_crc is None:
                digest = hashlib.sha256()
            assembly = PayloadAssembler(chunk.total_bytes, buffers)
        elif chunk.version != version:
            stream.cancel()
            raise CorruptFetch(f"chunk of version {chunk.version} inside a stream of version "
                               f"{version}")
        if assembly.received + data.nbytes > assembly.total:
            stream.cancel()
            raise CorruptFetch(f"version {version}: more than the announced {assembly.total} "
                               "bytes")
        assembly.add(data)
        if digest is not None:
            digest.update(data)
        else:
            crc = wire.crc32(data, crc)
    if version is None:
        raise CorruptFetch("FetchWeights returned no chunks")
    payload = assembly.payload()
    if assembly.received != assembly.total:
        raise CorruptFetch(f"version {version}: got {assembly.received} of {assembly.total} "
                           "bytes")
    if digest is not None and digest.hexdigest() != claimed_sha.lower():
        buffers.give(payload)
        raise CorruptFetch(f"version {version}: sha256 {digest.hexdigest()} does not match the "
                           f"server's {claimed_sha!r}; discarded")
    if digest is None and crc != claimed_crc:
        buffers.give(payload)
        raise CorruptFetch(f"version {version}: CRC-32 {crc:#010x} does not match the "
                           f"server's {claimed_crc:#010x}; discarded")
    return version, payload, claimed_sha.lower()


class ShmLoader:
    """A client's loads of versions from shared-memory files (see the module docstring).

    Args:
      reader: the client's ShmReader (its mappings).
      weight_transport: "auto" (a directory absent here means another host: gRPC for it from
        then on) or "shm" (always try).
      counters: where shm_not_here, shm_fallbacks and shm_fallback_<why> are counted.
    """

    def __init__(self, reader: ShmReader, weight_transport: str,
                 counters: MutableMapping[str, int]):
        self.reader = reader
        self._auto = weight_transport == "auto"
        self._counters = counters
        self._not_here: set = set()             # shared-memory directories absent on this host

    def load(self, info) -> Optional[np.ndarray]:
        """The payload of `info`'s version (a LatestVersion reply) from its shared-memory file,
        or None (fetch it over gRPC)."""
        path = info.shm_path
        if not path or not info.HasField("crc32"):
            return None
        directory = os.path.dirname(path)
        if directory in self._not_here:
            return None
        payload, why = self.reader.load(path, info.num_bytes, info.crc32)
        if payload is not None:
            return payload
        if why == "missing" and self._auto and not os.path.isdir(directory):
            # Another host (or container) than the publisher's, or a writer that has closed:
            # gRPC for that directory from now on, quietly.
            self._not_here.add(directory)
            self._counters["shm_not_here"] += 1
            logging.info("VariableClient: %s is not on this host; fetching over gRPC",
                         directory)
            return None
        self._counters["shm_fallbacks"] += 1
        self._counters[f"shm_fallback_{why}"] += 1
        logging.log_every_n_seconds(logging.WARNING, "VariableClient: version %d from shared "
                                    "memory %s: %s; fetching it over gRPC (%d times so far)",
                                    10, info.version, path, why,
                                    self._counters["shm_fallbacks"])
        return None
