"""The variable server: a gRPC node holding the newest policy versions and admission control.

The learner publishes each policy version in chunks (`Publish`, store.py), or, on this host,
as a file in shared memory that clients here map instead of fetching it (shm.py), and reports its
progress (`ReportProgress`: admission credit, rollouts consumed for good; progress.py); actors
and evaluators poll `LatestVersion`, stream `FetchWeights`, ask `Admit` before starting
rollouts (admission.py, AReaL's staleness rule) and ask `Acknowledged` which of their spooled
rollouts the learner consumed.

Every request is parsed by hand from raw bytes (rpc.py), so a malformed one gets a gRPC status
naming what was wrong, and no bad request can stop the server. With an `auth_token` every call
must carry it (security.py); binding a non-loopback host without one, or without TLS unless
`insecure_transport`, is refused. Publish and ReportProgress also need the learner (publisher)
token. A report or publish may not claim more than actors were admitted to start
(progress.beyond_admitted): a report that does is refused, a publish's credit is capped.

With a `state_path`, the admission counters, the newest published version number and the
latest progress report survive a restart (server_state.py); weights do not.

The method table and the checks of each call: handlers.py; the version ring: store.py.
"""
from __future__ import annotations

import collections
import json
import threading
from typing import Callable, Dict, Iterator, Optional, Tuple

import grpc
from absl import logging

from sao_actor_learner import core
from sao_actor_learner.protos_gen import variables_pb2
from sao_actor_learner.variables.admission import Admission
from sao_actor_learner.variables.progress import Progress, beyond_admitted
from sao_actor_learner.variables.handlers import (SERVICE_NAME, method_handlers,
                                                  parse_admit_request, parse_progress_report)
from sao_actor_learner.variables.rpc import Abort, check_publisher, parse, serve
from sao_actor_learner.variables.security import (PUBLISHER_TOKEN_METADATA_KEY, check_bind,
                                                  is_loopback)
from sao_actor_learner.variables.server_state import (STATE_FORMAT, load_state, save_state,
                                                      state_text)
from sao_actor_learner.variables.shm_files import (DEFAULT_SHM_DIR, remove_if_empty,
                                                   sweep_dead_runs, writer_root)
from sao_actor_learner.variables.state_file import StateFile
from sao_actor_learner.variables.store import (MIN_FETCH_CHUNK_BYTES, PublishedVersion,
                                               VersionStore)

__all__ = ["PUBLISHER_TOKEN_METADATA_KEY", "PublishedVersion", "SERVICE_NAME", "STATE_FORMAT",
           "VariableServer"]

# Room for the protobuf framing around one chunk's data.
MESSAGE_OVERHEAD_BYTES = 64 << 10
_INVALID = grpc.StatusCode.INVALID_ARGUMENT


