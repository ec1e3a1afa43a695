"""Clients of the variable server: the learner's publisher and the actors' variable client.

`VariablePublisher` streams a new policy version (opaque bytes, or a sequence of buffers such as
`ckpt.state_dict_to_buffers` gives, streamed without first joining them) in chunks with its
CRC-32.
`VariableClient` follows Acme's VariableClient: `update()` polls the server's newest version at
most every `update_period_s` and fetches new weights in a background thread, so the caller
(an actor's rollout loop) never blocks on it; `update_and_wait()` and `wait_for_version()` block.

Both hold only their address and settings until the first call, so they can be built in one
process and pickled into another (channels are created lazily, per process). Neither imports
torch: `decode` (e.g. safetensors bytes -> state dict) is supplied by the caller and must be
picklable (a module-level function) if the client is pickled.

This code copies weight bytes once on each side, gRPC's own copies aside (issue 8,
BENCHMARKS.md section 4): chunk messages are framed around slices of the payload, and their data
is located in the received bytes without protobuf's two copies (wire.py); a fetched version is
assembled into the buffer of a version the client dropped once nothing references that any more
(buffers.py), and checked against the server's CRC-32 (its sha256 when a server sends no CRC).
"""
from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import grpc
from absl import logging

from sao_actor_learner import core
from sao_actor_learner.protos_gen import variables_pb2, variables_pb2_grpc
from sao_actor_learner.variables import wire
from sao_actor_learner.variables.buffers import BufferPool, PayloadAssembler
from sao_actor_learner.variables.security import auth_interceptor, channel_credentials

PUBLISHER_TOKEN_METADATA_KEY = "x-sao-publisher-token"  # same as server.py (kept import-light)
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
# Transient failures: the server is not up yet, restarting, or a call ran out of time.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED)

Payload = Union[bytes, bytearray, memoryview]
# One buffer, or several streamed back to back as one payload (e.g. a safetensors header and
# then each tensor's bytes: ckpt.state_dict_to_buffers).
PublishPayload = Union[Payload, Sequence[Any]]
_SERVICE = "/" + variables_pb2.DESCRIPTOR.services_by_name["VariableService"].full_name


class VariableClientError(RuntimeError):
    """A variable-server call failed; `code` is the gRPC status code (None if not a gRPC error)."""

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None):
        super().__init__(message)
        self.code = code


class PublishError(VariableClientError):
    """The server refused or did not complete a publish."""


class _CorruptFetch(Exception):
    """A fetched payload failed verification (size, version or sha256)."""


@dataclasses.dataclass(frozen=True)
class VersionInfo:
    """The server's newest version: -1 and empty fields when nothing is published."""
    version: int
    sha256: str
    num_bytes: int
    publish_time: float


@dataclasses.dataclass(frozen=True)
class AdmitResult:
    """One admission decision (SAO.md section 6)."""
    granted: int
    policy_version: int
    started_total: int
    capacity: int


def _channel_options(max_message_bytes: int):
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Reconnect quickly when the server starts late or restarts (gRPC's default backs off
        # up to 120 s).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.enable_http_proxy", 0),
        *wire.BULK_TRANSFER_OPTIONS,
    ]


def _describe(e: grpc.RpcError) -> str:
    try:
        return f"{e.code().name}: {e.details()}"
    except Exception:  # noqa: BLE001 - not every RpcError is a Call
        return repr(e)


