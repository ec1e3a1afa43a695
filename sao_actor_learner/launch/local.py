"""Launchers: every node a daemon thread of this process, its own process, or a Ray actor.

    launched = launch(program, launch_type="local_mp", run_dir="runs/x",
                      terminal_groups=("learner",))
    launched.wait()   # until the learner finishes (or any node fails), then stops the rest
    launched.stop()   # idempotent

local_mt   every node a daemon thread here: for tests and debugging; a PyNode's handle then
           dereferences to its worker object, so a test can step it by hand.
local_mp   (default) every node its own process, started with multiprocessing's "spawn" (never
           fork: torch and TensorFlow start threads); each process's stdout and stderr go to
           `run_dir/logs/<label>_<index>.log`.
ray        every node a Ray actor, on a local Ray instance or an existing cluster
           (`ray_address`), with per-group resources; see launch/ray.py.

Order: service nodes start first, on ports this launcher picks on 127.0.0.1; PyNodes start once
every service accepts TCP connections. Stopping is cooperative: PyNodes are asked first (their
worker's `stop()`), then services, each set given `notice_s` seconds before leftover processes
are terminated and then killed. Processes never outlive the launcher: `wait()` and `launch()`
stop what they started when they raise (KeyboardInterrupt too), an atexit hook stops programs
still running at exit, and each node process stops itself when its parent process dies.

Restarts: `restart={"actor": RestartPolicy(max_restarts=3, backoff_s=1.0)}` makes the launcher
start a node of that group again when it crashes (an exception, a non-zero exit code, a signal
such as `kill -9`) instead of failing the program: after `backoff_s`, doubling with each restart
of the same node up to `max_backoff_s`, at most `max_restarts` times per node; one crash more
fails the program as before. A restarted service keeps its address (same port), so the handles
other nodes hold stay valid. `restart_node(name)` restarts a running node on request: a
cooperative stop (a replay node checkpoints), then a fresh start at once; it does not count
against `max_restarts`. A node that returns from run() normally is finished, never restarted.

`run_dir/nodes.json` lists every node (label, index, pid or thread, address, status, exit code,
log, restarts and their history: time, old pid, exit code, reason) and is rewritten whenever a
status changes, restarts included (the new pid is there as soon as it is started). Statuses:
pending, running, restarting (crashed, waiting for its backoff), finished (its worker's run()
returned), failed (an exception or a non-zero exit code, with no restart left), killed
(terminated by the launcher after the notice period), stopped (the program stopped while it
waited to restart), unresponsive (a thread that ignored stop; left behind as a daemon thread),
not_started (launch failed before reaching it).

Pure standard library.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # noqa: F401  (registers its atexit hook before ours: ours runs first)
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from sao_actor_learner.launch.program import (Handle, Node, Program, PyNode, PyNodeHandle,
                                              ServiceHandle, ServiceNode, find_handles,
                                              map_handles)

__all__ = ["launch", "Launched", "NodeFailedError", "RestartPolicy", "LAUNCH_TYPES"]

LAUNCH_TYPES = ("local_mp", "local_mt", "ray")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")
LOG_TAIL_LINES = 40
_KILL_GRACE_S = 2.0        # after SIGTERM, before SIGKILL
_POLL_S = 0.05

_logger = logging.getLogger(__name__)


class NodeFailedError(RuntimeError):
    """A node exited with an exception or a non-zero exit code (or a service never came up).

    The message names the node and carries the tail of its log (processes) or its traceback
    (threads); `node`, `exitcode` and `details` hold the same separately.
    """

    def __init__(self, message: str, node: str = "", exitcode: Optional[int] = None,
                 details: str = "") -> None:
        super().__init__(message)
        self.node = node
        self.exitcode = exitcode
        self.details = details


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """How a launcher restarts the nodes of one group after they crash.

    max_restarts: restarts allowed per node (0: never restart); the crash after the last one
      fails the program with NodeFailedError.
    backoff_s: wait before the first restart of a node; doubles with each further restart of
      the same node (1, 2, 4, ... s), up to `max_backoff_s`.
    """
    max_restarts: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts!r}: must be an int >= 0 (restarts "
                             "per node; 0 never restarts)")
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s={self.backoff_s}: must be >= 0 (seconds before the "
                             "first restart)")
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"max_backoff_s={self.max_backoff_s} < backoff_s={self.backoff_s}: "
                             "raise max_backoff_s")

    def delay(self, restart_number: int) -> float:
        """Seconds to wait before restart number `restart_number` (1-based) of a node."""
        return min(self.backoff_s * 2.0 ** max(restart_number - 1, 0), self.max_backoff_s)


class _Record:
    """What the launcher knows about one node it started."""

    def __init__(self, node: Node, log_path: Optional[str]) -> None:
        self.node = node
        self.kind = "service" if isinstance(node, ServiceNode) else "py"
        self.status = "pending"
        self.exitcode: Optional[int] = None
        self.pid: Optional[int] = None
        self.thread_name: Optional[str] = None
        self.log_path = log_path
        self.error: Optional[str] = None      # traceback (threads)
        self.killed = False                   # the launcher sent it SIGTERM/SIGKILL
        self.process: Any = None              # multiprocessing process (local_mp)
        self.thread: Optional[threading.Thread] = None
        self.control: Optional[_WorkerControl] = None
        self.stop_conn: Any = None            # write end of the node's stop pipe (local_mp)
        self.generation = 0                   # 0 for the first start, +1 per restart
        self.restarts = 0                     # restarts after crashes (counted against the policy)
        self.restart_requested = False        # restart_node() asked for the current exit
        self.history: List[dict] = []         # one entry per restart
        self.extra: Dict[str, Any] = {}       # launcher-specific fields for nodes.json (Ray ids)

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def done(self) -> bool:
        return self.status not in ("pending", "running", "not_started", "restarting")

    def info(self) -> dict:
        return {"name": self.name, "label": self.node.label, "index": self.node.index,
                "kind": self.kind, "pid": self.pid, "thread": self.thread_name,
                "address": self.node.handle.address if self.node.handle else None,
                "status": self.status, "exitcode": self.exitcode, "log": self.log_path,
                "restarts": self.restarts, "restarts_requested": sum(
                    h["reason"] == "requested" for h in self.history),
                "restart_history": list(self.history), **self.extra}


_LIVE: "set[Launched]" = set()        # strong refs: dropped programs are still stopped at exit
_LIVE_LOCK = threading.Lock()
_ENV_LOCK = threading.Lock()


@atexit.register
def _stop_all_at_exit() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for launched in live:
        try:
            launched.stop()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            traceback.print_exc()


class Launched:
    """A running program: `wait()` for it, `stop()` it; also a context manager (stops on exit)."""

    launch_type = ""

    def __init__(self, program: Program, run_dir: str, terminal_groups: Optional[Sequence[str]],
                 env: Mapping[str, str], notice_s: float, service_timeout_s: float,
                 restart: Optional[Mapping[str, RestartPolicy]] = None,
                 bind_host: str = "127.0.0.1") -> None:
        self.program = program
        self.run_dir = run_dir
        self.notice_s = float(notice_s)
        self.service_timeout_s = float(service_timeout_s)
        self.bind_host = bind_host
        self._env = {str(k): str(v) for k, v in env.items()}
        self._cond = threading.Condition()
        self._stop_lock = threading.RLock()
        self._stop_requested = False
        self._stopped = False
        self._stop_event = threading.Event()     # wakes restarts waiting out their backoff
        self._restart_lock = threading.Lock()    # a restart's start vs. stop()
        self._records: List[_Record] = [
            _Record(n, self._log_path(n)) for n in program.nodes]
        self._by_name = {r.name: r for r in self._records}
        self._terminal = self._terminal_records(terminal_groups)
        self._restart_policies = self._check_restart(restart or {})

    # ----------------------------------------------------------------------------- public API
    @property
    def addresses(self) -> Dict[str, List[Optional[str]]]:
        """label -> the addresses ("127.0.0.1:PORT") of the group's service nodes."""
        out: Dict[str, List[Optional[str]]] = {}
        for r in self._records:
            if r.kind == "service":
                out.setdefault(r.node.label, []).append(r.node.handle.address)
        return out

    @property
    def exitcodes(self) -> Dict[str, List[Optional[int]]]:
        """label -> each node's exit code (None while running; threads: 0 returned, 1 raised)."""
        out: Dict[str, List[Optional[int]]] = {}
        for r in self._records:
            out.setdefault(r.node.label, []).append(r.exitcode)
        return out

    @property
    def statuses(self) -> Dict[str, List[str]]:
        """label -> each node's status (see the module docstring)."""
        out: Dict[str, List[str]] = {}
        for r in self._records:
            out.setdefault(r.node.label, []).append(r.status)
        return out

    def nodes_info(self) -> List[dict]:
        """One dict per node, as written to nodes.json."""
        with self._cond:
            return [r.info() for r in self._records]

    def log_path(self, label: str, index: int = 0) -> Optional[str]:
        """The log file of node `<label>_<index>` (None under local_mt)."""
        return self._by_name[f"{label}_{index}"].log_path

    @property
    def restarts(self) -> Dict[str, int]:
        """node name -> how many times it was restarted (after crashes and on request)."""
        with self._cond:
            return {r.name: len(r.history) for r in self._records}

    def restart_node(self, name: str) -> None:
        """Restarts running node `name` now and returns once its new instance has started.

        The node is asked to stop as `stop()` would ask it (a replay node writes its checkpoint
        on the way out), gets `notice_s` seconds, is killed if it has not exited by then, and is
        started again at once: a service on the same address. Such a restart is recorded in
        nodes.json (reason "requested") but does not count against its group's max_restarts.
        Raises KeyError for an unknown node and RuntimeError when it is not running.
        """
        if name not in self._by_name:
            raise KeyError(f"restart_node({name!r}): no such node; nodes: {sorted(self._by_name)}")
        r = self._by_name[name]
        with self._cond:
            if self._stop_requested:
                raise RuntimeError(f"restart_node({name!r}): the program is stopping")
            if r.status != "running":
                raise RuntimeError(f"restart_node({name!r}): the node is {r.status}; only a "
                                   "running node can be restarted")
            r.restart_requested = True
            generation = r.generation
        self._request_node_stop(r)
        deadline = time.monotonic() + self.notice_s
        with self._cond:
            while r.generation == generation and r.status == "running":
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(remaining, 0.1))
            exited = not (r.generation == generation and r.status == "running")
        if not exited:
            _logger.warning("node %s did not stop within notice_s=%g s of restart_node(); "
                            "killing it", name, self.notice_s)
            self._kill_node(r)
        deadline = time.monotonic() + max(self.notice_s, 10.0) + self.service_timeout_s
        with self._cond:
            while r.generation == generation or r.status == "restarting":
                if r.done or self._stop_requested:
                    raise RuntimeError(f"restart_node({name!r}): the node is {r.status} instead "
                                       "of restarted")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"restart_node({name!r}): not restarted in time")
                self._cond.wait(min(remaining, 0.1))

    @property
    def stopped(self) -> bool:
        """Whether stop() has finished."""
        return self._stopped

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until every terminal node finished, then stops the rest and returns True.

        Terminal nodes are the PyNodes of `terminal_groups` (all PyNodes when it was None); with
        none, waits until the program is stopped. Returns True too once the program is stopped
        (by `stop()` from another thread), and False when `timeout` seconds pass first (the
        program keeps running). If any node fails, stops the program and raises
        NodeFailedError; a KeyboardInterrupt or other exception also stops it, then propagates.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        finished = False
        try:
            with self._cond:
                while True:
                    failed = self._first_failure()
                    if failed is not None:
                        break
                    if self._stopped:
                        finished = True
                        break
                    if self._terminal and all(r.status == "finished" for r in self._terminal):
                        finished = True
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._cond.wait(0.25 if remaining is None else min(remaining, 0.25))
            self.stop()
            failed = self._first_failure()
            if failed is not None:
                raise self._failure_error(failed)
            return finished
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stops every node: PyNodes first, then services; each set gets `notice_s` seconds to
        return from run() before leftover processes are terminated (threads abandoned).

        Idempotent and safe to call from any thread; never raises for nodes' failures (see
        `wait()` and `statuses`). If it is interrupted itself (a second Ctrl-C), it kills the
        remaining processes at once."""
        with self._stop_lock:
            if self._stopped or self._stop_requested:
                return   # done, or re-entered from an exception raised while stopping
            self._stop_requested = True
            self._stop_event.set()
            with self._restart_lock:   # a restart now starting finishes first; no new ones
                with self._cond:
                    for r in self._records:
                        if r.status == "restarting":
                            r.status = "stopped"
            completed = False
            try:
                for kind in ("py", "service"):
                    records = [r for r in self._records if r.kind == kind]
                    if records:
                        self._stop_records(kind, records)
                completed = True
            finally:
                if not completed:   # interrupted (a second Ctrl-C): no more notice
                    self._kill_all()
                self._finish_stop()
                self._stopped = True
                with _LIVE_LOCK:
                    _LIVE.discard(self)
                with self._cond:
                    self._write_nodes_json()
                    self._cond.notify_all()

    def __enter__(self) -> "Launched":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.program.name!r}, run_dir={self.run_dir!r}, "
                f"statuses={self.statuses})")

    # ------------------------------------------------------------------- launcher internals
    def _start(self) -> None:
        """Starts services, waits for their ports, then starts PyNodes."""
        with _LIVE_LOCK:
            _LIVE.add(self)
        host = local_service_host(self.bind_host)
        ports = _free_ports(sum(r.kind == "service" for r in self._records), host)
        for r in self._records:
            if r.kind == "service":
                r.node.handle._address = f"{_bracket(host)}:{ports.pop()}"
            else:
                r.node.handle._launch_type = self.launch_type
        self._prepare()
        services = [r for r in self._records if r.kind == "service"]
        for r in services:
            self._start_node(r)
        with self._cond:
            self._write_nodes_json()
        for r in services:
            self._wait_for_service(r)
        for r in self._records:
            if r.kind == "py":
                self._start_node(r)
        with self._cond:
            self._write_nodes_json()

    def _record_exit(self, r: _Record, exitcode: int, error: Optional[str] = None,
                     generation: Optional[int] = None) -> None:
        """Notes that node `r` (its instance `generation`, None: the current one) ended, once;
        schedules its restart when its group's policy (or restart_node) asks; wakes waiters."""
        with self._cond:
            if r.status != "running" or (generation is not None and generation != r.generation):
                return
            r.exitcode = exitcode
            r.error = error
            requested, r.restart_requested = r.restart_requested, False
            policy = self._restart_policies.get(r.node.label)
            if not self._stop_requested and (requested or (
                    exitcode != 0 and policy is not None and r.restarts < policy.max_restarts)):
                self._begin_restart(r, exitcode, requested, policy)
            elif exitcode == 0:
                r.status = "finished"
            elif r.killed and exitcode in (-signal.SIGTERM, -signal.SIGKILL):
                r.status = "killed"
            else:
                r.status = "failed"
                if not self._stop_requested:
                    tried = f" after {r.restarts} restarts" if r.restarts else ""
                    _logger.error("node %s failed (exit code %s)%s; see %s", r.name, exitcode,
                                  tried, r.log_path or "its traceback")
            self._write_nodes_json()
            self._cond.notify_all()

    def _begin_restart(self, r: _Record, exitcode: int, requested: bool,
                       policy: Optional[RestartPolicy]) -> None:
        """Marks r restarting and starts the thread that restarts it. Call with _cond held."""
        if requested:
            delay = 0.0
        else:
            r.restarts += 1
            delay = policy.delay(r.restarts)
        r.history.append({"time": time.time(), "pid": r.pid, "exitcode": exitcode,
                          "reason": "requested" if requested else "crashed",
                          "backoff_s": delay, "error": (r.error or "")[-2000:] or None})
        r.status = "restarting"
        r.killed = False
        if not requested:
            _logger.warning("node %s crashed (exit code %s%s); restart %d of %d in %.1f s",
                            r.name, exitcode, _signal_name(exitcode), r.restarts,
                            policy.max_restarts, delay)
        threading.Thread(target=self._restart_main, args=(r, r.generation, delay), daemon=True,
                         name=f"{self.program.name}/restart-{r.name}").start()

    def _restart_main(self, r: _Record, generation: int, delay: float) -> None:
        """After `delay` s, starts a new instance of node r (unless the program stops first)."""
        self._stop_event.wait(delay)
        with self._restart_lock:
            with self._cond:
                if self._stop_requested or r.generation != generation or \
                        r.status != "restarting":
                    return
                r.generation += 1
            try:
                self._release_instance(r)
                self._start_node(r)
            except BaseException:  # noqa: BLE001 - reported through wait()
                with self._cond:
                    r.status = "failed"
                    r.error = traceback.format_exc()
                    _logger.error("node %s could not be restarted:\n%s", r.name, r.error)
                    self._write_nodes_json()
                    self._cond.notify_all()
                return
            with self._cond:
                _logger.info("node %s restarted (pid %s)", r.name, r.pid)
                self._write_nodes_json()
                self._cond.notify_all()

    def _check_restart(self, restart: Mapping[str, RestartPolicy]) -> Dict[str, RestartPolicy]:
        groups = self.program.groups
        out = {}
        for label, policy in restart.items():
            if not isinstance(policy, RestartPolicy):
                raise TypeError(f"restart[{label!r}]={policy!r}: expected a RestartPolicy")
            if label not in groups:
                _logger.info("restart policy for group %r, which program %r lacks; ignored",
                             label, self.program.name)
                continue
            out[label] = policy
        return out

    def _first_failure(self) -> Optional[_Record]:
        failed = [r for r in self._records if r.status == "failed"]
        return failed[0] if failed else None

    def _terminal_records(self, terminal_groups: Optional[Sequence[str]]) -> List[_Record]:
        if terminal_groups is None:
            return [r for r in self._records if r.kind == "py"]
        if isinstance(terminal_groups, str):
            terminal_groups = (terminal_groups,)
        groups = self.program.groups
        missing = [g for g in terminal_groups if g not in groups]
        present = [g for g in terminal_groups if g in groups]
        for g in present:
            if not any(isinstance(n, PyNode) for n in groups[g]):
                raise ValueError(f"terminal group {g!r} holds only service nodes, which serve "
                                 "until stopped: wait() would never return")
        if not present:
            raise ValueError(f"terminal_groups={tuple(terminal_groups)!r}: none of these groups "
                             f"is in program {self.program.name!r} (groups: {sorted(groups)})")
        if missing:
            _logger.info("terminal groups %s are not in program %r; waiting for %s",
                         missing, self.program.name, present)
        return [r for r in self._records if r.node.label in present and r.kind == "py"]

    def _write_nodes_json(self) -> None:
        """Rewrites run_dir/nodes.json (atomically). Call with self._cond held."""
        data = {"program": self.program.name, "launch_type": self.launch_type,
                "launcher_pid": os.getpid(), "updated": time.time(),
                "nodes": [r.info() for r in self._records]}
        path = os.path.join(self.run_dir, "nodes.json")
        tmp = path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, path)
        except OSError as e:  # a full disk must not take the program down
            _logger.warning("could not write %s: %s", path, e)

    def _wait_for_service(self, r: _Record) -> None:
        """Returns once r's port accepts a TCP connection; raises NodeFailedError otherwise."""
        host, port = r.node.handle.address.rsplit(":", 1)
        deadline = time.monotonic() + self.service_timeout_s
        while True:
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                    return
            except OSError:
                pass
            self._poll(r)
            if r.done:
                raise self._failure_error(
                    r, f"service node {r.name} exited (code {r.exitcode}) before accepting "
                       f"connections on {r.node.handle.address}")
            if time.monotonic() > deadline:
                raise self._failure_error(
                    r, f"service node {r.name} did not accept TCP connections on "
                       f"{r.node.handle.address} within {self.service_timeout_s:g} s: does its "
                       "factory serve on the `port` it is given? (raise service_timeout_s if "
                       "it is only slow)")
            time.sleep(_POLL_S)

    def _failure_error(self, r: _Record, headline: Optional[str] = None) -> NodeFailedError:
        details = self._details(r)
        if headline is None:
            headline = f"node {r.name} failed (exit code {r.exitcode}{_signal_name(r.exitcode)})"
            if r.restarts:
                headline += f" after {r.restarts} restarts (max_restarts of its group)"
        return NodeFailedError(f"{headline}\n{details}", node=r.name, exitcode=r.exitcode,
                               details=details)

    def _log_path(self, node: Node) -> Optional[str]:
        return None

    # Subclasses implement these.
    def _prepare(self) -> None:
        """Checks and setup before any node starts."""

    def _start_node(self, r: _Record) -> None:
        raise NotImplementedError

    def _poll(self, r: _Record) -> None:
        """Records r's exit if it ended."""

    def _stop_records(self, kind: str, records: List[_Record]) -> None:
        raise NotImplementedError

    def _finish_stop(self) -> None:
        """Cleanup after every node stopped."""

    def _kill_all(self) -> None:
        """Kills whatever still runs, at once (processes only)."""

    def _details(self, r: _Record) -> str:
        raise NotImplementedError

    def _request_node_stop(self, r: _Record) -> None:
        """Asks one node's worker to stop (restart_node)."""
        raise NotImplementedError

    def _kill_node(self, r: _Record) -> None:
        """Kills one node that ignored a stop request (restart_node)."""
        raise NotImplementedError

    def _release_instance(self, r: _Record) -> None:
        """Frees what the ended instance of r still holds, before its restart."""


