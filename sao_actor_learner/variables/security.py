"""Keeping strangers out of the variable server: a shared secret, bind rules, TLS, and a check of
every published payload before any client can fetch it.

- Auth token: when a `VariableServer` has an `auth_token`, every call (Publish, LatestVersion,
  FetchWeights, Admit, ReportProgress, Acknowledged) must carry it in metadata `x-sao-auth-token`, else it is answered
  UNAUTHENTICATED before its request is read. Clients send it on every call. The program takes
  it from `--auth_token` or the environment variable SAO_AUTH_TOKEN (`resolve_auth_token`); it
  is never written to config.json.
- Publish and ReportProgress need, in addition, the learner token (`x-sao-publisher-token`),
  held by the variable server and the learner alone, never by actors or the evaluator: made
  per launch, or $SAO_LEARNER_TOKEN when the learner and the variable server are launched
  separately (credentials.py). It must differ from the auth token.
- Binding: services bind 127.0.0.1 unless told otherwise; binding any other address without an
  auth token is refused (`check_bind`), because then anyone on the network could call them,
  and so is binding it without TLS unless `insecure_transport` says the network is trusted
  (the tokens would travel in clear text).
- TLS: with a certificate and key the server listens with TLS only; clients then trust that
  certificate (or a CA's) as their root (`server_credentials`, `channel_credentials`).
- Payload check: `SafetensorsValidator` parses a safetensors payload's header (no torch: the
  variable server never imports it) and refuses a version whose tensor names, dtypes or shapes
  differ from the expected manifest (given, or pinned from the first version published), whose
  data offsets do not tile the buffer exactly (a truncated or padded stream), or, optionally,
  which holds NaN or infinite floats. The sha256 of the whole payload is checked before it.

Reverb (the replay node) has no authentication and listens on all interfaces whatever it is
told: on a shared network, firewall its port.
"""
from __future__ import annotations

import json
import os
import struct
import threading
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from sao_actor_learner.launch.addresses import is_loopback  # noqa: F401 (the one rule)

AUTH_TOKEN_METADATA_KEY = "x-sao-auth-token"
# Publish and ReportProgress also need the per-launch publisher token, held by the learner only.
PUBLISHER_TOKEN_METADATA_KEY = "x-sao-publisher-token"
AUTH_TOKEN_ENV = "SAO_AUTH_TOKEN"
MIN_AUTH_TOKEN_CHARS = 16
# A safetensors header larger than this is refused (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100 << 20

# safetensors dtype names -> numpy dtypes (for the optional finiteness check) and item sizes.
_DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
                "BOOL": 1}
# Non-finite floats, found from the bits (exact, no float arithmetic, no temporaries): for an IEEE
# dtype whose exponent field is mask E, x is NaN or infinite exactly when its exponent bits are all
# ones, i.e. (as a signed integer) x >= E for a positive x, and (as an unsigned integer) x >=
# sign | E for a negative one. So two max reductions decide it: max(signed) >= E or
# max(unsigned) >= sign | E. dtype -> (signed view, unsigned view, E, sign | E).
_NONFINITE_BOUNDS = {
    "BF16": (np.int16, np.uint16, 0x7F80, 0xFF80),
    "F16": (np.int16, np.uint16, 0x7C00, 0xFC00),
    "F32": (np.int32, np.uint32, 0x7F800000, 0xFF800000),
    "F64": (np.int64, np.uint64, 0x7FF0000000000000, 0xFFF0000000000000),
}
_FLOAT_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16}

Manifest = Dict[str, Tuple[str, Tuple[int, ...]]]   # tensor name -> (dtype, shape)


def resolve_auth_token(token: Optional[str] = None) -> str:
    """`token` when given (not None), else $SAO_AUTH_TOKEN, else "" (no token)."""
    if token is not None:
        return token
    return os.environ.get(AUTH_TOKEN_ENV, "")


def check_bind(host: str, auth_token: str, what: str = "a service", tls: bool = False,
               insecure_transport: bool = False) -> None:
    """Raises ValueError when `host` is not a loopback address and there is no usable token, or
    no TLS (`tls`) while `insecure_transport` is False: the tokens would cross the network in
    clear text."""
    if is_loopback(host):
        return
    if not auth_token:
        raise ValueError(
            f"bind_host={host!r}: binding {what} to a non-loopback address needs an auth token "
            f"(--auth_token or ${AUTH_TOKEN_ENV}), else anyone on the network may call it; set "
            "one, or bind 127.0.0.1")
    if len(auth_token) < MIN_AUTH_TOKEN_CHARS:
        raise ValueError(
            f"the auth token has {len(auth_token)} characters: use at least "
            f"{MIN_AUTH_TOKEN_CHARS} random ones (e.g. `python -c 'import secrets; "
            "print(secrets.token_hex(16))'`) when binding a non-loopback address")
    if not tls and not insecure_transport:
        raise ValueError(
            f"bind_host={host!r} without TLS: {what} would receive the auth token and the "
            "learner token in clear text, readable by anyone on the network path (who could "
            "then fetch weights, or with the learner token publish them); give --tls_cert and "
            "--tls_key (a certificate for this address), or pass --insecure_transport on a "
            "network you trust")


