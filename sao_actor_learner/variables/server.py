"""The variable server: a gRPC node holding the newest published policy and admission counters.

The learner publishes each policy version (opaque bytes, safetensors in practice) in chunks with
a CRC-32 and/or a sha256; actors and evaluators poll `LatestVersion`, stream `FetchWeights` and
ask `Admit` before starting a rollout (SAO.md section 6, AReaL's staleness rule).

Every request is parsed by hand from raw bytes so that a malformed message gets an
INVALID_ARGUMENT naming what was wrong (gRPC's default answer is a bare INTERNAL), and no bad
request can stop the server. The payload is never interpreted here (no torch import): a
`validate_payload` hook (security.SafetensorsValidator in a program) checks names, shapes and
dtypes before a version becomes visible. With an `auth_token` every call must carry it
(security.py); binding a non-loopback host without one is refused; TLS is optional.

Weight bytes are not copied more than needed (issue 8, BENCHMARKS.md section 4): chunk data is
located in the raw request (wire.py) and copied once, into a receive buffer reused from an
evicted version (buffers.py); fetched chunks are framed around a slice of the held payload. The
server computes both the sha256 of every payload (the version's identity, as before; in a helper
thread, overlapping the receive) and its CRC-32 (wire.crc32, ~20 GB/s), which publishers send
and clients check: the transit checks, as the sha256 was before, at a quarter of its cost.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import queue
import threading
import time
from concurrent import futures
from typing import Callable, Deque, Dict, Iterator, Optional

import grpc
from absl import logging
from google.protobuf import message as pb_message

from sao_actor_learner import core
from sao_actor_learner.protos_gen import variables_pb2
from sao_actor_learner.variables import wire
from sao_actor_learner.variables.buffers import BufferPool, PayloadAssembler
from sao_actor_learner.variables.security import (AUTH_TOKEN_METADATA_KEY, check_bind,
                                                  server_credentials)

SERVICE_NAME = variables_pb2.DESCRIPTOR.services_by_name["VariableService"].full_name
PUBLISHER_TOKEN_METADATA_KEY = "x-sao-publisher-token"
# Room for the protobuf framing around one chunk's data.
MESSAGE_OVERHEAD_BYTES = 64 << 10
# FetchWeights never streams chunks smaller than this, whatever the client asks for.
MIN_FETCH_CHUNK_BYTES = 1 << 10
MAX_ACTOR_ID_CHARS = 256
# Per-actor admission counters kept for stats; beyond this many ids, the rest share one bucket.
MAX_TRACKED_ACTORS = 4096


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
    dropped_total: int
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


class _Abort(Exception):
    """Raised inside a handler to answer with `code` and `details` (caught by `_guard`)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


def _parse(message_cls, data: bytes, what: str):
    """Parses raw request bytes; malformed bytes become INVALID_ARGUMENT naming `what`."""
    msg = message_cls()
    try:
        msg.ParseFromString(data)
    except (pb_message.DecodeError, RuntimeError, ValueError, TypeError) as e:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                     f"malformed {what}: could not parse {len(data)} bytes as "
                     f"{message_cls.DESCRIPTOR.full_name} ({e}); send a serialized "
                     f"{message_cls.DESCRIPTOR.name}") from None
    return msg


def _parse_chunk(message_cls, raw: bytes, what: str):
    """(message without data, zero-copy view of its data) of a chunk message; malformed bytes
    become INVALID_ARGUMENT naming `what`."""
    try:
        rest, data = wire.split_data_field(raw)
    except wire.MalformedMessage as e:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                     f"malformed {what}: could not parse {len(raw)} bytes as "
                     f"{message_cls.DESCRIPTOR.full_name} ({e}); send a serialized "
                     f"{message_cls.DESCRIPTOR.name}") from None
    return _parse(message_cls, rest, what), data