# ------------------------------------------------------------------------------ local_mt
class _ThreadLaunched(Launched):
    """local_mt: every node a daemon thread of this process."""

    launch_type = "local_mt"

    def _prepare(self) -> None:
        if self._env:
            os.environ.update(self._env)   # one process: the variables are shared by all nodes

    def _start_node(self, r: _Record) -> None:
        handle = r.node.handle
        if r.generation and isinstance(handle, PyNodeHandle):   # a restart: a new worker
            handle._ready.clear()
            handle._worker, handle._error = None, None
        r.control = _WorkerControl(r.name)
        r.thread = threading.Thread(target=self._thread_main, args=(r, r.generation),
                                    daemon=True, name=f"{self.program.name}/{r.name}")
        r.thread_name = r.thread.name
        r.status = "running"
        r.thread.start()

    def _thread_main(self, r: _Record, generation: int) -> None:
        node, handle = r.node, r.node.handle
        on_built = handle._set_worker if isinstance(handle, PyNodeHandle) else None
        port = _port(handle) if isinstance(handle, ServiceHandle) else None
        try:
            _build_and_run(r.name, node.fn, node.args, node.kwargs, port, r.control, on_built)
        except BaseException:  # noqa: BLE001 - reported through wait()
            tb = traceback.format_exc()
            if isinstance(handle, PyNodeHandle):
                handle._set_error(tb)
            self._record_exit(r, 1, tb, generation)
        else:
            if isinstance(handle, PyNodeHandle):
                handle._set_error("its worker was stopped before it was built")
            self._record_exit(r, 0, None, generation)

    def _request_node_stop(self, r: _Record) -> None:
        if r.control is not None:
            r.control.request_stop()

    def _kill_node(self, r: _Record) -> None:
        raise TimeoutError(f"node {r.name} ignored the stop request and a thread cannot be "
                           "killed; its restart is abandoned (use local_mp to kill nodes)")

    def _stop_records(self, kind: str, records: List[_Record]) -> None:
        for r in records:
            if r.control is not None:
                r.control.request_stop()
        deadline = time.monotonic() + self.notice_s
        for r in records:
            if r.thread is not None and r.thread is not threading.current_thread():
                r.thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            for r in records:
                if r.thread is not None and r.thread.is_alive() and not r.done:
                    r.status = "unresponsive"
                    _logger.warning("node %s did not return from run() within notice_s=%g s "
                                    "of stop(); left behind as a daemon thread",
                                    r.name, self.notice_s)
                elif r.thread is None and r.status == "pending":
                    r.status = "not_started"  # launch failed before it

    def _details(self, r: _Record) -> str:
        return r.error or "(no traceback)"


