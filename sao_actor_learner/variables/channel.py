"""What the variable server's clients share: a lazily made channel, errors, retryable codes.

A client holds only its address and settings until its first call, so it can be built in one
process and pickled into another: the channel is made on first use, per process, and pickles
as the fields in `_PICKLED_FIELDS`.
"""
from __future__ import annotations

import threading
from typing import Optional, Tuple

import grpc

from sao_actor_learner.core_values import VersionConflict
from sao_actor_learner.protos_gen import variables_pb2, variables_pb2_grpc
from sao_actor_learner.variables import wire
from sao_actor_learner.variables.security import auth_interceptor, channel_credentials

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
# Transient failures: the server is not up yet, restarting, or a call ran out of time. A caller
# may retry these; any other code is a refusal that a retry would meet again.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED)
SERVICE = "/" + variables_pb2.DESCRIPTOR.services_by_name["VariableService"].full_name


class VariableClientError(RuntimeError):
    """A variable-server call failed; `code` is the gRPC status code (None if not a gRPC error)."""

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None):
        super().__init__(message)
        self.code = code

    @property
    def retryable(self) -> bool:
        """The server was unreachable or slow (e.g. restarting): the same call may succeed."""
        return self.code in RETRYABLE


class PublishError(VariableClientError):
    """The server refused or did not complete a publish."""


class PublishConflictError(PublishError, VersionConflict):
    """The server refused a publish of a version it holds, or of an older one
    (FAILED_PRECONDITION): core.VersionConflict."""


def channel_options(max_message_bytes: int):
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


def describe(e: grpc.RpcError) -> str:
    try:
        return f"{e.code().name}: {e.details()}"
    except Exception:  # noqa: BLE001 - not every RpcError is a Call
        return repr(e)


class LazyChannel:
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
                options = channel_options(self._max_message_bytes)
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

    def _unary(self, method: str, request, timeout_s: float, what: str, metadata=None):
        """One unary call (waiting up to `timeout_s` for the server to be reachable); gRPC
        errors become VariableClientError(code) naming `what`."""
        try:
            return getattr(self._get_stub(), method)(request, timeout=timeout_s,
                                                     metadata=metadata, wait_for_ready=True)
        except grpc.RpcError as e:
            raise VariableClientError(f"{what} at {self._address} failed: {describe(e)}",
                                      e.code()) from None
