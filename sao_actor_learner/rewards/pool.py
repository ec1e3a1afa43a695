"""A pool of reward worker processes whose calls have a wall-clock timeout.

Each worker is a fresh Python interpreter (started with subprocess, so it does not re-import the
parent's `__main__` the way multiprocessing's "spawn" does, and never loads torch) that loads the
reward function by its spec itself, so user functions need not be picklable, and then answers
one job at a time over a socket pair (a multiprocessing Connection). Guarantees of
`WorkerPool.call`:

  - at most `workers` calls run at once; further callers (any thread) block until a worker is
    free, and neither that wait nor a worker's start-up counts against `timeout_s`;
  - a call that gets no answer within `timeout_s` seconds SIGKILLs its worker, starts a
    replacement and returns failure "timeout"; a worker that dies during a call (a crash, a
    segfault, os._exit) is replaced too and the call returns failure "raised";
  - a call never raises because of the reward function; it raises RuntimeError after `close()`.

Workers ignore SIGINT (the parent decides when they stop) and, on Linux, are SIGKILLed when the
parent dies (PR_SET_PDEATHSIG); they also exit when their connection closes.
"""
from __future__ import annotations

import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Connection, Pipe
from typing import Optional, Set, Tuple

from sao_actor_learner.secret_env import without_secrets

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_WORKER_CODE = "from sao_actor_learner.rewards.pool import worker_main; worker_main()"


class _Worker:
    """One worker process and the parent's end of its connection."""

    def __init__(self, spec: str, timeout_s: float):
        parent, child = Pipe(duplex=True)
        env = without_secrets()   # user reward code: none of the run's secrets
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        env["SAO_REWARD_WORKER"] = f"{child.fileno()}:{os.getpid()}"
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_CODE], env=env,
                                         pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            child.close()
        self.conn: Connection = parent
        self.ready = False
        parent.send((spec, timeout_s))

    def wait_ready(self, timeout_s: float) -> Optional[str]:
        """None once the worker has loaded the reward function, else why it has not."""
        try:
            if not self.conn.poll(timeout_s):
                return f"worker pid {self.proc.pid} did not start within {timeout_s:.0f} s"
            kind, detail = self.conn.recv()
        except (EOFError, OSError):
            return f"worker pid {self.proc.pid} exited at start-up (exit code {self.exit_code()})"
        self.ready = kind == "ready"
        return None if self.ready else detail

    def exit_code(self) -> Optional[int]:
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.exit_code()
        self.conn.close()


def _kill_all(live: Set[_Worker]) -> None:
    for w in list(live):
        w.kill()
    live.clear()


class WorkerPool:
    """`workers` reward worker processes for one spec (started lazily; see the module docstring).

    `call(args)` returns `(RewardResult, detail)`, where `detail` explains a failure for logging.
    `start_timeout_s` bounds a worker's start-up (importing the reward and its dependencies).
    """

    def __init__(self, spec: str, *, workers: int, timeout_s: float,
                 start_timeout_s: float = 120.0):
        self.spec, self.timeout_s, self.start_timeout_s = spec, timeout_s, start_timeout_s
        self._slots: "queue.SimpleQueue[Optional[_Worker]]" = queue.SimpleQueue()
        for _ in range(workers):
            self._slots.put(None)  # a slot whose worker has not been started yet
        self._lock = threading.Lock()
        self._live: Set[_Worker] = set()
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill_all, self._live)

    def _spawn(self) -> Optional[_Worker]:
        with self._lock:
            if self._closed:
                return None
            w = _Worker(self.spec, self.timeout_s)
            self._live.add(w)
            return w

    def _retire(self, w: _Worker) -> None:
        with self._lock:
            self._live.discard(w)
        w.kill()

    def _replace(self, w: _Worker) -> Optional[_Worker]:
        """Kills `w` and starts its replacement (which loads while nobody waits for it)."""
        self._retire(w)
        try:
            return self._spawn()
        except OSError:
            return None  # started again by the next call that takes this slot

    def call(self, args: tuple) -> Tuple["RewardResult", str]:
        from sao_actor_learner.rewards import RewardResult
        try:
            payload = pickle.dumps(args)
        except Exception as e:
            return RewardResult(0.0, "raised"), f"arguments cannot be pickled: {e!r}"
        w = self._slots.get()
        done = False
        try:
            if self._closed:
                raise RuntimeError(f"reward {self.spec!r} is closed")
            if w is not None and w.proc.poll() is not None:
                w = self._replace(w)
            if w is None:
                w = self._spawn()
                if w is None:
                    raise RuntimeError(f"reward {self.spec!r} is closed")
            if not w.ready:
                error = w.wait_ready(self.start_timeout_s)
                if error is not None:
                    self._retire(w)
                    w, done = None, True
                    return RewardResult(0.0, "raised"), f"reward worker failed to start: {error}"
            try:
                w.conn.send_bytes(payload)
                answered = w.conn.poll(self.timeout_s)
                if answered:
                    result, detail = w.conn.recv()
                    done = True
                    return result, detail
            except (EOFError, OSError):
                pid, code = w.proc.pid, w.exit_code()
                w, done = self._replace(w), True
                return (RewardResult(0.0, "raised"),
                        f"reward worker pid {pid} died during the call (exit code {code})")
            pid = w.proc.pid
            w, done = self._replace(w), True
            return (RewardResult(0.0, "timeout"), f"no answer within {self.timeout_s:g} s; "
                    f"worker pid {pid} killed and replaced")
        finally:
            if not done and w is not None and w.ready:
                # Interrupted mid-call (KeyboardInterrupt in the caller): the worker may still be
                # busy with this job, so it must not answer the next one.
                w = self._replace(w)
            self._slots.put(w)

    def close(self) -> None:
        """Kills every worker (idempotent); in-flight calls return failure "raised"."""
        with self._lock:
            self._closed = True
        self._finalizer()


def _describe(value) -> str:
    try:
        return f"returned {type(value).__name__} {repr(value)[:200]}"
    except Exception:
        return f"returned {type(value).__name__}"


def worker_main() -> None:
    """The worker process: load the reward named by the first message, then answer jobs."""
    fd, parent_pid = (int(x) for x in os.environ.pop("SAO_REWARD_WORKER").split(":"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # Linux: die with the parent even while a reward function hangs
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != parent_pid:
        return
    conn = Connection(fd)
    from sao_actor_learner.rewards import load_reward_function, to_result
    spec, timeout_s = conn.recv()
    try:
        fn = load_reward_function(spec, timeout_s)
    except BaseException as e:  # noqa: B036 - user code may raise anything
        conn.send(("error", f"loading {spec!r} failed with {type(e).__name__}: {e}"))
        return
    conn.send(("ready", ""))
    while True:
        try:
            data_source, solution_str, ground_truth, extra_info = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            value = fn(data_source, solution_str, ground_truth, extra_info=extra_info)
            result = to_result(value)
            detail = "" if result.failure is None else _describe(value)
        except BaseException as e:  # noqa: B036 - SystemExit, or math-verify's TimeoutException
            from sao_actor_learner.rewards import RewardResult
            result, detail = RewardResult(0.0, "raised"), f"{type(e).__name__}: {e}"[:2000]
        conn.send((result, detail))