# ------------------------------------------------------------------------------ local_mp
class _ProcessLaunched(Launched):
    """local_mp: every node its own "spawn" process, logging to run_dir/logs/<name>.log."""

    launch_type = "local_mp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ctx = multiprocessing.get_context("spawn")
        self._reap_lock = threading.Lock()
        self._payloads: Dict[str, bytes] = {}
        self._monitor: Optional[threading.Thread] = None
        self._monitor_stop = threading.Event()

    def _log_path(self, node: Node) -> Optional[str]:
        return os.path.join(self.run_dir, "logs", f"{node.name}.log")

    def _prepare(self) -> None:
        """Pickles every node up front, so that a bad argument fails before anything starts."""
        os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        for r in self._records:
            node = r.node
            for h in find_handles((node.args, node.kwargs)):
                if isinstance(h, PyNodeHandle):
                    raise ValueError(
                        f"node {node.name} gets the handle of PyNode {h.name} in its arguments: "
                        "under local_mp a PyNode's worker lives in its own process and cannot "
                        "be dereferenced elsewhere; pass a ServiceNode's handle instead (or use "
                        "local_mt)")
            try:
                self._payloads[r.name] = pickle.dumps(
                    (node.fn, node.args, node.kwargs), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:
                raise TypeError(
                    f"node {node.name}: its function and arguments can't be pickled for "
                    f"local_mp ({type(e).__name__}: {e}); use module-level functions and "
                    "picklable arguments (or launch_type='local_mt')") from e
        self._monitor = threading.Thread(target=self._monitor_main, daemon=True,
                                         name=f"{self.program.name}/monitor")
        self._monitor.start()

    def _start_node(self, r: _Record) -> None:
        port = _port(r.node.handle) if r.kind == "service" else None
        # A restart appends to the log, after the crash it follows.
        with open(r.log_path, "a" if r.generation else "w") as f:
            what = f"restarting (restart {len(r.history)})" if r.generation else "starting"
            f.write(f"[launch] {self.program.name}/{r.name}: {what} ({time.ctime()})\n")
        # The stop channel: the launcher sends b"stop" to stop the node; the node reads EOF
        # when the launcher dies. (Not a multiprocessing.Event: its set() blocks forever once
        # a process that waited on it has exited.)
        reader, writer = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(
            target=_process_main, name=f"{self.program.name}/{r.name}",
            args=(self._payloads[r.name], r.name, port, r.log_path, reader, self.notice_s,
                  self._env))
        with _ENV_LOCK:
            # The child inherits this environment when its interpreter starts: the variables
            # are in place before it imports anything (OMP_NUM_THREADS before torch).
            saved = {k: os.environ.get(k) for k in self._env}
            os.environ.update(self._env)
            try:
                proc.start()
            finally:
                reader.close()
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        with self._cond:
            r.process = proc
            r.stop_conn = writer
            r.pid = proc.pid
            r.status = "running"

    def _poll(self, r: _Record) -> None:
        proc, generation = r.process, r.generation
        if proc is None or r.status != "running":
            return
        with self._reap_lock:
            code = proc.exitcode
        if code is not None:
            self._record_exit(r, code, None, generation)

    def _request_node_stop(self, r: _Record) -> None:
        conn = r.stop_conn
        if conn is not None:
            try:
                conn.send_bytes(b"stop")
            except OSError:  # it has exited already
                pass

    def _kill_node(self, r: _Record) -> None:
        proc = r.process
        if proc is None:
            return
        r.killed = True
        _signal(proc, signal.SIGTERM)
        proc.join(_KILL_GRACE_S)
        if proc.exitcode is None:
            _signal(proc, signal.SIGKILL)

    def _release_instance(self, r: _Record) -> None:
        conn, r.stop_conn, r.process = r.stop_conn, None, None
        if conn is not None:
            conn.close()

    def _monitor_main(self) -> None:
        """Notices processes that end, as soon as they end."""
        while not self._monitor_stop.is_set():
            live = [r for r in self._records
                    if r.process is not None and r.status == "running"]
            if not live:
                time.sleep(0.1)
                continue
            try:
                multiprocessing.connection.wait([r.process.sentinel for r in live], timeout=0.2)
            except (OSError, ValueError):  # a sentinel closed under us
                time.sleep(_POLL_S)
            for r in live:
                self._poll(r)

    def _stop_records(self, kind: str, records: List[_Record]) -> None:
        for r in records:
            if r.stop_conn is not None and not r.done:
                try:
                    r.stop_conn.send_bytes(b"stop")
                except OSError:  # it has exited already
                    pass
        self._wait_exit(records, self.notice_s)
        left = [r for r in records if r.process is not None and not r.done]
        for r in left:
            _logger.warning("node %s (pid %s) did not stop within notice_s=%g s; terminating",
                            r.name, r.pid, self.notice_s)
            r.killed = True
            _signal(r.process, signal.SIGTERM)
        self._wait_exit(left, _KILL_GRACE_S)
        left = [r for r in left if not r.done]
        for r in left:
            _signal(r.process, signal.SIGKILL)
        self._wait_exit(left, 10.0)
        with self._cond:
            for r in records:
                if r.process is None and r.status == "pending":
                    r.status = "not_started"  # launch failed before it

    def _wait_exit(self, records: List[_Record], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for r in records:
                self._poll(r)
            live = [r for r in records if r.process is not None and not r.done]
            remaining = deadline - time.monotonic()
            if not live or remaining <= 0:
                return
            try:
                multiprocessing.connection.wait([r.process.sentinel for r in live],
                                                timeout=min(remaining, 0.2))
            except (OSError, ValueError):
                time.sleep(_POLL_S)

    def _kill_all(self) -> None:
        live = [r for r in self._records if r.process is not None and not r.done]
        for r in live:
            r.killed = True
            _signal(r.process, signal.SIGKILL)
        self._wait_exit(live, 2.0)

    def _finish_stop(self) -> None:
        self._monitor_stop.set()
        for r in self._records:
            self._poll(r)
            if r.stop_conn is not None:
                r.stop_conn.close()
                r.stop_conn = None

    def _details(self, r: _Record) -> str:
        tail = _tail(r.log_path, LOG_TAIL_LINES) if r.log_path else ""
        details = f"pid {r.pid}; last {LOG_TAIL_LINES} lines of {r.log_path}:\n{tail}"
        if f"[launch] {r.name}: pid" not in _tail(r.log_path, 10**6):
            details += (
                "\n(the process died before the node's code started: while multiprocessing's "
                "spawn re-imported the main module or unpickled the arguments; that traceback "
                "went to the launcher's stderr. A script that launches must guard its code with "
                "`if __name__ == '__main__':`.)")
        return details


# ---------------------------------------------------------------------------------- launch
def launch(program: Program, launch_type: str = "local_mp", run_dir: Optional[str] = None,
           terminal_groups: Optional[Sequence[str]] = None,
           env: Optional[Mapping[str, str]] = None, notice_s: float = 10.0,
           service_timeout_s: float = 120.0,
           restart: Optional[Mapping[str, RestartPolicy]] = None,
           bind_host: str = "127.0.0.1",
           ray_address: Optional[str] = None,
           resources: Optional[Mapping[str, Mapping[str, float]]] = None) -> Launched:
    """Starts every node of `program` and returns the running program.

    launch_type: "local_mp" (a process per node, the default), "local_mt" (a thread per node)
      or "ray" (a Ray actor per node; needs `pip install .[ray]`).
    run_dir: where nodes.json and logs/ go (a new temporary folder when None).
    terminal_groups: the groups whose PyNodes `wait()` waits for (all PyNodes when None);
      groups the program lacks are skipped (an evaluator that is switched off) but at least one
      must exist.
    env: environment variables for the nodes, in place before their interpreter starts (local_mp;
      under local_mt they are set in this process).
    notice_s: how long stop() gives nodes to return from run() before terminating them.
    service_timeout_s: how long a service node may take to accept TCP connections.
    restart: group label -> RestartPolicy: crashed nodes of those groups are started again
      (see the module docstring); groups the program lacks are ignored.
    bind_host: the interface the program's service factories bind (they are told separately,
      e.g. by SAOConfig.bind_host); it decides the addresses handles resolve to: 127.0.0.1 for
      loopback or wildcard binds on one machine, the node's IP for wildcard binds under Ray.
    ray_address: launch_type="ray" only: the cluster to join ("auto", "ray://host:10001", ...);
      None starts a local Ray instance unless this process already called ray.init().
    resources: launch_type="ray" only: group label -> Ray resources of each of its nodes, e.g.
      {"learner": {"num_cpus": 1, "num_gpus": 1}} (unlisted groups reserve nothing).
    """
    if launch_type not in LAUNCH_TYPES:
        raise ValueError(f"launch_type={launch_type!r}: must be one of {LAUNCH_TYPES}")
    if launch_type != "ray" and (ray_address is not None or resources):
        raise ValueError(f"ray_address / resources apply to launch_type='ray' only, not "
                         f"{launch_type!r}")
    if not isinstance(program, Program):
        raise TypeError(f"launch({program!r}): expected a Program")
    if not program.nodes:
        raise ValueError(f"program {program.name!r} has no nodes")
    if notice_s < 0:
        raise ValueError(f"notice_s={notice_s}: must be >= 0 (seconds stop() waits before "
                         "terminating a node)")
    if service_timeout_s <= 0:
        raise ValueError(f"service_timeout_s={service_timeout_s}: must be > 0")
    if program._launched:
        raise RuntimeError(f"program {program.name!r} was already launched; build a new Program "
                           "to launch again")
    own = {id(n.handle) for n in program.nodes}
    for n in program.nodes:
        for h in find_handles((n.args, n.kwargs)):
            if id(h) not in own:
                raise ValueError(f"node {n.name} gets handle {h.name!r} of another program")
    if run_dir is None:
        run_dir = tempfile.mkdtemp(prefix=f"{program.name}-")
    os.makedirs(run_dir, exist_ok=True)
    if launch_type == "ray":
        from sao_actor_learner.launch.ray import RayLaunched   # imports ray (optional extra)
        launched: Launched = RayLaunched(
            program, run_dir, terminal_groups, env or {}, notice_s, service_timeout_s,
            restart=restart, bind_host=bind_host, ray_address=ray_address,
            resources=resources or {})
    else:
        cls = _ProcessLaunched if launch_type == "local_mp" else _ThreadLaunched
        launched = cls(program, run_dir, terminal_groups, env or {}, notice_s,
                       service_timeout_s, restart=restart, bind_host=bind_host)
    program._launched = True
    try:
        launched._start()
    except BaseException:
        launched.stop()
        raise
    return launched


# ------------------------------------------------------------------------- node internals
class _WorkerControl:
    """Links a node's worker with the stop request that may arrive from another thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._worker: Any = None
        self.stop_requested = False

    def set_worker(self, worker: Any) -> bool:
        """Registers the built worker; False (and the worker told to stop) if stop came first."""
        with self._lock:
            if not self.stop_requested:
                self._worker = worker
                return True
        _call_stop(worker, self.name)
        return False

    def request_stop(self) -> None:
        """Asks the worker (now, or as soon as it is built) to stop; once."""
        with self._lock:
            if self.stop_requested:
                return
            self.stop_requested = True
            worker = self._worker
        if worker is not None:
            _call_stop(worker, self.name)


def _call_stop(worker: Any, name: str) -> None:
    try:
        worker.stop()
    except Exception:  # noqa: BLE001 - a failing stop() must not kill the watcher
        print(f"[launch] {name}: worker.stop() raised:", file=sys.stderr)
        traceback.print_exc()


# Builds run one at a time within a process: under local_mt several nodes would otherwise import
# the same lazily-imported packages concurrently, and some (transformers' lazy modules) are not
# safe to import from two threads at once. Runs stay concurrent.
_BUILD_LOCK = threading.Lock()


def _build_and_run(name: str, fn: Callable[..., Any], args: tuple, kwargs: dict,
                   port: Optional[int], control: _WorkerControl,
                   on_built: Optional[Callable[[Any], None]] = None) -> None:
    """In the node's own process or thread: dereference handles, build the worker, run it."""
    with _BUILD_LOCK:
        args, kwargs = map_handles((args, kwargs), lambda h: h.dereference())
        if port is not None:
            kwargs = dict(kwargs, port=port)
        if control.stop_requested:
            return
        worker = fn(*args, **kwargs)
    if not callable(getattr(worker, "run", None)) or not callable(getattr(worker, "stop", None)):
        raise TypeError(f"node {name}: {getattr(fn, '__qualname__', fn)} returned "
                        f"{type(worker).__name__}, not a Worker (needs run() and stop())")
    if on_built is not None:
        on_built(worker)
    if control.set_worker(worker):
        worker.run()


def _process_main(payload: bytes, name: str, port: Optional[int], log_path: str,
                  stop_conn: Any, notice_s: float, env: Mapping[str, str]) -> None:
    """Entry point of a node's process (spawned)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C is the launcher's to handle
    _redirect_output(log_path)
    os.environ.update(env)
    print(f"[launch] {name}: pid {os.getpid()}, launcher pid {os.getppid()}", flush=True)
    control = _WorkerControl(name)

    def watch_launcher() -> None:
        """b"stop" asks the worker to stop; EOF means the launcher died: stop, then exit."""
        while True:
            try:
                stop_conn.recv_bytes()
            except (EOFError, OSError):
                break
            print(f"[launch] {name}: stop requested", flush=True)
            control.request_stop()
        print(f"[launch] {name}: the launcher is gone; stopping", flush=True)
        control.request_stop()
        time.sleep(notice_s)
        print(f"[launch] {name}: still running {notice_s:g} s after the launcher died; exiting",
              flush=True)
        _flush()
        os._exit(1)

    threading.Thread(target=watch_launcher, daemon=True, name="launch-watcher").start()
    code = 0
    try:
        fn, args, kwargs = pickle.loads(payload)
        _build_and_run(name, fn, args, kwargs, port, control)
        print(f"[launch] {name}: run() returned", flush=True)
    except BaseException:  # noqa: BLE001 - the log and the exit code carry it
        traceback.print_exc()
        code = 1
    _flush()

    def force_exit() -> None:   # threads the worker left behind must not keep us alive
        time.sleep(max(notice_s, 1.0))
        print(f"[launch] {name}: non-daemon threads still running; exiting", flush=True)
        _flush()
        os._exit(code)

    threading.Thread(target=force_exit, daemon=True).start()
    if code:
        sys.exit(code)


def _redirect_output(log_path: str) -> None:
    """Points this process's stdout and stderr (file descriptors 1 and 2 too) at log_path."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream_name, fdno in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, stream_name)
        if stream is None or not hasattr(stream, "reconfigure"):
            setattr(sys, stream_name, open(fdno, "w", buffering=1, closefd=False))
        else:
            stream.reconfigure(line_buffering=True)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


def _signal(proc: Any, sig: int) -> None:
    try:
        os.kill(proc.pid, sig)
    except (ProcessLookupError, TypeError):
        pass


def _signal_name(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f", killed by {signal.Signals(-code).name}"
        except ValueError:
            return ""
    return ""


def _port(handle: Handle) -> int:
    return int(handle.address.rsplit(":", 1)[1])


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a service reachable from this machine only."""
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def local_service_host(bind_host: str) -> str:
    """The host that reaches a service bound to `bind_host` from this machine."""
    if is_loopback(bind_host) or bind_host in WILDCARD_HOSTS:
        return "127.0.0.1"
    return bind_host


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """n distinct free TCP ports on `host` (bound together, then released)."""
    socks = []
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        for _ in range(n):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind((host.strip("[]"), 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: str, n: int) -> str:
    """The last n lines of a text file (empty if it can't be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            data = f.read()
    except OSError as e:
        return f"(could not read the log: {e})"
    lines = data.decode("utf-8", "replace").splitlines()
    return "\n".join(lines[-n:])
