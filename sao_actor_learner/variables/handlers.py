"""The gRPC surface of the variable server (variables/server.py holds the handlers): its
method table, and the parsing of the requests that need more checks than rpc.parse makes.

Every method takes raw request bytes (parsed by hand, rpc.py) and runs behind the auth check;
an `Abort` it raises goes to the server's `on_reject` (which counts it and answers with its
status), and any other exception becomes INTERNAL: a bug must not take the server down.
"""
from __future__ import annotations

from typing import Callable, Dict

import grpc
from absl import logging

from sao_actor_learner.protos_gen import variables_pb2
from sao_actor_learner.variables.progress import MAX_ACKS, Progress, make_progress
from sao_actor_learner.variables.rpc import Abort, check_auth, parse

SERVICE_NAME = variables_pb2.DESCRIPTOR.services_by_name["VariableService"].full_name
MAX_ACTOR_ID_CHARS = 256
_INVALID = grpc.StatusCode.INVALID_ARGUMENT

# on_reject(method, context, abort): counts and logs the refusal, then aborts the call.
OnReject = Callable[[str, grpc.ServicerContext, Abort], None]


def method_handlers(unary: Dict[str, Callable], publish: Callable, fetch_weights: Callable,
                    auth_token: str, on_reject: OnReject) -> grpc.GenericRpcHandler:
    """The service's handlers: `unary` (method name -> fn(raw, context) returning a reply
    message), Publish (fn(chunks, context), a stream of raw chunks in) and FetchWeights
    (fn(raw, context), yielding framed bytes), each guarded (see the module doc)."""
    ser = lambda m: m.SerializeToString()  # noqa: E731
    handlers = {name: grpc.unary_unary_rpc_method_handler(
                    guard(fn, name, auth_token, on_reject), response_serializer=ser)
                for name, fn in unary.items()}
    handlers["Publish"] = grpc.stream_unary_rpc_method_handler(
        guard(publish, "Publish", auth_token, on_reject), response_serializer=ser)
    handlers["FetchWeights"] = grpc.unary_stream_rpc_method_handler(  # yields framed bytes
        guard(fetch_weights, "FetchWeights", auth_token, on_reject, stream=True))
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def guard(fn: Callable, method: str, auth_token: str, on_reject: OnReject,
          stream: bool = False) -> Callable:
    """`fn` behind the auth check; an Abort goes to `on_reject`, any other exception becomes
    INTERNAL (a bug must not take the server down)."""
    def internal(context, e):
        logging.exception("VariableServer: internal error in %s", method)
        context.abort(grpc.StatusCode.INTERNAL,
                      f"internal error in {method}: {type(e).__name__}: {e}")

    def unary(request, context):
        try:
            check_auth(context, auth_token)
            return fn(request, context)
        except Abort as e:
            on_reject(method, context, e)
        except Exception as e:  # noqa: BLE001
            if not context.is_active():
                raise
            internal(context, e)

    def streaming(request, context):
        try:
            check_auth(context, auth_token)
            yield from fn(request, context)
        except Abort as e:
            on_reject(method, context, e)
        except Exception as e:  # noqa: BLE001
            if context.is_active():
                internal(context, e)
    return streaming if stream else unary


def parse_admit_request(raw: bytes) -> variables_pb2.AdmitRequest:
    """An AdmitRequest from raw bytes; Abort (INVALID_ARGUMENT) naming what was wrong."""
    request = parse(variables_pb2.AdmitRequest, raw, "AdmitRequest")
    if len(request.actor_id) > MAX_ACTOR_ID_CHARS:
        raise Abort(_INVALID, f"Admit actor_id has {len(request.actor_id)} characters: must "
                    f"be at most {MAX_ACTOR_ID_CHARS}")
    return request


def parse_progress_report(raw: bytes) -> Progress:
    """The progress report of a raw ProgressReport (progress.make_progress); Abort
    (INVALID_ARGUMENT) naming what was wrong: too many acks, an actor named twice, a number
    out of range."""
    request = parse(variables_pb2.ProgressReport, raw, "ProgressReport")
    if len(request.acks) > MAX_ACKS:
        raise Abort(_INVALID, f"ReportProgress has {len(request.acks)} acks: at most "
                    f"{MAX_ACKS} actors per report")
    acks = {}
    for ack in request.acks:
        if ack.actor_id in acks:
            raise Abort(_INVALID, f"ReportProgress names actor_id={ack.actor_id} twice; "
                        "send one ActorAck per actor")
        acks[ack.actor_id] = (ack.watermark, ack.seqs)
    try:
        return make_progress(request.version, request.dropped_total, request.trained_total,
                             request.loss_epoch, acks)
    except ValueError as e:
        raise Abort(_INVALID, f"ReportProgress {e}") from None
