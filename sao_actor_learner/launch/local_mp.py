"""launch_type="local_mp" (the default): every node its own process on this machine.

Guarantees:
- Processes start with multiprocessing's "spawn" (never fork: torch and TensorFlow start
  threads); `env` is in their environment before their interpreter starts (OMP_NUM_THREADS
  before torch); the launcher's own environment is left as it was.
- Every node's function and arguments are pickled before any process starts, so a bad
  argument fails the launch at once; a PyNode's handle cannot be passed to another node (its
  worker lives in its own process).
- Each process's stdout and stderr go to `run_dir/logs/<label>_<index>.log`; a failure's
  detail is that log's tail.
- A node ends on b"stop" from its stop pipe (its worker's stop()), on SIGTERM after the notice
  period and SIGKILL `terminate_grace_s` later; it stops itself when the launcher dies (its
  pipe reads EOF). Exits are noticed as soon as they happen (a monitor thread).
- With `node_timeout_s > 0`, every node process heartbeats and the monitor kills (SIGKILL) an
  instance silent for longer than that; its exit is then a crash (liveness.py).

Pure standard library.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import logging
import threading
import time
from typing import Any, Dict, List, Optional

from sao_actor_learner.launch.addresses import port_of
from sao_actor_learner.launch.liveness import (HeartbeatWatch, check_node_timeout, hang_message,
                                               heartbeat_interval)
from sao_actor_learner.launch.logs import LOG_TAIL_LINES, start_log, tail
from sao_actor_learner.launch.node_runtime import process_main
from sao_actor_learner.launch.program import Node
from sao_actor_learner.launch.records import NodeRecord
from sao_actor_learner.launch.runner import Runner, pickle_nodes

__all__ = ["ProcessRunner"]

_logger = logging.getLogger(__name__)
_ENV_LOCK = threading.Lock()    # a child inherits os.environ as it is while it starts


class _Instance:
    def __init__(self, process: Any, stop_conn: Any, generation: int,
                 beats: Any = None) -> None:
        self.process, self.stop_conn, self.generation = process, stop_conn, generation
        self.beats = beats                  # the heartbeat counter (None: liveness is off)
        self.watch = HeartbeatWatch(spawned=time.monotonic())
        self.stop_sent = False              # asked to stop: the stop sequence takes over
        self.hang: Optional[str] = None     # why the monitor killed it (liveness.py)


class ProcessRunner(Runner):
    """local_mp: every node its own "spawn" process, logging to run_dir/logs/<name>.log."""

    launch_type = "local_mp"

    def __init__(self, node_timeout_s: float = 0.0) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self.node_timeout_s = check_node_timeout(node_timeout_s)   # 0: no liveness checks
        self._reap_lock = threading.Lock()
        self._payloads: Dict[str, bytes] = {}
        self._records: List[NodeRecord] = []
        self._monitor_stop = threading.Event()

    def log_path(self, node: Node) -> Optional[str]:
        return os.path.join(self.launched.run_dir, "logs", f"{node.name}.log")

    def prepare(self, records: List[NodeRecord]) -> None:
        os.makedirs(os.path.join(self.launched.run_dir, "logs"), exist_ok=True)
        self._payloads = pickle_nodes(records, "local_mp")
        self._records = list(records)
        threading.Thread(target=self._monitor_main, daemon=True,
                         name=f"{self.launched.program.name}/monitor").start()

    def start(self, r: NodeRecord) -> None:
        launched = self.launched
        port = port_of(r.node.handle.address) if r.kind == "service" else None
        start_log(r.log_path, launched.program.name, r.name, r.generation, len(r.history))
        # The stop channel: the launcher sends b"stop"; the node reads EOF when the launcher
        # dies. (Not a multiprocessing.Event: its set() blocks forever once a process that
        # waited on it has exited.)
        reader, writer = self._ctx.Pipe(duplex=False)
        beats = self._ctx.RawValue("Q", 0) if self.node_timeout_s > 0 else None
        env = {**launched.env, **launched.group_env.get(r.node.label, {})}   # placement
        proc = self._ctx.Process(
            target=process_main, name=f"{launched.program.name}/{r.name}",
            args=(self._payloads[r.name], r.name, port, r.log_path, reader, launched.notice_s,
                  env),
            kwargs={"heartbeat": beats,
                    "heartbeat_interval_s": heartbeat_interval(self.node_timeout_s)})
        with _ENV_LOCK:
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                proc.start()
            finally:
                reader.close()
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        r.pid = proc.pid
        r.instance = _Instance(proc, writer, r.generation, beats)

    def poll(self, r: NodeRecord) -> None:
        inst = r.instance
        if inst is None or r.status != "running":
            return
        with self._reap_lock:
            code = inst.process.exitcode
        if code is not None:
            self.launched.node_exited(r, code, inst.hang, inst.generation)

    def request_stop(self, r: NodeRecord) -> None:
        inst = r.instance
        if inst is not None:
            inst.stop_sent = True
        if inst is not None and inst.stop_conn is not None:
            try:
                inst.stop_conn.send_bytes(b"stop")
            except OSError:  # it has exited already
                pass

    def terminate(self, r: NodeRecord) -> bool:
        self._signal(r, signal.SIGTERM)
        return True

    def kill(self, r: NodeRecord) -> None:
        self._signal(r, signal.SIGKILL)

    @staticmethod
    def _signal(r: NodeRecord, sig: int) -> None:
        inst = r.instance
        if inst is not None:
            try:
                os.kill(inst.process.pid, sig)
            except (ProcessLookupError, TypeError):
                pass

    def release(self, r: NodeRecord) -> None:
        inst, r.instance = r.instance, None
        if inst is not None and inst.stop_conn is not None:
            inst.stop_conn.close()

    def _monitor_main(self) -> None:
        """Notices processes that end, as soon as they end."""
        while not self._monitor_stop.is_set():
            live = [(r, r.instance) for r in self._records
                    if r.instance is not None and r.status == "running"]
            if not live:
                time.sleep(0.1)
                continue
            try:
                multiprocessing.connection.wait([inst.process.sentinel for _, inst in live],
                                                timeout=0.2)
            except (OSError, ValueError):  # a sentinel closed under us
                time.sleep(0.05)
            for r, _ in live:
                self.poll(r)
            if self.node_timeout_s > 0:
                self._kill_silent(live)

    def _kill_silent(self, live: List[Any]) -> None:
        """SIGKILLs every running instance whose heartbeat has been silent for longer than
        node_timeout_s (liveness.py); its exit then reaches the supervisor as a crash."""
        now = time.monotonic()
        for r, inst in live:
            if inst.beats is None or inst.stop_sent or inst.hang is not None:
                continue
            silent = inst.watch.silent_for(inst.beats.value, now)
            if silent <= self.node_timeout_s or inst.process.exitcode is not None:
                continue
            inst.hang = hang_message(r.name, silent, self.node_timeout_s)
            _logger.warning("%s", inst.hang)
            try:
                with open(r.log_path, "a") as f:   # the failure's detail is this log's tail
                    f.write(f"[launch] {inst.hang}\n")
            except OSError:
                pass
            try:
                os.kill(inst.process.pid, signal.SIGKILL)   # this instance, not a successor
            except ProcessLookupError:
                pass

    def finish(self, records: List[NodeRecord]) -> None:
        self._monitor_stop.set()
        for r in records:
            self.poll(r)
            inst = r.instance
            if inst is not None and inst.stop_conn is not None:
                inst.stop_conn.close()
                inst.stop_conn = None

    def details(self, r: NodeRecord) -> str:
        log_tail = tail(r.log_path, LOG_TAIL_LINES) if r.log_path else ""
        details = f"pid {r.pid}; last {LOG_TAIL_LINES} lines of {r.log_path}:\n{log_tail}"
        if f"[launch] {r.name}: pid" not in tail(r.log_path, 10**6):
            details += (
                "\n(the process died before the node's code started: while multiprocessing's "
                "spawn re-imported the main module or unpickled the arguments; that traceback "
                "went to the launcher's stderr. A script that launches must guard its code with "
                "`if __name__ == '__main__':`.)")
        return details
