"""An actor's, evaluator's or recorder's client of the variable server (core.ActorCoordination).

`VariableClient` follows Acme's VariableClient: `update()` polls the server's newest version at
most every `update_period_s` and fetches new weights in a background thread, so the caller
(an actor's rollout loop) never blocks on it; `update_and_wait()` and `wait_for_version()` block.
`admit_details` asks admission control; `acknowledged` asks which of the actor's rollouts the
learner consumed for good.

The client holds only its address and settings until the first call, so it can be built in
one process and pickled into another (channel.py). It does not import torch: `decode` (e.g.
safetensors bytes -> state dict) is supplied by the caller and must be picklable (a
module-level function) if the client is pickled.

How a version's bytes arrive is weight_fetch.py's: streamed (FetchWeights; copied once, gRPC's
own copies aside, and verified) or, with `weight_transport` "auto" (when the file's directory
exists here) or "shm" (always tries; "grpc" never), mapped from the shared-memory file the
server names. `counters` counts shm_loads and grpc_loads, and the fallbacks from shared memory.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Mapping, Optional, Tuple

import grpc
from absl import logging

from sao_actor_learner import core
from sao_actor_learner.core_values import AckInfo, AdmitResult, ProgressResult, VersionInfo
from sao_actor_learner.protos_gen import variables_pb2
from sao_actor_learner.variables.buffers import BufferPool
from sao_actor_learner.variables.channel import (DEFAULT_MAX_MESSAGE_BYTES, RETRYABLE,
                                                 LazyChannel, PublishError, VariableClientError,
                                                 describe)
from sao_actor_learner.config.sections import WEIGHT_TRANSPORTS
from sao_actor_learner.variables.publisher import VariablePublisher
from sao_actor_learner.variables.security import PUBLISHER_TOKEN_METADATA_KEY
from sao_actor_learner.variables.shm_reader import ShmReader
from sao_actor_learner.variables.weight_fetch import CorruptFetch, ShmLoader, fetch_weights


__all__ = ["AckInfo", "AdmitResult", "ProgressResult", "PUBLISHER_TOKEN_METADATA_KEY",
           "PublishError", "VariableClient", "VariableClientError", "VariablePublisher",
           "VersionInfo"]


class VariableClient(LazyChannel, core.ActorCoordination):
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
      weight_transport: "auto", "shm" or "grpc" (see the module doc). With shared memory, the
        params of a version are a numpy uint8 array over the mapped file (copy-on-write: writes
        stay in this process); its file is not reused while anything references it.
    """

    _PICKLED_FIELDS = ("address", "update_period_s", "decode", "fetch_chunk_bytes",
                       "rpc_timeout_s", "max_backoff_s", "max_message_bytes", "auth_token",
                       "tls_root_cert", "tls_server_name", "weight_transport")

    def __init__(self, address: str, update_period_s: float = 0.05,
                 decode: Optional[Callable[[bytes], Any]] = None, fetch_chunk_bytes: int = 0,
                 rpc_timeout_s: float = 60.0, max_backoff_s: float = 2.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, auth_token: str = "",
                 tls_root_cert: Optional[bytes] = None, tls_server_name: str = "",
                 weight_transport: str = "auto"):
        if weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weight_transport={weight_transport!r}: must be one of "
                             f"{', '.join(WEIGHT_TRANSPORTS)}")
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
        self.weight_transport = weight_transport
        self._counters = collections.Counter()  # shm_loads, grpc_loads, shm_fallback_<why>, ...
        self._shm = ShmReader() if weight_transport != "grpc" else None
        self._shm_loader = None if self._shm is None else \
            ShmLoader(self._shm, weight_transport, self._counters)

    @property
    def max_message_bytes(self) -> int:
        return self._max_message_bytes

    @property
    def counters(self) -> Mapping[str, int]:
        """How versions arrived: shm_loads, grpc_loads, shm_not_here, shm_fallbacks and
        shm_fallback_<why> (weight_fetch.py); a collections.Counter."""
        return self._counters

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
        """(version, params), read together: params as `params` says; (-1, None) before the
        first fetch (core.VariableSource)."""
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
        except Exception as e:  # noqa: BLE001 - RpcError, CorruptFetch, a failing decode, ...
            if self._closed:
                return
            message = describe(e) if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}"
            self.last_error = message
            retryable = isinstance(e, grpc.RpcError) and e.code() in RETRYABLE
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

        Raises grpc.RpcError on transport errors and CorruptFetch when the payload fails
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
                if self._shm is not None:
                    self._shm.release_unused()
                return False
            payload = None if self._shm_loader is None else self._shm_loader.load(info)
            if payload is not None:
                version, sha256 = info.version, info.sha256
                self._counters["shm_loads"] += 1
            else:
                version, payload, sha256 = fetch_weights(
                    self._get_channel(), self._buffers, self.fetch_chunk_bytes, wait_for_ready,
                    deadline)
                self._counters["grpc_loads"] += 1
            params = self.decode(payload) if self.decode is not None else payload
            with self._state_lock:
                if version <= self._version:
                    self._buffers.give(payload)
                    return False
                previous = self._payload
                self._version, self._params, self._sha256 = version, params, sha256
                self._payload = payload
            # Reused for a later version once nothing references it (buffers.py); a shared-
            # memory file, once nothing references its version (shm.py).
            self._buffers.give(previous)
            size = len(payload)
            del previous, params, payload      # so that release_unused sees only others' refs
            if self._shm is not None:
                self._shm.release_unused()
            logging.log_every_n_seconds(logging.INFO, "VariableClient: now at version %d "
                                        "(%d bytes) from %s", 10, version, size, self._address)
            return True
        finally:
            self._fetch_lock.release()

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
            except CorruptFetch as e:
                last = str(e)
                logging.warning("VariableClient: %s; fetching again", e)
            except grpc.RpcError as e:
                last = describe(e)
                if e.code() not in RETRYABLE:
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
            except CorruptFetch as e:
                last = str(e)
                logging.warning("VariableClient: %s; fetching again", e)
            except grpc.RpcError as e:
                last = describe(e)
                if e.code() not in RETRYABLE:
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
            got, payload, _ = fetch_weights(self._get_channel(), self._buffers,
                                            self.fetch_chunk_bytes, True, deadline,
                                            version=version)
        except grpc.RpcError as e:
            raise VariableClientError(f"FetchWeights(version={version}) from {self._address} "
                                      f"failed: {describe(e)}", e.code()) from None
        except CorruptFetch as e:
            raise VariableClientError(f"FetchWeights(version={version}): {e}") from None
        if got != version:
            raise VariableClientError(f"FetchWeights(version={version}) returned version {got}")
        return self.decode(payload) if self.decode is not None else payload

    def latest_info(self, timeout_s: float = 10.0) -> VersionInfo:
        """The server's newest version (one LatestVersion call; waits for the server)."""
        info = self._unary("LatestVersion", variables_pb2.LatestVersionRequest(), timeout_s,
                           "LatestVersion")
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
        reply = self._unary("Admit", variables_pb2.AdmitRequest(
            actor_id=str(actor_id), count=count, released=released), timeout_s,
            f"Admit(actor_id={actor_id!r}, count={count})")
        return AdmitResult(reply.granted, reply.policy_version, reply.started_total,
                           reply.capacity)

    def admit(self, actor_id: str, count: int = 1, timeout_s: float = 30.0) -> int:
        """How many of `count` rollouts the actor may start now (0..count)."""
        return self.admit_details(actor_id, count, timeout_s).granted

    def acknowledged(self, actor_id: int, timeout_s: float = 10.0) -> AckInfo:
        """Which of `actor_id`'s rollouts the learner consumed for good, and the loss epoch, per
        its latest progress report (one call; waits up to `timeout_s` for the server). Raises
        VariableClientError with the gRPC code (`error.retryable` while the server restarts)."""
        reply = self._unary("Acknowledged", variables_pb2.AckRequest(actor_id=int(actor_id)),
                            timeout_s, f"Acknowledged(actor_id={actor_id})")
        return AckInfo(reply.loss_epoch, reply.watermark, tuple(reply.seqs), reply.version,
                       reply.trained_total)

    def close(self) -> None:
        """Closes the channel (cancelling a background fetch); the client is unusable after."""
        self._close_channel()
        self._join_background(1.0)
        if self._shm is not None:
            self._shm.close()