class _LazyChannel:
    """An address plus a channel made on first use in this process; pickles as the address."""

    _PICKLED_FIELDS: Tuple[str, ...] = ()

    def _init_channel(self, address: str, max_message_bytes: int, auth_token: str = "",
                      tls_root_cert: Optional[bytes] = None, tls_server_name: str = "") -> None:
        if not isinstance(address, str) or ":" not in address:
            raise ValueError(f"address={address!r}: must be 'host:port' (e.g. the server's "
                             "VariableServer.address)")
        self._address = address
        self._max_message_bytes = max_message_bytes
        # Security (security.py): the auth token goes with every call; TLS when a root
        # certificate is given (tls_server_name: the name the server's certificate carries,
        # when it is not the address's host).
        self.auth_token = auth_token
        self.tls_root_cert = tls_root_cert
        self.tls_server_name = tls_server_name
        self._channel: Optional[grpc.Channel] = None
        self._call_channel: Optional[grpc.Channel] = None   # with the auth interceptor
        self._stub: Optional[variables_pb2_grpc.VariableServiceStub] = None
        self._channel_lock = threading.Lock()
        self._closed = False

    @property
    def address(self) -> str:
        return self._address

    def _get_stub(self) -> variables_pb2_grpc.VariableServiceStub:
        with self._channel_lock:
            if self._closed:
                raise VariableClientError(f"{type(self).__name__}({self._address}) is closed")
            if self._stub is None:
                options = _channel_options(self._max_message_bytes)
                if self.tls_root_cert is not None:
                    if self.tls_server_name:
                        options.append(("grpc.ssl_target_name_override", self.tls_server_name))
                    self._channel = grpc.secure_channel(
                        self._address, channel_credentials(self.tls_root_cert), options=options)
                else:
                    self._channel = grpc.insecure_channel(self._address, options=options)
                channel = self._channel
                if self.auth_token:
                    channel = grpc.intercept_channel(channel, auth_interceptor(self.auth_token))
                self._call_channel = channel
                self._stub = variables_pb2_grpc.VariableServiceStub(channel)
            return self._stub

    def _get_channel(self) -> grpc.Channel:
        """The channel calls go through (with the auth token when there is one)."""
        self._get_stub()
        return self._call_channel

    def _close_channel(self) -> None:
        with self._channel_lock:
            self._closed = True
            channel, self._channel, self._stub = self._channel, None, None
            self._call_channel = None
        if channel is not None:
            channel.close()

    def __getstate__(self):
        return {k: getattr(self, k) for k in self._PICKLED_FIELDS}

    def __setstate__(self, state):
        self.__init__(**state)


class VariablePublisher(_LazyChannel):
    """The learner's side: publishes policy versions to a VariableServer.

    Args:
      address: "host:port" of the server.
      publisher_token: the server's publisher token ("" if the server has none).
      chunk_bytes: bytes of payload per streamed message; must stay below the server's
        max_message_bytes.
      format: payload format recorded with each version, e.g. "safetensors".
      max_message_bytes: gRPC message limit on this side.
      auth_token, tls_root_cert, tls_server_name: see security.py ("", None: off).
    """

    _PICKLED_FIELDS = ("address", "publisher_token", "chunk_bytes", "format",
                       "max_message_bytes", "auth_token", "tls_root_cert", "tls_server_name")

    def __init__(self, address: str, publisher_token: str, chunk_bytes: int = 1 << 20,
                 format: str = "safetensors",  # noqa: A002 - the proto field's name
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, auth_token: str = "",
                 tls_root_cert: Optional[bytes] = None, tls_server_name: str = ""):
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes}: must be >= 1")
        self._init_channel(address, max_message_bytes, auth_token, tls_root_cert,
                           tls_server_name)
        self.publisher_token = publisher_token
        self.chunk_bytes = chunk_bytes
        self.format = format

    @property
    def max_message_bytes(self) -> int:
        return self._max_message_bytes

    def _chunks(self, version: int, views: List[memoryview], total: int,
                dropped_total: int):
        """Serialized PublishChunks of `views` (one payload): each is the small fields plus a
        data field framed around slices of the views (one copy, into the bytes gRPC sends). The
        CRC-32 of the payload, computed on the way, goes in the last chunk."""
        crc = 0
        part, part_offset = 0, 0
        offset = 0
        while True:
            end = min(offset + self.chunk_bytes, total)
            slices = []
            need = end - offset
            while need:
                view = views[part]
                take = min(need, view.nbytes - part_offset)
                if take:
                    piece = view[part_offset:part_offset + take]
                    slices.append(piece)
                    crc = wire.crc32(piece, crc)
                    part_offset += take
                    need -= take
                if part_offset == view.nbytes:
                    part, part_offset = part + 1, 0
            head = variables_pb2.PublishChunk(version=version)
            if offset == 0:
                head.total_bytes = total
                head.format = self.format
                head.dropped_total = dropped_total
            if end >= total:
                head.crc32 = crc
                head.last = True
            yield wire.encode_chunk(head.SerializeToString(), slices)
            if end >= total:
                return
            offset = end

    def publish(self, version: int, payload: PublishPayload, dropped_total: int = 0,
                timeout_s: float = 120.0) -> int:
        """Streams `payload` as policy `version`; returns the version once the server holds it.

        `payload`: bytes-like, or a list/tuple of bytes-likes sent back to back as one payload
        (not copied first; they must not change until publish returns). Waits up to `timeout_s`
        for the server to come up. `dropped_total`: rollouts the learner has dropped so far
        (admission credit). Raises PublishError naming the cause.
        """
        if version < 0:
            raise ValueError(f"version={version}: must be >= 0")
        if dropped_total < 0:
            raise ValueError(f"dropped_total={dropped_total}: must be >= 0")
        parts = payload if isinstance(payload, (list, tuple)) else (payload,)
        try:
            views = [memoryview(p).cast("B") for p in parts]
        except TypeError as e:
            raise TypeError(f"publish payload: {e}; pass bytes, a bytearray, a memoryview or a "
                            "list of them") from None
        total = sum(v.nbytes for v in views)
        metadata = ((PUBLISHER_TOKEN_METADATA_KEY, self.publisher_token),) \
            if self.publisher_token else None
        start = time.monotonic()
        call = self._get_channel().stream_unary(
            f"{_SERVICE}/Publish", request_serializer=None,
            response_deserializer=variables_pb2.PublishReply.FromString)
        try:
            reply = call(self._chunks(version, views, total, dropped_total), timeout=timeout_s,
                         metadata=metadata, wait_for_ready=True)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            hint = ""
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                hint = f" (is the variable server running at {self._address}?)"
            elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                hint = (f" (chunk_bytes={self.chunk_bytes} may exceed the server's "
                        "max_message_bytes: lower chunk_bytes or raise max_message_bytes)")
            raise PublishError(f"publish of version {version} ({total} bytes) to "
                               f"{self._address} failed: {_describe(e)}{hint}", code) from None
        if reply.version != version or reply.num_bytes != total:
            raise PublishError(f"publish of version {version} ({total} bytes): the server "
                               f"acknowledged version {reply.version} with {reply.num_bytes} "
                               "bytes")
        logging.info("Published version %d (%d bytes) to %s in %.3f s", version, total,
                     self._address, time.monotonic() - start)
        return reply.version

    def close(self) -> None:
        """Closes the channel; the publisher cannot be used afterwards."""
        self._close_channel()