class VariableServer(core.Worker):
    """Serves the newest policy version over gRPC and runs admission control.

    Args:
      port: TCP port; 0 picks a free one (read it from `port` after `start()`).
      host: interface to bind; 127.0.0.1 by default (publishing is only token-protected).
      batch_size: rollouts per learner step (B in AReaL's rule).
      max_staleness: eta, the staleness limit in versions.
      admission_control: False grants every Admit request in full.
      publisher_token: the secret a publisher must send in metadata `x-sao-publisher-token`;
        "" disables the check (anyone who can reach the port may publish; a warning is logged).
      max_message_bytes: gRPC send/receive limit per message; must exceed `chunk_bytes`.
      chunk_bytes: default FetchWeights chunk size.
      keep_versions: how many newest versions stay fetchable by number (>= 1).
      max_payload_bytes: the largest payload a publisher may announce.
      max_workers: gRPC handler threads (each FetchWeights stream holds one while it streams).
      auth_token: the shared secret every call must send in metadata `x-sao-auth-token`; ""
        accepts calls without one (allowed only when `host` is a loopback address).
      tls_cert_chain, tls_private_key: PEM bytes; with both, the server listens with TLS only.
      validate_payload: called as validate_payload(version, payload, format) once a publish
        has arrived whole with a correct sha256; raising ValueError refuses the version
        (INVALID_ARGUMENT with its message) and the previous one stays visible.
    """

    def __init__(self,
                 port: int = 0,
                 host: str = "127.0.0.1",
                 batch_size: int = 1,
                 max_staleness: int = 0,
                 admission_control: bool = True,
                 publisher_token: str = "",
                 max_message_bytes: int = 8 << 20,
                 chunk_bytes: int = 1 << 20,
                 keep_versions: int = 2,
                 max_payload_bytes: int = 16 << 30,
                 max_workers: int = 16,
                 auth_token: str = "",
                 tls_cert_chain: Optional[bytes] = None,
                 tls_private_key: Optional[bytes] = None,
                 validate_payload: Optional[Callable[[int, memoryview, str], None]] = None):
        if not 0 <= port <= 65535:
            raise ValueError(f"port={port}: must be in [0, 65535]; 0 picks a free port")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1 (rollouts per learner step)")
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0; 0 means strictly "
                             "on-policy")
        if chunk_bytes < MIN_FETCH_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes={chunk_bytes}: must be >= {MIN_FETCH_CHUNK_BYTES}")
        if max_message_bytes < chunk_bytes + MESSAGE_OVERHEAD_BYTES:
            raise ValueError(
                f"max_message_bytes={max_message_bytes}: must be >= chunk_bytes + "
                f"{MESSAGE_OVERHEAD_BYTES} = {chunk_bytes + MESSAGE_OVERHEAD_BYTES} so one chunk "
                "fits in a gRPC message; raise max_message_bytes or lower chunk_bytes")
        if keep_versions < 1:
            raise ValueError(f"keep_versions={keep_versions}: must be >= 1")
        if max_payload_bytes < 1:
            raise ValueError(f"max_payload_bytes={max_payload_bytes}: must be >= 1")
        if max_workers < 2:
            raise ValueError(f"max_workers={max_workers}: must be >= 2")
        check_bind(host, auth_token, "the variable server")
        if (tls_cert_chain is None) != (tls_private_key is None):
            raise ValueError("tls_cert_chain and tls_private_key: give both (TLS) or neither")
        self._auth_token = auth_token
        self._tls = (tls_cert_chain, tls_private_key) if tls_cert_chain is not None else None
        self._validate_payload = validate_payload
        self._requested_port = port
        self._host = host
        self._batch_size = batch_size
        self._max_staleness = max_staleness
        self._admission_control = admission_control
        self._publisher_token = publisher_token
        self._max_message_bytes = max_message_bytes
        self._chunk_bytes = chunk_bytes
        self._max_payload_bytes = max_payload_bytes
        self._max_workers = max_workers

        self._lock = threading.Lock()            # guards everything below
        self._versions: Deque[PublishedVersion] = collections.deque(maxlen=keep_versions)
        # The buffer of an evicted version receives a later one (buffers.py).
        self._buffers = BufferPool(max_spares=1)
        self._started_total = 0
        self._started_by_actor: Dict[str, int] = collections.Counter()
        self._counters: Dict[str, int] = collections.Counter()

        self._server: Optional[grpc.Server] = None
        self._bound_port: Optional[int] = None
        self._stop_event = threading.Event()
        self._start_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        """The bound port (the requested one, or the picked one once started)."""
        if self._bound_port is not None:
            return self._bound_port
        if self._requested_port:
            return self._requested_port
        raise RuntimeError("VariableServer(port=0) picks its port in start(): call start() "
                           "before reading port/address, or pass a fixed port")

    @property
    def address(self) -> str:
        """"host:port" that clients connect to."""
        return f"{self._host}:{self.port}"

    def start(self) -> "VariableServer":
        """Binds and starts serving in background threads; returns at once. Idempotent."""
        with self._start_lock:
            if self._server is not None:
                return self
            options = [
                ("grpc.max_send_message_length", self._max_message_bytes),
                ("grpc.max_receive_message_length", self._max_message_bytes),
                ("grpc.so_reuseport", 0),
                *wire.BULK_TRANSFER_OPTIONS,
            ]
            server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=self._max_workers,
                                           thread_name_prefix="variable-server"),
                options=options,
                maximum_concurrent_rpcs=8 * self._max_workers)
            server.add_generic_rpc_handlers((self._make_handler(),))
            target = f"{self._host}:{self._requested_port}"
            try:
                if self._tls is not None:
                    bound = server.add_secure_port(target, server_credentials(*self._tls))
                else:
                    bound = server.add_insecure_port(target)
            except RuntimeError as e:
                raise RuntimeError(f"VariableServer could not bind {target} ({e}): pick another "
                                   "port or pass port=0") from e
            if not bound:
                raise RuntimeError(f"VariableServer could not bind {target}: the port is in use "
                                   "or the host is not local; pick another port or pass port=0")
            server.start()
            self._server = server
            self._bound_port = bound
            if not self._publisher_token:
                logging.warning("VariableServer on %s has no publisher_token: anyone who can "
                                "reach the port may publish weights", self.address)
            logging.info("VariableServer serving on %s (batch_size=%d, max_staleness=%d, "
                         "admission_control=%s, auth token %s, TLS %s)", self.address,
                         self._batch_size, self._max_staleness, self._admission_control,
                         "required" if self._auth_token else "off",
                         "on" if self._tls else "off")
            return self

    def run(self) -> None:
        """Serves until `stop()` is called (core.Worker)."""
        self.start()
        self._stop_event.wait()
        server = self._server
        if server is not None:
            server.stop(grace=1.0).wait()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stops serving (in-flight calls get `grace_s` seconds) and makes `run()` return."""
        self._stop_event.set()
        server = self._server
        if server is not None:
            server.stop(grace=grace_s).wait()

    def __enter__(self) -> "VariableServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(grace_s=0.2)

    # ------------------------------------------------------------------ in-process access

    def latest(self) -> Optional[PublishedVersion]:
        """The newest visible version, or None before any publish."""
        with self._lock:
            return self._versions[-1] if self._versions else None

    def stats(self) -> dict:
        """Counters for metrics: version, admissions (total and per actor), rejections."""
        with self._lock:
            latest = self._versions[-1] if self._versions else None
            return {
                "version": latest.version if latest else -1,
                "num_bytes": latest.num_bytes if latest else 0,
                "dropped_total": latest.dropped_total if latest else 0,
                "started_total": self._started_total,
                "capacity": self._capacity_locked(),
                "started_by_actor": dict(self._started_by_actor),
                **dict(self._counters),
            }

    # ------------------------------------------------------------------ gRPC plumbing

    def _make_handler(self) -> grpc.GenericRpcHandler:
        """Method handlers that take raw request bytes (parsed by hand, see module doc)."""
        ser = lambda m: m.SerializeToString()  # noqa: E731
        handlers = {
            "Publish": grpc.stream_unary_rpc_method_handler(
                self._guard_unary(self._publish, "Publish"), response_serializer=ser),
            "LatestVersion": grpc.unary_unary_rpc_method_handler(
                self._guard_unary(self._latest_version, "LatestVersion"),
                response_serializer=ser),
            "FetchWeights": grpc.unary_stream_rpc_method_handler(   # yields framed bytes
                self._guard_stream(self._fetch_weights, "FetchWeights")),
            "Admit": grpc.unary_unary_rpc_method_handler(
                self._guard_unary(self._admit, "Admit"), response_serializer=ser),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    def _reject(self, method: str, context: grpc.ServicerContext, code: grpc.StatusCode,
                details: str) -> None:
        with self._lock:
            self._counters[f"rejected_{method}"] += 1
            if code == grpc.StatusCode.UNAUTHENTICATED:
                self._counters["rejected_unauthenticated"] += 1
        peer = context.peer()
        if method == "Publish":
            logging.warning("VariableServer rejected %s from %s: %s: %s", method, peer,
                            code.name, details)
        else:
            logging.log_every_n_seconds(logging.WARNING, "VariableServer rejected %s from %s: "
                                        "%s: %s (further rejections logged at most every 5 s)",
                                        5, method, peer, code.name, details)
        context.abort(code, details)

    def _check_auth(self, context: grpc.ServicerContext) -> None:
        """UNAUTHENTICATED unless the call carries the auth token (when the server has one)."""
        if not self._auth_token:
            return
        presented = None
        for key, value in context.invocation_metadata() or ():
            if key == AUTH_TOKEN_METADATA_KEY:
                presented = value
        if isinstance(presented, bytes):
            presented = presented.decode("utf-8", "replace")
        if presented is None:
            raise _Abort(grpc.StatusCode.UNAUTHENTICATED,
                         f"this server needs the auth token in metadata "
                         f"'{AUTH_TOKEN_METADATA_KEY}' on every call (--auth_token or "
                         "SAO_AUTH_TOKEN)")
        if not hmac.compare_digest(presented.encode("utf-8", "replace"),
                                   self._auth_token.encode()):
            raise _Abort(grpc.StatusCode.UNAUTHENTICATED,
                         f"wrong auth token in metadata '{AUTH_TOKEN_METADATA_KEY}'")

    def _guard_unary(self, fn: Callable, method: str) -> Callable:
        def handler(request, context):
            try:
                self._check_auth(context)
                return fn(request, context)
            except _Abort as e:
                self._reject(method, context, e.code, e.details)
            except Exception as e:  # noqa: BLE001 - a bug must not take the server down
                if not context.is_active():
                    raise
                logging.exception("VariableServer: internal error in %s", method)
                context.abort(grpc.StatusCode.INTERNAL,
                              f"internal error in {method}: {type(e).__name__}: {e}")
        return handler

    def _guard_stream(self, fn: Callable, method: str) -> Callable:
        def handler(request, context):
            try:
                self._check_auth(context)
                yield from fn(request, context)
            except _Abort as e:
                self._reject(method, context, e.code, e.details)
            except Exception as e:  # noqa: BLE001
                if not context.is_active():
                    return
                logging.exception("VariableServer: internal error in %s", method)
                context.abort(grpc.StatusCode.INTERNAL,
                              f"internal error in {method}: {type(e).__name__}: {e}")
        return handler

    # ------------------------------------------------------------------ Publish

    def _check_token(self, context: grpc.ServicerContext) -> None:
        if not self._publisher_token:
            return
        presented = None
        for key, value in context.invocation_metadata() or ():
            if key == PUBLISHER_TOKEN_METADATA_KEY:
                presented = value
        if presented is None:
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                         f"Publish needs the publisher token in metadata "
                         f"'{PUBLISHER_TOKEN_METADATA_KEY}'; only the learner may publish")
        if isinstance(presented, bytes):
            presented = presented.decode("utf-8", "replace")
        if not hmac.compare_digest(presented.encode("utf-8", "replace"),
                                   self._publisher_token.encode()):
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                         f"Publish: wrong publisher token in metadata "
                         f"'{PUBLISHER_TOKEN_METADATA_KEY}'; only the learner may publish")

    def _check_newer(self, version: int, allow_current: bool = False) -> None:
        """FAILED_PRECONDITION unless `version` is newer than the visible one (needs the lock).

        allow_current: also accept the visible version itself (a republish that only refreshes
        dropped_total; its payload must then be identical, checked at commit).
        """
        if allow_current and self._versions and version == self._versions[-1].version:
            return
        if self._versions and version <= self._versions[-1].version:
            current = self._versions[-1].version
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"Publish version={version} is not newer than the current version "
                         f"{current}: versions must strictly increase; publish version > "
                         f"{current}")

    def _publish(self, request_iterator: Iterator[bytes],
                 context: grpc.ServicerContext) -> variables_pb2.PublishReply:
        start = time.monotonic()
        self._check_token(context)
        digest = _Sha256Behind()
        try:
            return self._receive_publish(request_iterator, digest, start)
        finally:
            digest.close()

    def _receive_publish(self, request_iterator: Iterator[bytes], digest: "_Sha256Behind",
                         start: float) -> variables_pb2.PublishReply:
        assembly: Optional[PayloadAssembler] = None
        crc = 0
        first: Optional[variables_pb2.PublishChunk] = None
        last: Optional[variables_pb2.PublishChunk] = None
        n_chunks = 0
        for raw in request_iterator:
            chunk, data = _parse_chunk(variables_pb2.PublishChunk, raw,
                                       f"PublishChunk #{n_chunks}")
            if last is not None:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"Publish: chunk #{n_chunks} arrived after the chunk with last=true; "
                             "end the stream after the last chunk")
            if first is None:
                first = chunk
                if chunk.version < 0:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"Publish version={chunk.version}: must be >= 0")
                if chunk.total_bytes < 0 or chunk.total_bytes > self._max_payload_bytes:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT if chunk.total_bytes < 0
                                 else grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"Publish total_bytes={chunk.total_bytes}: must be in "
                                 f"[0, max_payload_bytes={self._max_payload_bytes}] (set on the "
                                 "first chunk to the size of the whole payload)")
                if chunk.dropped_total < 0:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"Publish dropped_total={chunk.dropped_total}: must be >= 0")
                with self._lock:   # fail early, checked again at commit
                    self._check_newer(chunk.version, allow_current=True)
                assembly = PayloadAssembler(chunk.total_bytes, self._buffers)
            else:
                if chunk.version != first.version:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"Publish: chunk #{n_chunks} has version={chunk.version} but the "
                                 f"first chunk had version={first.version}; every chunk of one "
                                 "publish carries the same version")
                if chunk.total_bytes not in (0, first.total_bytes):
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"Publish: chunk #{n_chunks} has total_bytes={chunk.total_bytes} "
                                 f"but the first chunk said {first.total_bytes}")
            if assembly.received + data.nbytes > first.total_bytes:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"Publish: received {assembly.received + data.nbytes} bytes by chunk "
                             f"#{n_chunks}, more than total_bytes={first.total_bytes} announced "
                             "on the first chunk")
            assembly.add(data)
            digest.update(data)
            crc = wire.crc32(data, crc)
            n_chunks += 1
            if chunk.last:
                last = chunk
        if first is None:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         "Publish: the stream had no chunks; send at least one PublishChunk "
                         "with last=true")
        received = assembly.received
        if last is None:
            self._buffers.give(assembly.payload())
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"Publish version={first.version}: the stream ended after {n_chunks} "
                         f"chunks ({received} bytes) without a chunk with last=true; the "
                         "publish is incomplete and was discarded")
        if received != first.total_bytes:
            self._buffers.give(assembly.payload())
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"Publish version={first.version}: received {received} bytes but "
                         f"total_bytes={first.total_bytes}; the payload is truncated and was "
                         "discarded")
        problem = ""
        if not last.sha256 and not last.HasField("crc32"):
            problem = ("the last chunk has no sha256 and no crc32; set either to the checksum of "
                       "the whole payload (hex sha256, or zlib.crc32)")
        elif last.HasField("crc32") and last.crc32 != crc:
            problem = (f"crc32 mismatch (last chunk says {last.crc32:#010x}, payload has "
                       f"{crc:#010x}); the payload was corrupted in transit and was discarded")
        # The sha256 is the version's identity. After a verified CRC-32 (the transit check) the
        # version becomes visible while the helper thread finishes hashing, and Publish answers
        # once the digest is recorded; a claimed sha256, or a republish of the visible version
        # (compared by digest), needs the digest first.
        with self._lock:
            republish = bool(self._versions) and self._versions[-1].version == first.version
        actual = ""
        if not problem and (last.sha256 or republish):
            actual = digest.hexdigest()
            if last.sha256 and not hmac.compare_digest(last.sha256.lower().encode(),
                                                       actual.encode()):
                problem = (f"sha256 mismatch (last chunk says {last.sha256[:80]!r}, payload "
                           f"hashes to {actual}); the payload was corrupted in transit and was "
                           "discarded")
        if problem:
            self._buffers.give(assembly.payload())
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"Publish version={first.version}: {problem}")
        payload = memoryview(assembly.payload()).toreadonly()
        del assembly
        if self._validate_payload is not None:
            try:
                self._validate_payload(first.version, payload, first.format)
            except ValueError as e:
                self._buffers.give(payload.obj)
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"Publish version={first.version}: payload rejected: {e}; the "
                             "version was discarded") from None
        record = PublishedVersion(
            version=first.version, payload=payload, sha256=actual,
            format=first.format, dropped_total=first.dropped_total, publish_time=time.time(),
            crc32=crc)
        with self._lock:
            current = self._versions[-1] if self._versions else None
            if current is not None and current.version == record.version:
                # A republish of the visible version: the learner refreshing its admission
                # credit (e.g. during value pretraining, when the weights do not change).
                if not current.sha256 or not record.sha256:
                    raise _Abort(grpc.StatusCode.UNAVAILABLE,
                                 f"Publish version={record.version}: another Publish of this "
                                 "version is still being hashed; publish from one learner, one "
                                 "version at a time")
                if current.sha256 != record.sha256:
                    raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"Publish version={record.version} repeats the current version "
                                 "with a different payload; publish a newer version instead")
                self._versions[-1] = dataclasses.replace(current, dropped_total=max(
                    current.dropped_total, record.dropped_total))
                self._counters["republished"] = self._counters.get("republished", 0) + 1
                self._buffers.give(payload.obj)     # reusable once `record` is gone
                return variables_pb2.PublishReply(version=record.version,
                                                  num_bytes=record.num_bytes)
            self._check_newer(record.version)
            previous = self._versions[-1] if self._versions else None
            if previous is not None and record.dropped_total < previous.dropped_total:
                logging.warning("VariableServer: dropped_total went down from %d to %d with "
                                "version %d (learner restarted?); admission capacity shrinks",
                                previous.dropped_total, record.dropped_total, record.version)
            if len(self._versions) == self._versions.maxlen:
                # Evicted: its buffer receives a later version once no fetch streams it.
                self._buffers.give(self._versions[0].payload.obj)
            self._versions.append(record)             # the atomic swap
            self._counters["published"] += 1
        if not actual:                                # visible; clients may be fetching it
            actual = digest.hexdigest()
            with self._lock:
                for i, held in enumerate(self._versions):
                    if held.version == record.version and not held.sha256:
                        self._versions[i] = dataclasses.replace(held, sha256=actual)
        logging.info("VariableServer: published version %d (%d bytes, %d chunks, sha256 %s…) "
                     "in %.3f s", record.version, record.num_bytes, n_chunks, actual[:12],
                     time.monotonic() - start)
        return variables_pb2.PublishReply(version=record.version, num_bytes=record.num_bytes)

    # ------------------------------------------------------------------ reads

    def _latest_version(self, raw: bytes,
                        context: grpc.ServicerContext) -> variables_pb2.VersionInfo:
        _parse(variables_pb2.LatestVersionRequest, raw, "LatestVersionRequest")
        latest = self.latest()
        if latest is None:
            return variables_pb2.VersionInfo(version=-1)
        return variables_pb2.VersionInfo(version=latest.version, sha256=latest.sha256,
                                          num_bytes=latest.num_bytes,
                                          publish_time=latest.publish_time)

    def _fetch_weights(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Yields serialized WeightsChunk messages, each framed around a slice of the payload
        (wire.encode_chunk: one copy, into the bytes gRPC sends)."""
        request = _parse(variables_pb2.FetchRequest, raw, "FetchRequest")
        if request.chunk_bytes < 0:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"FetchWeights chunk_bytes={request.chunk_bytes}: must be >= 0 "
                         "(0 picks the server default)")
        max_chunk = self._max_message_bytes - MESSAGE_OVERHEAD_BYTES
        chunk_bytes = request.chunk_bytes or self._chunk_bytes
        chunk_bytes = max(MIN_FETCH_CHUNK_BYTES, min(chunk_bytes, max_chunk))
        with self._lock:
            if not self._versions:
                raise _Abort(grpc.StatusCode.UNAVAILABLE,
                             "FetchWeights: nothing has been published yet; poll LatestVersion "
                             "until version >= 0")
            if request.version < 0:
                record = self._versions[-1]
            else:
                record = next((v for v in self._versions if v.version == request.version), None)
                if record is None:
                    held = [v.version for v in self._versions]
                    raise _Abort(grpc.StatusCode.NOT_FOUND,
                                 f"FetchWeights version={request.version}: not held; the server "
                                 f"keeps versions {held}; ask for version=-1 (the newest)")
            self._counters["fetches"] += 1
        payload = record.payload
        total = payload.nbytes
        offset = 0
        first = variables_pb2.WeightsChunk(version=record.version, total_bytes=total,
                                           sha256=record.sha256, format=record.format,
                                           crc32=record.crc32).SerializeToString()
        head = variables_pb2.WeightsChunk(version=record.version).SerializeToString()
        while True:
            end = min(offset + chunk_bytes, total)
            yield wire.encode_chunk(first if offset == 0 else head, (payload[offset:end],))
            offset = end
            if offset >= total:
                break

    # ------------------------------------------------------------------ Admit

    def _capacity_locked(self) -> int:
        """AReaL's bound on rollouts started so far (needs the lock)."""
        latest = self._versions[-1] if self._versions else None
        version = max(latest.version, 0) if latest else 0
        dropped = latest.dropped_total if latest else 0
        return (version + self._max_staleness + 1) * self._batch_size + dropped

    def _admit(self, raw: bytes, context: grpc.ServicerContext) -> variables_pb2.AdmitReply:
        request = _parse(variables_pb2.AdmitRequest, raw, "AdmitRequest")
        if request.count <= 0:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"Admit count={request.count}: must be >= 1 (rollouts the actor wants "
                         "to start)")
        if len(request.actor_id) > MAX_ACTOR_ID_CHARS:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"Admit actor_id has {len(request.actor_id)} characters: must be at "
                         f"most {MAX_ACTOR_ID_CHARS}")
        if request.released < 0:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"Admit released={request.released}: must be >= 0 (admitted rollouts "
                         "the actor will never insert)")
        with self._lock:
            if request.released:
                # Slots of rollouts that will never arrive (refused by the writer, or lost with
                # a crashed actor): without them admission would shrink for good, and a run
                # with enough of them would wait forever.
                released = min(request.released, self._started_total)
                self._started_total -= released
                self._counters["released"] += released
            capacity = self._capacity_locked()
            if self._admission_control:
                granted = max(0, min(request.count, capacity - self._started_total))
            else:
                granted = request.count
            self._started_total += granted
            actor = request.actor_id
            if (actor not in self._started_by_actor
                    and len(self._started_by_actor) >= MAX_TRACKED_ACTORS):
                actor = "<other>"
            self._started_by_actor[actor] += granted
            version = self._versions[-1].version if self._versions else -1
            return variables_pb2.AdmitReply(granted=granted, policy_version=version,
                                             started_total=self._started_total,
                                             capacity=capacity)
