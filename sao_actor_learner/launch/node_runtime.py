"""What runs inside a node: its thread (local_mt), its process (local_mp) or its Ray actor.

Guarantees:
- `build_and_run` dereferences the handles in the node's arguments in the node's own process
  (or thread), builds the worker with the node's factory (a service's gets `port=`), checks it
  is a Worker (run() and stop()) and runs it. Builds run one at a time within a process (some
  lazily imported packages are not safe to import from two threads at once); runs are
  concurrent.
- A stop request (`WorkerControl.request_stop`) reaches the worker once: at once if it is
  built, else as soon as it is, and a worker built after the request never runs.
- `process_main`, a spawned node process's entry point: Ctrl-C is left to the launcher; the
  process's output goes to its log; the launcher's b"stop" on the stop pipe asks the worker to
  stop, and EOF (the launcher died) stops it too, with `notice_s` seconds before the process
  exits; threads the worker leaves behind never keep the process alive past
  `max(notice_s, 1)` seconds after run() ends, nor, after a stop request, past half the notice
  (so a worker that stopped in time is never killed for its leftover threads). The exit code is 0 when run() returned, 1 when
  it raised (the traceback goes to the log).
- With a heartbeat counter (local_mp with node_timeout_s > 0), a daemon thread keeps it moving
  from the process's start until run() ends, whatever the worker does (liveness.py).

Pure standard library.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Mapping, Optional

from sao_actor_learner.launch.liveness import start_heartbeat
from sao_actor_learner.launch.logs import flush_std_streams, redirect_output
from sao_actor_learner.launch.placement import apply_cpu_set
from sao_actor_learner.launch.program import map_handles

__all__ = ["WorkerControl", "build_and_run", "process_main", "watch_parent"]

_BUILD_LOCK = threading.Lock()


class WorkerControl:
    """Links a node's worker with the stop request that may arrive from another thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._worker: Any = None
        self.stop_requested = False
        self.stop_time: Optional[float] = None   # time.monotonic() of the first stop request

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
            self.stop_time = time.monotonic()
            worker = self._worker
        if worker is not None:
            _call_stop(worker, self.name)


def _call_stop(worker: Any, name: str) -> None:
    try:
        worker.stop()
    except Exception:  # noqa: BLE001 - a failing stop() must not kill the watcher
        print(f"[launch] {name}: worker.stop() raised:", file=sys.stderr)
        traceback.print_exc()


def build_and_run(name: str, fn: Callable[..., Any], args: tuple, kwargs: dict,
                  port: Optional[int], control: WorkerControl,
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


def watch_parent(stop_conn: Any, control: WorkerControl, notice_s: float) -> None:
    """Reads the stop pipe: b"stop" asks the worker to stop; EOF means the launcher died: stop,
    then exit the process `notice_s` seconds later if it is still running."""
    name = control.name
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
    flush_std_streams()
    os._exit(1)


def process_main(payload: bytes, name: str, port: Optional[int], log_path: str,
                 stop_conn: Any, notice_s: float, env: Mapping[str, str],
                 heartbeat: Any = None, heartbeat_interval_s: float = 1.0) -> None:
    """Entry point of a node's process (spawned by local_mp). `heartbeat`: the launcher's
    shared counter this process's heartbeat thread keeps moving (liveness.py), or None."""
    beating = None
    if heartbeat is not None:     # first: the launcher watches this instance from its first beat
        beating = start_heartbeat(heartbeat, heartbeat_interval_s)
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C is the launcher's to handle
    redirect_output(log_path)
    os.environ.update(env)
    cores = apply_cpu_set()    # --placement: this group's CPU set (launch/placement.py)
    print(f"[launch] {name}: pid {os.getpid()}, launcher pid {os.getppid()}"
          + (f", cores {list(cores)}" if cores else ""), flush=True)
    control = WorkerControl(name)
    threading.Thread(target=watch_parent, args=(stop_conn, control, notice_s), daemon=True,
                     name="launch-watcher").start()
    code = 0
    try:
        fn, args, kwargs = pickle.loads(payload)
        build_and_run(name, fn, args, kwargs, port, control)
        print(f"[launch] {name}: run() returned", flush=True)
    except BaseException:  # noqa: BLE001 - the log and the exit code carry it
        traceback.print_exc()
        code = 1
    if beating is not None:       # the work is done: exiting may take a while (liveness.py)
        beating.finish()
    flush_std_streams()

    # Threads the worker left behind must not keep the process alive: at most max(notice_s, 1)
    # seconds after run() ended, and, once a stop was requested, no later than halfway through
    # the launcher's notice (which started with the request), so a node that stopped in time
    # exits by itself with its own exit code instead of being killed at the notice's end.
    deadline = time.monotonic() + max(notice_s, 1.0)
    if control.stop_time is not None:
        deadline = min(deadline, control.stop_time + notice_s / 2)

    def force_exit() -> None:
        time.sleep(max(0.0, deadline - time.monotonic()))
        print(f"[launch] {name}: non-daemon threads still running; exiting", flush=True)
        flush_std_streams()
        os._exit(code)

    threading.Thread(target=force_exit, daemon=True).start()
    if code:
        sys.exit(code)