class VariableClient(_LazyChannel, core.VariableSource):
    """An actor's or evaluator's view of the newest policy on a VariableServer.

    Args:
      address: "host:port" of the server (it may not be listening yet).
      update_period_s: `update()` polls the server at most this often.
      decode: turns a fetched payload (a bytearray) into `params` (e.g. safetensors -> state
        dict); None keeps the payload itself. Runs in the fetching thread. The client never
        writes into a payload again while anything references it (or a view of it).
      fetch_chunk_bytes: chunk size asked of the server (0: the server's default).
      rpc_timeout_s: deadline of one LatestVersion/FetchWeights call.
      max_backoff_s: longest pause between polls while the server is unreachable.
      max_message_bytes: gRPC message limit on this side.
      auth_token, tls_root_cert, tls_server_name: see security.py ("", None: off).
    """

    _PICKLED_FIELDS = ("address", "update_period_s", "decode", "fetch_chunk_bytes",
                       "rpc_timeout_s", "max_backoff_s", "max_message_bytes", "auth_token",
                       "tls_root_cert", "tls_server_name")

    def __init__(self, address: str, update_period_s: float = 0.05,
                 decode: Optional[Callable[[bytes], Any]] = None, fetch_chunk_bytes: int = 0,
                 rpc_timeout_s: float = 60.0, max_backoff_s: float = 2.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, auth_token: str = "",
                 tls_root_cert: Optional[bytes] = None, tls_server_name: str = ""):
        if update_period_s <= 0:
            raise ValueError(f"update_period_s={update_period_s}: must be > 0")
        if fetch_chunk_bytes < 0:
            raise ValueError(f"fetch_chunk_bytes={fetch_chunk_bytes}: must be >= 0 (0 picks "
                             "the server default)")
        if rpc_timeout_s <= 0 or max_backoff_s <= 0:
            raise ValueError(f"rpc_timeout_s={rpc_timeout_s}, max_backoff_s={max_backoff_s}: "
                             "must be > 0")
        self._init_channel(address, max_message_bytes, auth_token, tls_root_cert,
                           tls_server_name)
        self.update_period_s = update_period_s
        self.decode = decode
        self.fetch_chunk_bytes = fetch_chunk_bytes
        self.rpc_timeout_s = rpc_timeout_s
        self.max_backoff_s = max_backoff_s

        self._state_lock = threading.Lock()     # guards version/params and the poll schedule
        self._fetch_lock = threading.Lock()     # one check-and-fetch at a time
        self._version = -1
        self._params: Any = None
        self._payload: Optional[bytearray] = None   # the held version's bytes (before decode)
        self._buffers = BufferPool(max_spares=1)    # a dropped payload's buffer, for reuse
        self._sha256 = ""
        self._next_check = 0.0                  # time.monotonic() of the next allowed poll
        self._backoff_s = 0.0
        self._thread: Optional[threading.Thread] = None
        self._warned_older = -1
        self.last_error: Optional[str] = None   # the latest background failure (None: none yet)

    @property
    def max_message_bytes(self) -> int:
        return self._max_message_bytes

    # ------------------------------------------------------------------ state

    @property
    def version(self) -> int:
        """Version of the held params; -1 before the first successful fetch."""
        with self._state_lock:
            return self._version

    @property
    def params(self) -> Any:
        """The held params: `decode(payload)`, or the raw bytes without `decode`; None before
        the first fetch."""
        with self._state_lock:
            return self._params

    def get_variables(self) -> Tuple[int, Any]:
        """(version, params), read together (core.VariableSource)."""
        with self._state_lock:
            return self._version, self._params

    # ------------------------------------------------------------------ updating

    def update(self, wait: bool = False) -> None:
        """Acme semantics: starts a background check-and-fetch if `update_period_s` has passed
        since the last poll (and none is running); returns at once. `wait=True` is
        `update_and_wait()`."""
        if wait:
            self.update_and_wait()
            return
        if self._closed:
            raise VariableClientError(f"VariableClient({self._address}) is closed")
        now = time.monotonic()
        with self._state_lock:
            if self._thread is not None and self._thread.is_alive():
                return
            if now < self._next_check:
                return
            self._next_check = now + self.update_period_s
            self._thread = threading.Thread(target=self._background_update, daemon=True,
                                            name="variable-client-update")
            self._thread.start()

    def _background_update(self) -> None:
        try:
            self._check_and_fetch(timeout_s=self.rpc_timeout_s, wait_for_ready=False)
            with self._state_lock:
                self._backoff_s = 0.0
        except Exception as e:  # noqa: BLE001 - RpcError, _CorruptFetch, a failing decode, ...
            if self._closed:
                return
            message = _describe(e) if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}"
            self.last_error = message
            retryable = isinstance(e, grpc.RpcError) and e.code() in _RETRYABLE
            with self._state_lock:
                self._backoff_s = min(self.max_backoff_s,
                                      max(2 * self._backoff_s, self.update_period_s))
                self._next_check = max(self._next_check, time.monotonic() + self._backoff_s)
                backoff = self._backoff_s
            if retryable:
                logging.log_every_n_seconds(
                    logging.INFO, "VariableClient: server %s not reachable (%s); retrying in "
                    "%.2f s", 10, self._address, message, backoff)
            else:
                logging.warning("VariableClient: update from %s failed: %s; retrying in %.2f s",
                                self._address, message, backoff)

    def _check_and_fetch(self, timeout_s: float, wait_for_ready: bool) -> bool:
        """Polls LatestVersion; fetches, verifies and decodes a newer version. True if updated.

        Raises grpc.RpcError on transport errors and _CorruptFetch when the payload fails
        verification (nothing is kept then)."""
        deadline = time.monotonic() + timeout_s
        if not self._fetch_lock.acquire(timeout=timeout_s):
            raise VariableClientError(f"VariableClient: another fetch from {self._address} took "
                                      f"longer than {timeout_s} s",
                                      grpc.StatusCode.DEADLINE_EXCEEDED)
        try:
            stub = self._get_stub()
            info = stub.LatestVersion(variables_pb2.LatestVersionRequest(),
                                      timeout=max(deadline - time.monotonic(), 0.001),
                                      wait_for_ready=wait_for_ready)
            current = self.version
            if info.version < 0 or info.version <= current:
                if 0 <= info.version < current and self._warned_older != info.version:
                    self._warned_older = info.version
                    logging.warning("VariableClient: server %s reports version %d, older than "
                                    "the held %d (server restarted?); keeping %d until a newer "
                                    "one is published", self._address, info.version, current,
                                    current)
                return False
            version, payload, sha256 = self._fetch(wait_for_ready, deadline)
            params = self.decode(payload) if self.decode is not None else payload
            with self._state_lock:
                if version <= self._version:
                    self._buffers.give(payload)
                    return False
                previous = self._payload
                self._version, self._params, self._sha256 = version, params, sha256
                self._payload = payload
            # Reused for a later version once nothing references it (buffers.py).
            self._buffers.give(previous)
            logging.log_every_n_seconds(logging.INFO, "VariableClient: now at version %d "
                                        "(%d bytes) from %s", 10, version, len(payload),
                                        self._address)
            return True
        finally:
            self._fetch_lock.release()

    def _fetch(self, wait_for_ready: bool, deadline: float,
               version: int = -1) -> Tuple[int, bytearray, str]:
        """Streams the newest version (or `version` >= 0) and verifies size, version and
        checksum (the server's CRC-32; its sha256 when it sends no CRC). Returns (version,
        payload, sha256 the server gave)."""
        stream = self._get_channel().unary_stream(
            f"{_SERVICE}/FetchWeights",
            request_serializer=variables_pb2.FetchRequest.SerializeToString,
            response_deserializer=None)(
                variables_pb2.FetchRequest(version=version, chunk_bytes=self.fetch_chunk_bytes),
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
                raise _CorruptFetch(f"malformed WeightsChunk ({len(raw)} bytes): {e}") from None
            if version is None:
                version, claimed_sha = chunk.version, chunk.sha256
                claimed_crc = chunk.crc32 if chunk.HasField("crc32") else None
                if claimed_crc is None:
                    digest = hashlib.sha256()
                assembly = PayloadAssembler(chunk.total_bytes, self._buffers)
            elif chunk.version != version:
                stream.cancel()
                raise _CorruptFetch(f"chunk of version {chunk.version} inside a stream of "
                                    f"version {version}")
            if assembly.received + data.nbytes > assembly.total:
                stream.cancel()
                raise _CorruptFetch(f"version {version}: more than the announced "
                                    f"{assembly.total} bytes")
            assembly.add(data)
            if digest is not None:
                digest.update(data)
            else:
                crc = wire.crc32(data, crc)
        if version is None:
            raise _CorruptFetch("FetchWeights returned no chunks")
        payload = assembly.payload()
        if assembly.received != assembly.total:
            raise _CorruptFetch(f"version {version}: got {assembly.received} of "
                                f"{assembly.total} bytes")
        if digest is not None and digest.hexdigest() != claimed_sha.lower():
            self._buffers.give(payload)
            raise _CorruptFetch(f"version {version}: sha256 {digest.hexdigest()} does not match "
                                f"the server's {claimed_sha!r}; discarded")
        if digest is None and crc != claimed_crc:
            self._buffers.give(payload)
            raise _CorruptFetch(f"version {version}: CRC-32 {crc:#010x} does not match the "
                                f"server's {claimed_crc:#010x}; discarded")
        return version, payload, claimed_sha.lower()

    def _join_background(self, timeout_s: float) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(timeout_s, 0.0))

    def update_and_wait(self, timeout_s: float = 60.0) -> int:
        """Blocks until the server's newest version is held (waiting up to `timeout_s` for the
        server to be reachable); returns the held version (-1 if nothing is published)."""
        deadline = time.monotonic() + timeout_s
        self._join_background(deadline - time.monotonic())
        last = ""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"VariableClient.update_and_wait: no answer from "
                                   f"{self._address} within {timeout_s} s ({last}); is the "
                                   "variable server running?")
            try:
                self._check_and_fetch(timeout_s=min(remaining, self.rpc_timeout_s),
                                      wait_for_ready=True)
                return self.version
            except _CorruptFetch as e:
                last = str(e)
                logging.warning("VariableClient: %s; fetching again", e)
            except grpc.RpcError as e:
                last = _describe(e)
                if e.code() not in _RETRYABLE:
                    raise VariableClientError(f"VariableClient: update from {self._address} "
                                              f"failed: {last}", e.code()) from None
                time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))

    def wait_for_version(self, min_version: int, timeout_s: float = 60.0) -> int:
        """Blocks until a version >= `min_version` is held; returns it. Raises TimeoutError."""
        deadline = time.monotonic() + timeout_s
        self._join_background(deadline - time.monotonic())
        last = ""
        while True:
            current = self.version
            if current >= min_version:
                return current
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"VariableClient.wait_for_version: no version >= "
                                   f"{min_version} from {self._address} within {timeout_s} s "
                                   f"(holding {current}; {last or 'server has none newer'})")
            try:
                if self._check_and_fetch(timeout_s=min(remaining, self.rpc_timeout_s),
                                         wait_for_ready=True):
                    continue
                last = ""
            except _CorruptFetch as e:
                last = str(e)
                logging.warning("VariableClient: %s; fetching again", e)
            except grpc.RpcError as e:
                last = _describe(e)
                if e.code() not in _RETRYABLE:
                    raise VariableClientError(f"VariableClient: update from {self._address} "
                                              f"failed: {last}", e.code()) from None
            time.sleep(min(self.update_period_s, max(deadline - time.monotonic(), 0)))

    def fetch_version(self, version: int, timeout_s: float = 60.0) -> Any:
        """The params of one specific (older) version the server still keeps; the held version
        is not changed. Used by actors that run an older policy on purpose (forced staleness).
        Raises VariableClientError when the server no longer keeps `version`."""
        if version < 0:
            raise ValueError(f"version={version}: must be >= 0")
        deadline = time.monotonic() + timeout_s
        try:
            got, payload, _ = self._fetch(True, deadline, version=version)
        except grpc.RpcError as e:
            raise VariableClientError(f"FetchWeights(version={version}) from {self._address} "
                                      f"failed: {_describe(e)}", e.code()) from None
        except _CorruptFetch as e:
            raise VariableClientError(f"FetchWeights(version={version}): {e}") from None
        if got != version:
            raise VariableClientError(f"FetchWeights(version={version}) returned version {got}")
        return self.decode(payload) if self.decode is not None else payload

    def latest_info(self, timeout_s: float = 10.0) -> VersionInfo:
        """The server's newest version (one LatestVersion call; waits for the server)."""
        try:
            info = self._get_stub().LatestVersion(variables_pb2.LatestVersionRequest(),
                                                  timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as e:
            raise VariableClientError(f"LatestVersion from {self._address} failed: "
                                      f"{_describe(e)}", e.code()) from None
        return VersionInfo(info.version, info.sha256, info.num_bytes, info.publish_time)

    # ------------------------------------------------------------------ admission

    def admit_details(self, actor_id: str, count: int = 1, timeout_s: float = 30.0,
                      released: int = 0) -> AdmitResult:
        """Asks to start `count` rollouts; returns the full decision (waits for the server).

        released: rollouts admitted earlier that will never be inserted (refused by the writer,
        lost with a crashed actor); the server returns their slots first."""
        if count < 1:
            raise ValueError(f"count={count}: must be >= 1 (rollouts to start)")
        if released < 0:
            raise ValueError(f"released={released}: must be >= 0")
        try:
            reply = self._get_stub().Admit(
                variables_pb2.AdmitRequest(actor_id=str(actor_id), count=count,
                                           released=released),
                timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as e:
            raise VariableClientError(f"Admit(actor_id={actor_id!r}, count={count}) at "
                                      f"{self._address} failed: {_describe(e)}",
                                      e.code()) from None
        return AdmitResult(reply.granted, reply.policy_version, reply.started_total,
                           reply.capacity)

    def admit(self, actor_id: str, count: int = 1, timeout_s: float = 30.0) -> int:
        """How many of `count` rollouts the actor may start now (0..count)."""
        return self.admit_details(actor_id, count, timeout_s).granted

    def close(self) -> None:
        """Closes the channel (cancelling a background fetch); the client is unusable after."""
        self._close_channel()
        self._join_background(1.0)
