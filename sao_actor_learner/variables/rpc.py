"""gRPC plumbing of the variable server: request parsing, token checks, binding.

Every request is parsed by hand from raw bytes, so that a malformed message gets an
INVALID_ARGUMENT naming what was wrong (gRPC's default answer is a bare INTERNAL). Handlers
raise `Abort` to answer with a status; the server turns it into `context.abort`.
"""
from __future__ import annotations

import hmac
from concurrent import futures
from typing import Optional, Tuple

import grpc
from google.protobuf import message as pb_message

from sao_actor_learner.variables import wire
from sao_actor_learner.variables.security import (AUTH_TOKEN_METADATA_KEY,
                                                  PUBLISHER_TOKEN_METADATA_KEY, server_credentials)


class Abort(Exception):
    """Raised inside a handler to answer with `code` and `details`."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


def _malformed(message_cls, n: int, what: str, error: Exception) -> Abort:
    return Abort(grpc.StatusCode.INVALID_ARGUMENT,
                 f"malformed {what}: could not parse {n} bytes as "
                 f"{message_cls.DESCRIPTOR.full_name} ({error}); send a serialized "
                 f"{message_cls.DESCRIPTOR.name}")


def parse(message_cls, data: bytes, what: str):
    """Parses raw request bytes; malformed bytes become INVALID_ARGUMENT naming `what`."""
    msg = message_cls()
    try:
        msg.ParseFromString(data)
    except (pb_message.DecodeError, RuntimeError, ValueError, TypeError) as e:
        raise _malformed(message_cls, len(data), what, e) from None
    return msg


def parse_chunk(message_cls, raw: bytes, what: str):
    """(message without data, zero-copy view of its data) of a chunk message; malformed bytes
    become INVALID_ARGUMENT naming `what`."""
    try:
        rest, data = wire.split_data_field(raw)
    except wire.MalformedMessage as e:
        raise _malformed(message_cls, len(raw), what, e) from None
    return parse(message_cls, rest, what), data


def metadata_value(context: grpc.ServicerContext, key: str):
    """The call's last metadata value under `key` as str, or None."""
    presented = None
    for k, value in context.invocation_metadata() or ():
        if k == key:
            presented = value
    if isinstance(presented, bytes):
        presented = presented.decode("utf-8", "replace")
    return presented


def same_secret(presented: str, secret: str) -> bool:
    """Constant-time comparison of a presented token with the secret."""
    return hmac.compare_digest(presented.encode("utf-8", "replace"), secret.encode())


def check_publisher(context: grpc.ServicerContext, token: str, method: str) -> None:
    """PERMISSION_DENIED unless the call carries the publisher token ("": no check)."""
    if not token:
        return
    presented = metadata_value(context, PUBLISHER_TOKEN_METADATA_KEY)
    if presented is None:
        raise Abort(grpc.StatusCode.PERMISSION_DENIED,
                    f"{method} needs the publisher token in metadata "
                    f"'{PUBLISHER_TOKEN_METADATA_KEY}'; only the learner may call it")
    if not same_secret(presented, token):
        raise Abort(grpc.StatusCode.PERMISSION_DENIED,
                    f"{method}: wrong publisher token in metadata "
                    f"'{PUBLISHER_TOKEN_METADATA_KEY}'; only the learner may call it")


def check_auth(context: grpc.ServicerContext, token: str) -> None:
    """UNAUTHENTICATED unless the call carries the auth token ("": no check)."""
    if not token:
        return
    presented = metadata_value(context, AUTH_TOKEN_METADATA_KEY)
    if presented is None:
        raise Abort(grpc.StatusCode.UNAUTHENTICATED,
                    f"this server needs the auth token in metadata '{AUTH_TOKEN_METADATA_KEY}' "
                    "on every call (--auth_token or SAO_AUTH_TOKEN)")
    if not same_secret(presented, token):
        raise Abort(grpc.StatusCode.UNAUTHENTICATED,
                    f"wrong auth token in metadata '{AUTH_TOKEN_METADATA_KEY}'")


def serve(handler: grpc.GenericRpcHandler, host: str, port: int,
          tls: Optional[Tuple[bytes, bytes]], max_workers: int,
          max_message_bytes: int) -> Tuple[grpc.Server, int]:
    """(started server, bound port) serving `handler` on host:port (TLS only with `tls`: the
    PEM certificate chain and private key). RuntimeError when the port cannot be bound."""
    options = [("grpc.max_send_message_length", max_message_bytes),
               ("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.so_reuseport", 0), *wire.BULK_TRANSFER_OPTIONS]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="variable-server"),
                         options=options, maximum_concurrent_rpcs=8 * max_workers)
    server.add_generic_rpc_handlers((handler,))
    target = f"{host}:{port}"
    try:
        bound = server.add_secure_port(target, server_credentials(*tls)) if tls is not None \
            else server.add_insecure_port(target)
    except RuntimeError as e:
        raise RuntimeError(f"VariableServer could not bind {target} ({e}): pick another port "
                           "or pass port=0") from e
    if not bound:
        raise RuntimeError(f"VariableServer could not bind {target}: the port is in use or the "
                           "host is not local; pick another port or pass port=0")
    server.start()
    return server, bound
