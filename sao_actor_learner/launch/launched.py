"""A launched program: its nodes' statuses, `wait()`, `stop()`, restarts and nodes.json.

One `Launched` class serves every launcher; a launcher only supplies a `Runner` (runner.py).
Guarantees:

- Start: service nodes start first, on the addresses the runner picked; PyNodes start once
  every service accepts TCP connections (within `service_timeout_s`, else NodeFailedError).
- Stop: cooperative. PyNodes are asked first (their worker's stop()), then services; each set
  gets `notice_s` seconds to return from run(), then what is left is terminated and then
  killed (a thread cannot be: it is left behind as "unresponsive"). `stop()` is idempotent and
  safe from any thread; a second interrupt while it runs kills the rest at once.
- Instances never outlive the launcher: `wait()` and `launch()` stop what they started when
  they raise (KeyboardInterrupt too), and an atexit hook stops programs still running at exit.
- Restarts follow supervisor.py. A restart's nodes start services first, then PyNodes, each
  service on its old address; restarts do not wait for readiness.
- `run_dir/nodes.json` lists every node (records.NodeRecord.info) and every together-group
  (restart count and history), rewritten atomically whenever a status changes.

Pure standard library.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing.util  # noqa: F401  (registers its atexit hook before ours: ours runs first)
import os
import threading
import time
import traceback
from typing import Any, Dict, List, Mapping, Optional, Sequence

from sao_actor_learner.launch.addresses import probe_host, split_address
from sao_actor_learner.launch.nodeset import NodeSet, terminal_records
from sao_actor_learner.launch.program import Program
from sao_actor_learner.launch.records import NodeFailedError, NodeRecord, write_json_atomic
from sao_actor_learner.launch.runner import Runner
from sao_actor_learner.launch.supervisor import RestartPlan, RestartPolicy, Supervisor

__all__ = ["Launched"]

_POLL_S = 0.05
_logger = logging.getLogger(__name__)
_LIVE: "set[Launched]" = set()        # strong refs: dropped programs are still stopped at exit
_LIVE_LOCK = threading.Lock()


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

    def __init__(self, program: Program, runner: Runner, run_dir: str,
                 terminal_groups: Optional[Sequence[str]] = None,
                 env: Optional[Mapping[str, str]] = None, notice_s: float = 10.0,
                 service_timeout_s: float = 120.0,
                 restart: Optional[Mapping[str, RestartPolicy]] = None,
                 bind_host: str = "127.0.0.1",
                 group_env: Optional[Mapping[str, Mapping[str, str]]] = None) -> None:
        self.program, self.runner, self.run_dir = program, runner, run_dir
        self.launch_type = runner.launch_type
        self.notice_s = float(notice_s)
        self.service_timeout_s = float(service_timeout_s)
        self.bind_host = bind_host
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.group_env = {str(g): {str(k): str(v) for k, v in e.items()}
                          for g, e in (group_env or {}).items()}
        self._stop_lock = threading.RLock()
        self._stop_requested = self._stopped = self._started = False
        self._stop_event = threading.Event()     # wakes restarts waiting out their backoff
        self._restart_lock = threading.Lock()    # a restart's start vs. stop()
        runner.attach(self)
        self._nodes = NodeSet([NodeRecord(n, runner.log_path(n)) for n in program.nodes],
                              runner, self.notice_s)
        self._records, self._by_name, self._cond = \
            self._nodes.records, self._nodes.by_name, self._nodes.cond
        self._terminal = terminal_records(program, self._records, terminal_groups)
        self._supervisor = Supervisor(program.name, restart or {}, self._records)

    # ------------------------------------------------------------------------------- views
    @property
    def addresses(self) -> Dict[str, List[Optional[str]]]:
        """label -> the addresses ("127.0.0.1:PORT") of the group's service nodes."""
        return self._nodes.by_label(lambda r: r.node.handle.address, kind="service")

    @property
    def exitcodes(self) -> Dict[str, List[Optional[int]]]:
        """label -> each node's exit code (None while running; threads: 0 returned, 1 raised)."""
        return self._nodes.by_label(lambda r: r.exitcode)

    @property
    def statuses(self) -> Dict[str, List[str]]:
        """label -> each node's status (see records.py)."""
        return self._nodes.by_label(lambda r: r.status)

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

    @property
    def group_restarts(self) -> Dict[str, int]:
        """label -> restarts of each together-group after crashes (supervisor.py)."""
        with self._cond:
            return self._supervisor.group_restarts

    @property
    def stopped(self) -> bool:
        """Whether stop() has finished."""
        return self._stopped

    # ------------------------------------------------------------------------ control
    def restart_node(self, name: str) -> None:
        """Restarts running node `name` now and returns once its new instance has started.

        The node is asked to stop as `stop()` would ask it (a replay node writes its checkpoint
        on the way out), gets `notice_s` seconds, is killed if it has not exited by then, and is
        started again at once (with its whole group if that restarts together): a service on
        the same address. Recorded in nodes.json (reason "requested"), never counted against
        max_restarts. Raises KeyError for an unknown node, RuntimeError when it is not running.
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
        self.runner.request_stop(r)
        self._nodes.wait_exit([r], self.notice_s)
        if self._nodes.live([r], {r: generation}):
            _logger.warning("node %s did not stop within notice_s=%g s of restart_node(); "
                            "killing it", name, self.notice_s)
            if self._nodes.force([r], {r: generation}):
                raise TimeoutError(f"node {name} ignored the stop request and a thread cannot be "
                                   "killed; its restart is abandoned (use local_mp to kill nodes)")
        deadline = time.monotonic() + 2 * self.notice_s + 10.0 + self.service_timeout_s
        with self._cond:
            while r.generation == generation or r.status == "restarting" or r.starting:
                if r.done or self._stop_requested:
                    raise RuntimeError(f"restart_node({name!r}): the node is {r.status} instead "
                                       "of restarted")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"restart_node({name!r}): not restarted in time")
                self._cond.wait(min(remaining, 0.1))

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
                while self._first_failure() is None:
                    if self._stopped or (self._terminal and all(
                            r.status == "finished" for r in self._terminal)):
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
        """Stops every node: PyNodes first, then services (see the module docstring).

        Never raises for nodes' failures (see `wait()` and `statuses`)."""
        with self._stop_lock:
            if self._stopped or self._stop_requested:
                return   # done, or re-entered from an exception raised while stopping
            self._stop_requested = True
            self._stop_event.set()
            with self._restart_lock:   # a restart now starting finishes first; no new ones
                with self._cond:
                    for r in self._records:
                        if r.status == "restarting":
                            r.status, r.plan = "stopped", None
            completed = False
            try:
                for kind in ("py", "service"):
                    records = [r for r in self._records if r.kind == kind]
                    stuck = self._nodes.stop(records) if records else []
                    with self._cond:
                        for r in stuck:
                            if r.status == "running":
                                r.status = "unresponsive"
                                _logger.warning("node %s did not return from run() within "
                                                "notice_s=%g s of stop(); left behind as a "
                                                "daemon thread", r.name, self.notice_s)
                completed = True
            finally:
                if not completed:   # interrupted (a second Ctrl-C): no more notice
                    self._nodes.kill_all()
                self.runner.finish(self._records)
                with _LIVE_LOCK:
                    _LIVE.discard(self)
                with self._cond:
                    for r in self._records:
                        if r.status == "pending":
                            r.status = "not_started"  # launch failed before it
                    self._stopped = True
                    self._write_nodes_json()
                    self._cond.notify_all()

    def __enter__(self) -> "Launched":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.program.name!r}, {self.launch_type}, "
                f"run_dir={self.run_dir!r}, statuses={self.statuses})")

    # ------------------------------------------------------------------- for the runners
    def start(self) -> None:
        """The start sequence (once): addresses, checks, services, readiness, PyNodes."""
        if self._started:
            raise RuntimeError(f"program {self.program.name!r} was already started")
        self._started = True
        with _LIVE_LOCK:
            _LIVE.add(self)
        self.runner.setup(self._records)
        services = [r for r in self._records if r.kind == "service"]
        for r, address in zip(services, self.runner.service_addresses(services)):
            r.node.handle.bind_address(address)
        for r in self._records:
            if r.kind == "py":
                r.node.handle.bind_launch_type(self.launch_type)
        self.runner.prepare(self._records)
        self._start_nodes(self._records, wait_ready=True)

    def node_exited(self, r: NodeRecord, exitcode: int, error: Optional[str] = None,
                    generation: Optional[int] = None) -> None:
        """Runners report here that instance `generation` of r (None: the current) ended."""
        with self._cond:
            if r.status != "running" or (generation is not None and generation != r.generation):
                return
            plan = self._supervisor.on_exit(r, exitcode, error, self._stop_requested)
            if plan is not None:
                threading.Thread(target=self._carry_out, args=(plan,), daemon=True,
                                 name=f"{self.program.name}/restart-{r.name}").start()
            self._write_nodes_json()
            self._cond.notify_all()

    # ----------------------------------------------------------------------- internals
    def _start_nodes(self, records: List[NodeRecord], wait_ready: bool,
                     plan: Optional[RestartPlan] = None) -> None:
        """Services first (waiting until they accept connections when `wait_ready`), then
        PyNodes; a node that fails to start is "failed" (failing `plan` when a restart's)."""
        services = [r for r in records if r.kind == "service"]
        for r in services:
            self._start_node(r, plan)
        if wait_ready:
            for r in services:
                self._wait_for_service(r)
        for r in records:
            if r.kind == "py":
                self._start_node(r, plan)

    def _start_node(self, r: NodeRecord, plan: Optional[RestartPlan]) -> None:
        with self._cond:   # "running" first: an instance may end before start() returns
            if r.status != ("restarting" if plan else "pending"):
                return     # the launch leaves a node that waits for its group's restart
            r.status, r.starting = "running", True
        try:
            if r.generation:
                self.runner.release(r)   # what the ended instance still holds
            self.runner.start(r)
        except BaseException:
            with self._cond:
                r.status, r.error = "failed", traceback.format_exc()
                if plan is not None:
                    self._supervisor.plan_failed(plan, r, "failed to start")
            raise
        finally:
            with self._cond:
                r.starting = False
                self._write_nodes_json()
                self._cond.notify_all()

    def _carry_out(self, plan: RestartPlan) -> None:
        """Carries out a restart plan: stop the members still running, wait out the backoff,
        start every member again (unless the program stops first)."""
        generations = {m: m.generation for m in plan.to_stop}
        stuck = self._nodes.stop(plan.to_stop, generations) if plan.to_stop else []
        with self._cond:
            if self._stop_requested:
                return
            left = [m for m in plan.to_stop if m.status != "restarting"]
            if left:
                m = left[0]
                why = ("ignored the stop request, and a thread cannot be killed" if m in stuck
                       else f"is {m.status} instead of stopped")
                self._supervisor.plan_failed(plan, m, why)
                self._write_nodes_json()
                self._cond.notify_all()
                return
        self._stop_event.wait(max(0.0, plan.due - time.monotonic()))
        with self._restart_lock:
            with self._cond:
                if self._stop_requested or any(m.plan is not plan or m.status != "restarting"
                                               for m in plan.members):
                    return
                for m in plan.members:
                    if m not in plan.fresh:   # instance 0 of a fresh one is still to come
                        m.generation += 1
                self._supervisor.plan_started(plan)
            try:
                self._start_nodes(plan.members, wait_ready=False, plan=plan)
            except BaseException:  # noqa: BLE001 - the node is "failed": wait() raises
                return
            with self._cond:
                _logger.info("%s restarted (pids %s)", plan.what(),
                             [m.pid for m in plan.members])
                self._write_nodes_json()
                self._cond.notify_all()

    def _wait_for_service(self, r: NodeRecord) -> None:
        """Returns once r's port accepts a TCP connection; raises NodeFailedError otherwise."""
        address = r.node.handle.address
        host, port = split_address(address)
        host = probe_host(self.bind_host, host)
        deadline = time.monotonic() + self.service_timeout_s
        while not self.runner.port_open(r, host, port):
            self.runner.poll(r)
            if r.done:
                raise self._failure_error(
                    r, f"service node {r.name} exited (code {r.exitcode}) before accepting "
                       f"connections on {address}")
            if time.monotonic() > deadline:
                raise self._failure_error(
                    r, f"service node {r.name} did not accept TCP connections on {address} "
                       f"within {self.service_timeout_s:g} s: does its factory serve on the "
                       "`port` it is given? (raise service_timeout_s if it is only slow)")
            time.sleep(_POLL_S)

    def _first_failure(self) -> Optional[NodeRecord]:
        return next((r for r in self._records if r.status == "failed"), None)

    def _failure_error(self, r: NodeRecord, headline: Optional[str] = None) -> NodeFailedError:
        details = self.runner.details(r)
        if r.headline and r.error and r.error[-200:] not in details:
            details += "\n" + r.error[-4000:]
        headline = headline or self._supervisor.failure_headline(r)
        return NodeFailedError(f"{headline}\n{details}", node=r.name, exitcode=r.exitcode,
                               details=details)

    def _write_nodes_json(self) -> None:
        """Rewrites run_dir/nodes.json (atomically). Call with self._cond held."""
        data = {"program": self.program.name, "launch_type": self.launch_type,
                "launcher_pid": os.getpid(), "updated": time.time(),
                "nodes": [r.info() for r in self._records]}
        groups = self._supervisor.groups_info()
        if groups:
            data["groups"] = groups
        path = os.path.join(self.run_dir, "nodes.json")
        try:
            write_json_atomic(path, data)
        except OSError as e:  # a full disk must not take the program down
            _logger.warning("could not write %s: %s", path, e)
