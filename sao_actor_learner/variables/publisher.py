"""The learner's client of the variable server (core.WeightPublisher): publishes policy
versions, reports progress.

`publish` streams a version (opaque bytes, or a sequence of buffers such as
`ckpt.state_dict_to_buffers` gives, streamed without first joining them) in chunks framed
around slices of the payload (one copy, into the bytes gRPC sends) with its CRC-32.
`report_progress` sends the learner's cumulative progress (progress.py): the admission credit
and the rollouts it consumed for good, without re-sending any weights.

With `shm_dir`, a version is instead written once into a shared-memory file (shm.ShmWriter:
one copy, its CRC-32 and the finiteness check on the way) and announced in a one-message
Publish; clients on this host map the file, the server copies it for remote clients. When that
fails (the server is on another host or older, no room in /dev/shm), the version is streamed as
above, and so is every later one.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Callable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
from absl import logging

from sao_actor_learner import core
from sao_actor_learner.core_values import ProgressResult
from sao_actor_learner.protos_gen import variables_pb2
from sao_actor_learner.variables import wire
from sao_actor_learner.variables.channel import (DEFAULT_MAX_MESSAGE_BYTES, SERVICE,
                                                 LazyChannel, PublishConflictError,
                                                 PublishError, describe)
from sao_actor_learner.variables.progress import make_progress
from sao_actor_learner.variables.security import PUBLISHER_TOKEN_METADATA_KEY, PayloadRejected
from sao_actor_learner.variables.shm import ShmUnavailable, ShmWriter, writer_root

Payload = Union[bytes, bytearray, memoryview]
# One buffer, or several streamed back to back as one payload (e.g. a safetensors header and
# then each tensor's bytes: ckpt.state_dict_to_buffers).
PublishPayload = Union[Payload, Sequence[Any]]
# Pause before publishing again after a broken stream.
_RETRY_PAUSE_S = 0.2


class VariablePublisher(LazyChannel, core.WeightPublisher):
    """The learner's side: publishes policy versions and reports progress to a VariableServer.

    Args:
      address: "host:port" of the server.
      publisher_token: the server's publisher token ("" if the server has none).
      chunk_bytes: bytes of payload per streamed message; must stay below the server's
        max_message_bytes.
      format: payload format recorded with each version, e.g. "safetensors".
      max_message_bytes: gRPC message limit on this side.
      auth_token, tls_root_cert, tls_server_name: see security.py ("", None: off).
      shm_dir: publish through shared memory under this directory (e.g. /dev/shm; the writer
        makes its run directory in shm.writer_root(shm_dir)); "" streams every version.
      shm_keep_versions: versions whose files stay readable (shm.ShmWriter's keep).
      shm_run_name: the start of the run directory's name.
    """

    _PICKLED_FIELDS = ("address", "publisher_token", "chunk_bytes", "format",
                       "max_message_bytes", "auth_token", "tls_root_cert", "tls_server_name",
                       "shm_dir", "shm_keep_versions", "shm_run_name")

    def __init__(self, address: str, publisher_token: str, chunk_bytes: int = 1 << 20,
                 format: str = "safetensors",  # noqa: A002 - the proto field's name
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, auth_token: str = "",
                 tls_root_cert: Optional[bytes] = None, tls_server_name: str = "",
                 shm_dir: str = "", shm_keep_versions: int = 3, shm_run_name: str = "run"):
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes}: must be >= 1")
        if shm_keep_versions < 2:
            raise ValueError(f"shm_keep_versions={shm_keep_versions}: must be >= 2")
        self._init_channel(address, max_message_bytes, auth_token, tls_root_cert,
                           tls_server_name)
        self.publisher_token = publisher_token
        self.chunk_bytes = chunk_bytes
        self.format = format
        self.retries = 0   # publishes sent again after a broken stream
        self.shm_dir = shm_dir
        self.shm_keep_versions = shm_keep_versions
        self.shm_run_name = shm_run_name
        self._shm_writer: Optional[ShmWriter] = None   # made at the first publish, per process
        self._shm_off = not shm_dir
        # shm_publishes, grpc_publishes, shm_unavailable (streamed instead), shm_refused
        self.counters = collections.Counter()

    @property
    def shm_writer(self) -> Optional[ShmWriter]:
        """The shared-memory writer once made (None before the first publish, or without)."""
        return self._shm_writer

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
        for the server to come up, and publishes again while a stream breaks (UNAVAILABLE:
        the server restarted or the network failed) until `timeout_s` has passed. `dropped_total`: rollouts the learner has dropped so far
        (admission credit). Raises PublishError naming the cause (PublishConflictError, a
        core.VersionConflict, when the server holds this version or a newer one).
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
        start = time.monotonic()
        if not self._shm_off and self._publish_shm(version, views, total, dropped_total,
                                                   timeout_s):
            logging.info("Published version %d (%d bytes) to %s through shared memory in "
                         "%.3f s", version, total, self._address, time.monotonic() - start)
            return version
        self._call_publish(version, lambda: self._chunks(version, views, total, dropped_total),
                           total, timeout_s)
        self.counters["grpc_publishes"] += 1
        logging.info("Published version %d (%d bytes) to %s in %.3f s", version, total,
                     self._address, time.monotonic() - start)
        return version

    def _call_publish(self, version: int, messages: Callable[[], Iterator[bytes]], total: int,
                      timeout_s: float) -> None:
        """Publish streams of `messages()` until one completes; PublishError naming the cause.

        Publishes again while a stream breaks (UNAVAILABLE: the server was killed or restarted
        mid-publish, or the network) until `timeout_s` has passed. Idempotent: a server that
        already holds this version accepts the same payload again (store.py)."""
        deadline = time.monotonic() + timeout_s
        attempt = 0
        while True:
            attempt += 1
            call = self._get_channel().stream_unary(
                f"{SERVICE}/Publish", request_serializer=None,
                response_deserializer=variables_pb2.PublishReply.FromString)
            try:
                reply = call(messages(), timeout=max(0.001, deadline - time.monotonic()),
                             metadata=self._metadata(), wait_for_ready=True)
                break
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
                    self.retries += 1
                    logging.warning("publish of version %d to %s broke (%s); retrying (attempt "
                                    "%d)", version, self._address, describe(e), attempt + 1)
                    time.sleep(min(_RETRY_PAUSE_S, max(0.0, deadline - time.monotonic())))
                    continue
                hint = ""
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    hint = f" (is the variable server running at {self._address}?)"
                elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    hint = (f" (chunk_bytes={self.chunk_bytes} may exceed the server's "
                            "max_message_bytes: lower chunk_bytes or raise max_message_bytes)")
                error = PublishConflictError if code == grpc.StatusCode.FAILED_PRECONDITION \
                    else PublishError
                raise error(f"publish of version {version} ({total} bytes) to "
                            f"{self._address} failed after {attempt} attempt(s): "
                            f"{describe(e)}{hint}", code) from None
        if reply.version != version or reply.num_bytes != total:
            raise PublishError(f"publish of version {version} ({total} bytes): the server "
                               f"acknowledged version {reply.version} with {reply.num_bytes} "
                               "bytes")

    def _publish_shm(self, version: int, views: List[memoryview], total: int,
                     dropped_total: int, timeout_s: float) -> bool:
        """Writes the version into shared memory and announces it; False when it must be
        streamed instead (shared memory unusable here, or refused by the server)."""
        try:
            if self._shm_writer is None:
                self._shm_writer = ShmWriter(writer_root(self.shm_dir), self.shm_run_name,
                                             self.shm_keep_versions)
            written = self._shm_writer.write(version, views)
        except PayloadRejected as e:
            raise PublishError(f"publish of version {version} ({total} bytes): {e}",
                               grpc.StatusCode.INVALID_ARGUMENT) from None
        except (ShmUnavailable, OSError) as e:   # no room (a container's small /dev/shm), ...
            self._shm_off = True
            self.counters["shm_unavailable"] += 1
            logging.warning("VariablePublisher: shared memory under %s unusable (%s); "
                            "streaming every version over gRPC from now on", self.shm_dir, e)
            return False
        head = variables_pb2.PublishChunk(version=version, total_bytes=total, format=self.format,
                                          dropped_total=dropped_total, crc32=written.crc32,
                                          last=True, shm_path=written.path)
        try:
            self._call_publish(version, lambda: iter((head.SerializeToString(),)), total, timeout_s)
        except PublishError as e:
            if e.code not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT):
                raise
            # Another host, an older server (INVALID_ARGUMENT: it sees no bytes) or a path it
            # does not allow: stream from now on. A payload it refuses is refused again there.
            self._shm_off = True
            self.counters["shm_refused"] += 1
            logging.warning("VariablePublisher: the server refused a shared-memory publish "
                            "(%s); streaming every version over gRPC from now on", e)
            return False
        self.counters["shm_publishes"] += 1
        return True

    def _metadata(self):
        return ((PUBLISHER_TOKEN_METADATA_KEY, self.publisher_token),) \
            if self.publisher_token else None

    def report_progress(self, version: int, dropped_total: int, trained_total: int,
                        loss_epoch: int = 0,
                        acks: Optional[Mapping[int, Tuple[int, Sequence[int]]]] = None,
                        timeout_s: float = 30.0) -> ProgressResult:
        """Sends the learner's cumulative progress; returns once the server keeps it (and has
        persisted it, when it persists its state).

        version: the learner's policy version. dropped_total: rollouts dropped as too stale so
        far (the admission credit). trained_total: rollouts trained on so far. loss_epoch: bump
        it when queued rollouts were lost; actors then re-insert what is not acknowledged.
        acks: actor id -> (watermark, seqs): every rollout seq < watermark, and each of seqs,
        was consumed for good (trained or dropped); None: none. Reports are cumulative: always
        send the full state (acks left out are forgotten).

        The server merges it into what it holds (progress.py): an older report changes nothing.
        ValueError for out-of-range values (progress.make_progress). VariableClientError with
        the gRPC code: UNAVAILABLE / DEADLINE_EXCEEDED while the server is unreachable or
        restarting (`error.retryable`).
        """
        report = make_progress(version, dropped_total, trained_total, loss_epoch, acks or {})
        request = variables_pb2.ProgressReport(
            version=report.version, dropped_total=report.dropped_total,
            trained_total=report.trained_total, loss_epoch=report.loss_epoch,
            acks=[variables_pb2.ActorAck(actor_id=a, watermark=ack.watermark, seqs=ack.seqs)
                  for a, ack in report.acks.items()])
        reply = self._unary("ReportProgress", request, timeout_s,
                            f"ReportProgress(version={version})", metadata=self._metadata())
        return ProgressResult(reply.credit, reply.capacity, reply.identical, reply.loss_epoch,
                              reply.version)

    def close(self) -> None:
        """Closes the channel and removes the shared-memory files; the publisher cannot be used
        afterwards."""
        self._close_channel()
        if self._shm_writer is not None:
            self._shm_writer.close()