class VariableServer(core.Worker):
    """Serves the newest policy versions over gRPC and runs admission control.

    Args:
      port: TCP port; 0 picks a free one (read it from `port` after `start()`).
      host: interface to bind; 127.0.0.1 by default.
      batch_size: rollouts per learner step (B in AReaL's rule).
      max_staleness: eta, the staleness limit in versions.
      admission_control: False grants every Admit request in full.
      publisher_token: the secret Publish and ReportProgress must send in metadata
        `x-sao-publisher-token`; "" disables the check (a warning is logged).
      max_message_bytes: gRPC send/receive limit per message; must exceed `chunk_bytes`.
      chunk_bytes: default FetchWeights chunk size.
      keep_versions: how many newest versions stay fetchable by number (>= 1).
      max_payload_bytes: the largest payload a publisher may announce.
      max_workers: gRPC handler threads (each FetchWeights stream holds one while it streams).
      auth_token: the shared secret every call must send in metadata `x-sao-auth-token`; ""
        accepts calls without one (allowed only when `host` is a loopback address).
      tls_cert_chain, tls_private_key: PEM bytes; with both, the server listens with TLS only.
      insecure_transport: allow a non-loopback `host` without TLS (tokens in clear text; a
        warning is logged).
      bound_progress: refuse a progress report that claims more than actors were admitted to
        start, and cap a publish's credit at that (progress.beyond_admitted); False accepts
        any report (a test of the merge rules without actors).
      validate_payload: called as validate_payload(version, payload, format) once a publish
        has arrived whole with correct checksums; raising ValueError refuses the version
        (INVALID_ARGUMENT with its message) and the previous one stays visible.
      state_path: where the admission state and the latest progress report persist (None: in
        memory only). Read when the server is made (ValueError if the file is not a state).
      state_fsync: fsync each state write (a machine crash then loses at most the last one);
        False survives process death only, at a fraction of the cost.
      shm_root: the publishers' shared-memory writer root (shm.writer_root of their shm_dir):
        shared-memory publishes may name files under it only, and `stop()` removes the run
        directories under it whose writer process is gone (a learner killed before it could
        clean up). None refuses shared-memory publishes (the publisher then streams).
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
                 insecure_transport: bool = False,
                 bound_progress: bool = True,
                 validate_payload: Optional[Callable[[int, memoryview, str], None]] = None,
                 state_path: Optional[str] = None,
                 state_fsync: bool = True,
                 shm_root: Optional[str] = writer_root(DEFAULT_SHM_DIR)):
        if not 0 <= port <= 65535:
            raise ValueError(f"port={port}: must be in [0, 65535]; 0 picks a free port")
        if chunk_bytes < MIN_FETCH_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes={chunk_bytes}: must be >= {MIN_FETCH_CHUNK_BYTES}")
        if max_message_bytes < chunk_bytes + MESSAGE_OVERHEAD_BYTES:
            raise ValueError(
                f"max_message_bytes={max_message_bytes}: must be >= chunk_bytes + "
                f"{MESSAGE_OVERHEAD_BYTES} = {chunk_bytes + MESSAGE_OVERHEAD_BYTES} so one chunk "
                "fits in a gRPC message; raise max_message_bytes or lower chunk_bytes")
        if max_workers < 2:
            raise ValueError(f"max_workers={max_workers}: must be >= 2")
        if (tls_cert_chain is None) != (tls_private_key is None):
            raise ValueError("tls_cert_chain and tls_private_key: give both (TLS) or neither")
        check_bind(host, auth_token, "the variable server", tls=tls_cert_chain is not None,
                   insecure_transport=insecure_transport)
        self._admission = Admission(batch_size, max_staleness, admission_control)
        self._store = VersionStore(keep_versions, max_payload_bytes, validate_payload, shm_root)
        self._shm_root = shm_root
        self._auth_token = auth_token
        self._tls = (tls_cert_chain, tls_private_key) if tls_cert_chain is not None else None
        self._requested_port = port
        self._host = host
        self._publisher_token = publisher_token
        self._bound_progress = bound_progress
        self._max_message_bytes = max_message_bytes
        self._chunk_bytes = chunk_bytes
        self._max_workers = max_workers

        self._lock = threading.Lock()        # guards the admission and progress state below
        self._progress: Optional[Progress] = None
        self._progress_json = "null"
        self._published_version = -1         # newest version ever published (persisted)
        self._state_seq = 0                  # bumped on every change of the persisted state
        self._counters: Dict[str, int] = collections.Counter()
        self._state_file = StateFile(state_path, state_fsync) if state_path else None
        if self._state_file is not None:
            self._load_state()

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
            server, bound = serve(self._make_handler(), self._host, self._requested_port,
                                  self._tls, self._max_workers, self._max_message_bytes)
            self._server, self._bound_port = server, bound
            if self._tls is None and not is_loopback(self._host):
                logging.warning("VariableServer on %s: INSECURE TRANSPORT (--insecure_transport):"
                                " no TLS on a non-loopback address, so the auth and learner "
                                "tokens cross the network in clear text", self.address)
            if not self._publisher_token:
                logging.warning("VariableServer on %s has no publisher_token: anyone who can "
                                "reach the port may publish weights", self.address)
            a = self._admission
            logging.info("VariableServer serving on %s (batch_size=%d, max_staleness=%d, "
                         "admission_control=%s, auth token %s, TLS %s, state %s)", self.address,
                         a.batch_size, a.max_staleness, a.enabled,
                         "required" if self._auth_token else "off",
                         "on" if self._tls else "off",
                         self._state_file.path if self._state_file else "in memory")
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
        self._store.close()
        if self._shm_root is not None:
            for path in sweep_dead_runs(self._shm_root):
                logging.info("VariableServer: removed %s, shared-memory versions of a writer "
                             "that is gone", path)
            remove_if_empty(self._shm_root)

    def __enter__(self) -> "VariableServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(grace_s=0.2)

    # ------------------------------------------------------------------ in-process access

    def latest(self) -> Optional[PublishedVersion]:
        """The newest visible version, or None before any publish."""
        return self._store.latest()

    def wait_copied(self, version: int, timeout_s: float = 120.0) -> bool:
        """Waits until the server holds the bytes of `version` (a shared-memory publish is
        copied in the background; a gRPC one at once). False when not held or not copied."""
        return self._store.wait_copied(version, timeout_s)

    def progress(self) -> Optional[Progress]:
        """The latest accepted progress report, or None before any."""
        with self._lock:
            return self._progress

    def stats(self) -> dict:
        """Counters for metrics: version, admission (total and per actor), rejections."""
        latest = self._store.latest()
        with self._lock:
            a = self._admission
            return {
                "version": latest.version if latest else -1,
                "num_bytes": latest.num_bytes if latest else 0,
                "dropped_total": a.credit,
                "started_total": a.started_total,
                "capacity": a.capacity(self._published_version),
                "started_by_actor": dict(a.started_by_actor),
                "released": a.released_total,
                "state_writes": self._state_file.writes if self._state_file else 0,
                **dict(self._store.counters), **dict(self._counters),
            }

    # ------------------------------------------------------------------ persistence

    def _load_state(self) -> None:
        restored = load_state(self._state_file, self._admission)
        if restored is None:
            return
        self._admission, self._published_version, progress = restored
        if progress is not None:
            self._progress, self._progress_json = progress, json.dumps(progress.to_state())
        a = self._admission
        logging.info("VariableServer: admission state from %s: %d started, credit %d, newest "
                     "version %d", self._state_file.path, a.started_total, a.credit,
                     self._published_version)

    def _snapshot_locked(self) -> Optional[Tuple[int, str]]:
        """(sequence number, text) of the persisted state now (needs the lock); None when the
        state is not persisted."""
        if self._state_file is None:
            return None
        self._state_seq += 1
        return self._state_seq, state_text(self._published_version, self._admission,
                                           self._progress_json)

    def _persist(self, snapshot: Optional[Tuple[int, str]], method: str) -> None:
        """Writes `snapshot` (from `_snapshot_locked`) before the call answers."""
        if snapshot is not None:
            save_state(self._state_file, snapshot, method)

    # ------------------------------------------------------------------ handlers

    def _publish(self, chunks: Iterator[bytes],
                 context: grpc.ServicerContext) -> variables_pb2.PublishReply:
        check_publisher(context, self._publisher_token, "Publish")
        record, _ = self._store.receive(chunks)
        with self._lock:   # the credit is capped at what was ever admitted (beyond_admitted)
            credit = min(record.dropped_total, self._admission.granted_total) \
                if self._bound_progress else record.dropped_total
            changed = self._admission.add_credit(credit)
            if record.version > self._published_version:
                self._published_version, changed = record.version, True
            snapshot = self._snapshot_locked() if changed else None
        self._persist(snapshot, "Publish")
        return variables_pb2.PublishReply(version=record.version, num_bytes=record.num_bytes)

    def _latest_version(self, raw: bytes,
                        context: grpc.ServicerContext) -> variables_pb2.VersionInfo:
        parse(variables_pb2.LatestVersionRequest, raw, "LatestVersionRequest")
        latest = self._store.latest()
        if latest is None:
            return variables_pb2.VersionInfo(version=-1)
        return variables_pb2.VersionInfo(version=latest.version, sha256=latest.sha256,
                                          num_bytes=latest.num_bytes,
                                          publish_time=latest.publish_time,
                                          shm_path=latest.shm_path, crc32=latest.crc32)

    def _fetch_weights(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        request = parse(variables_pb2.FetchRequest, raw, "FetchRequest")
        if request.chunk_bytes < 0:
            raise Abort(_INVALID, f"FetchWeights chunk_bytes={request.chunk_bytes}: must be >= 0 "
                        "(0 picks the server default)")
        chunk_bytes = min(request.chunk_bytes or self._chunk_bytes,
                          self._max_message_bytes - MESSAGE_OVERHEAD_BYTES)
        return self._store.fetch_chunks(request.version, chunk_bytes)

    def _admit(self, raw: bytes, context: grpc.ServicerContext) -> variables_pb2.AdmitReply:
        request = parse_admit_request(raw)
        latest = self._store.latest()
        with self._lock:
            try:
                decision = self._admission.admit(request.actor_id, request.count,
                                                 request.released, self._published_version)
            except ValueError as e:
                raise Abort(_INVALID, f"Admit {e}") from None
            changed = decision.granted or request.released
            snapshot = self._snapshot_locked() if changed else None
        self._persist(snapshot, "Admit")
        return variables_pb2.AdmitReply(granted=decision.granted,
                                         policy_version=latest.version if latest else -1,
                                         started_total=decision.started_total,
                                         capacity=decision.capacity)

    def _report_progress(self, raw: bytes,
                         context: grpc.ServicerContext) -> variables_pb2.ProgressReply:
        check_publisher(context, self._publisher_token, "ReportProgress")
        report = parse_progress_report(raw)
        with self._lock:
            a = self._admission
            why = beyond_admitted(report, lambda actor: a.granted_to(str(actor)),
                                  a.granted_total) if self._bound_progress else None
            if why is not None:
                raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"ReportProgress refused: {why}")
            stored = self._progress
            merged = stored.merged(report) if stored is not None else report
            identical = merged == stored
            if not identical:
                self._progress, self._progress_json = merged, json.dumps(merged.to_state())
                self._counters["progress_reports"] += 1
            self._admission.add_credit(merged.dropped_total)
            snapshot = None if identical else self._snapshot_locked()
            credit = self._admission.credit
            capacity = self._admission.capacity(self._published_version)
        self._persist(snapshot, "ReportProgress")
        return variables_pb2.ProgressReply(credit=credit, capacity=capacity, identical=identical,
                                           loss_epoch=merged.loss_epoch,
                                           version=merged.version)

    def _acknowledged(self, raw: bytes, context: grpc.ServicerContext) -> variables_pb2.AckReply:
        request = parse(variables_pb2.AckRequest, raw, "AckRequest")
        with self._lock:
            report = self._progress or Progress()
        ack = report.acked(request.actor_id)
        return variables_pb2.AckReply(loss_epoch=report.loss_epoch, watermark=ack.watermark,
                                       seqs=ack.seqs, version=report.version,
                                       trained_total=report.trained_total)

    # ------------------------------------------------------------------ gRPC plumbing

    def _make_handler(self) -> grpc.GenericRpcHandler:
        """Method handlers that take raw request bytes (parsed by hand, see module doc)."""
        unary = {"LatestVersion": self._latest_version, "Admit": self._admit,
                 "ReportProgress": self._report_progress, "Acknowledged": self._acknowledged}
        return method_handlers(unary, self._publish, self._fetch_weights, self._auth_token,
                               self._reject)

    def _reject(self, method: str, context: grpc.ServicerContext, e: Abort) -> None:
        with self._lock:
            self._counters[f"rejected_{method}"] += 1
            if e.code == grpc.StatusCode.UNAUTHENTICATED:
                self._counters["rejected_unauthenticated"] += 1
        if method == "Publish":
            logging.warning("VariableServer rejected %s from %s: %s: %s", method,
                            context.peer(), e.code.name, e.details)
        else:
            logging.log_every_n_seconds(logging.WARNING, "VariableServer rejected %s from %s: "
                                        "%s: %s (further rejections logged at most every 5 s)",
                                        5, method, context.peer(), e.code.name, e.details)
        context.abort(e.code, e.details)