def read_file_bytes(path: str, what: str) -> bytes:
    """The bytes of `path`; FileNotFoundError naming what it should hold."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path!r} does not exist (a PEM file)")
    with open(path, "rb") as f:
        return f.read()


def server_credentials(cert_chain: bytes, private_key: bytes):
    """gRPC TLS credentials of a server from PEM bytes."""
    import grpc
    return grpc.ssl_server_credentials([(private_key, cert_chain)])


def channel_credentials(root_cert: bytes):
    """gRPC TLS credentials of a client that trusts `root_cert` (PEM bytes)."""
    import grpc
    return grpc.ssl_channel_credentials(root_certificates=root_cert)


def auth_interceptor(auth_token: str):
    """A gRPC client interceptor that adds the auth token to the metadata of every call."""
    import grpc

    class _Details(grpc.ClientCallDetails):
        def __init__(self, details, metadata):
            self.method = details.method
            self.timeout = details.timeout
            self.metadata = metadata
            self.credentials = details.credentials
            self.wait_for_ready = getattr(details, "wait_for_ready", None)
            self.compression = getattr(details, "compression", None)

    class _AuthInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                           grpc.StreamUnaryClientInterceptor,
                           grpc.StreamStreamClientInterceptor):
        def _with_token(self, details):
            metadata = [m for m in (details.metadata or ()) if m[0] != AUTH_TOKEN_METADATA_KEY]
            return _Details(details, metadata + [(AUTH_TOKEN_METADATA_KEY, auth_token)])

        def intercept_unary_unary(self, continuation, details, request):
            return continuation(self._with_token(details), request)

        def intercept_unary_stream(self, continuation, details, request):
            return continuation(self._with_token(details), request)

        def intercept_stream_unary(self, continuation, details, request_iterator):
            return continuation(self._with_token(details), request_iterator)

        def intercept_stream_stream(self, continuation, details, request_iterator):
            return continuation(self._with_token(details), request_iterator)

    return _AuthInterceptor()


class PayloadRejected(ValueError):
    """A published payload failed validation; the message says what is wrong."""


def safetensors_manifest(payload) -> Manifest:
    """{name: (dtype, shape)} of a safetensors payload, after checking its layout.

    Raises PayloadRejected when the header is missing, not JSON, names an unknown dtype, or when
    the tensors' data offsets do not tile the data section exactly.
    """
    view = memoryview(payload).cast("B")
    header, data_start = _header(view)
    manifest: Manifest = {}
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise PayloadRejected(f"tensor {name!r}: header entry {str(entry)[:100]!r} lacks "
                                  "dtype, shape or data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _DTYPE_SIZES:
            raise PayloadRejected(f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise PayloadRejected(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise PayloadRejected(f"tensor {name!r}: data_offsets {offsets!r} are invalid")
        expected = _DTYPE_SIZES[dtype] * int(np.prod(shape, dtype=np.int64))
        if offsets[1] - offsets[0] != expected:
            raise PayloadRejected(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes of data for "
                                  f"{dtype}{tuple(shape)}, which needs {expected}")
        manifest[name] = (dtype, tuple(shape))
        spans.append((offsets[0], offsets[1], name))
    data_bytes = view.nbytes - data_start
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise PayloadRejected(f"tensor {name!r} starts at byte {begin} of the data, expected "
                                  f"{position}: tensors overlap or leave a gap")
        position = end
    if position != data_bytes:
        raise PayloadRejected(f"the tensors cover {position} bytes but the payload carries "
                              f"{data_bytes} bytes of data: truncated or padded")
    if not manifest:
        raise PayloadRejected("the payload holds no tensors")
    return manifest


def has_nonfinite(data, dtype: str) -> bool:
    """Whether `data` (a bytes-like of whole `dtype` items: a safetensors dtype name) holds a NaN
    or an infinity; False for dtypes other than BF16/F16/F32/F64. Exact. BF16 (no numpy dtype):
    two max reductions over the bits (_NONFINITE_BOUNDS), ~5x a masked compare in numpy;
    F16/F32/F64: a sum, and the bits only when the sum is not finite."""
    bounds = _NONFINITE_BOUNDS.get(dtype)
    if bounds is None:
        return False
    if dtype in _FLOAT_NUMPY:
        # numpy sums floats faster than it takes integer maxima: a sum is finite only when every
        # value is (NaN and infinities propagate); one that is not (or merely overflowed) is
        # settled by the exact check below. F16 is summed in F32, which cannot overflow here.
        floats = np.frombuffer(data, dtype=_FLOAT_NUMPY[dtype])
        with np.errstate(over="ignore", invalid="ignore"):
            total = floats.sum(dtype=np.float32 if dtype == "F16" else None)
        if np.isfinite(total):
            return False
    signed, unsigned, positive, negative = bounds
    values = np.frombuffer(data, dtype=signed)
    if values.size == 0:
        return False
    return int(values.max()) >= positive or int(values.view(unsigned).max()) >= negative


def safetensors_header(payload) -> Tuple[dict, int]:
    """(the JSON header, the offset where tensor data starts) of a safetensors payload; reads
    only the header. Raises PayloadRejected when it is missing or not a JSON object."""
    return _header(memoryview(payload).cast("B"))


def _header(view: memoryview) -> Tuple[dict, int]:
    if view.nbytes < 8:
        raise PayloadRejected(f"{view.nbytes} bytes: too short for a safetensors payload (an "
                              "8-byte header length comes first)")
    (length,) = struct.unpack("<Q", view[:8])
    if length > MAX_HEADER_BYTES or 8 + length > view.nbytes:
        raise PayloadRejected(f"safetensors header length {length} does not fit the "
                              f"{view.nbytes}-byte payload")
    try:
        header = json.loads(bytes(view[8:8 + length]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise PayloadRejected(f"safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise PayloadRejected("safetensors header is not a JSON object")
    return header, 8 + length


def _describe_mismatch(expected: Manifest, got: Manifest) -> str:
    problems = []
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing:
        problems.append(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:5]}"
                        f"{' ...' if len(unexpected) > 5 else ''}")
    for name in sorted(set(expected) & set(got)):
        if expected[name] != got[name]:
            problems.append(f"{name}: {got[name][0]}{list(got[name][1])} != expected "
                            f"{expected[name][0]}{list(expected[name][1])}")
        if len(problems) >= 8:
            break
    return "; ".join(problems)


class SafetensorsValidator:
    """Checks each published payload before the variable server makes it visible.

    Call as `validator(version, payload, format)`; raises PayloadRejected (a ValueError) with
    what is wrong. `expected`: the manifest every version must match; None pins the manifest of
    the first version that passes the layout checks. `check_finite`: also refuse NaN/inf in
    BF16/F16/F32/F64 tensors (reads every float: O(payload)).
    """

    def __init__(self, expected: Optional[Mapping[str, Tuple[str, Tuple[int, ...]]]] = None,
                 check_finite: bool = True) -> None:
        self._expected: Optional[Manifest] = (
            {k: (d, tuple(s)) for k, (d, s) in expected.items()} if expected else None)
        self.check_finite = check_finite
        self._lock = threading.Lock()

    @property
    def expected(self) -> Optional[Manifest]:
        return self._expected

    def __call__(self, version: int, payload, format: str) -> None:  # noqa: A002
        self.validate(version, payload, format, self.check_finite)

    def layout_only(self, version: int, payload, format: str) -> None:  # noqa: A002
        """The checks that read only the header (format, layout, manifest), never the tensor
        data: the variable server's check of a shared-memory publish, whose publisher checked
        finiteness as it wrote the file (variables/shm.py)."""
        self.validate(version, payload, format, False)

    def validate(self, version: int, payload, format: str,  # noqa: A002
                 check_finite: bool) -> None:
        if format not in ("safetensors", ""):
            raise PayloadRejected(f"format {format!r}: this server accepts safetensors payloads "
                                  "only")
        manifest = safetensors_manifest(payload)
        with self._lock:
            if self._expected is None:
                self._expected = manifest
            elif manifest != self._expected:
                raise PayloadRejected("tensor names, dtypes or shapes differ from the model's: "
                                      + _describe_mismatch(self._expected, manifest))
        if check_finite:
            self._check_finite(payload)

    @staticmethod
    def _check_finite(payload) -> None:
        view = memoryview(payload).cast("B")
        header, start = _header(view)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            if has_nonfinite(view[start + begin:start + end], entry["dtype"]):
                raise PayloadRejected(f"tensor {name!r} holds NaN or infinite values")
