"""Toy workers for tests/launch/test_launch.py: module-level, picklable, importing nothing heavy."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from typing import Any, Optional

from sao_actor_learner.core import Worker


class EchoServer(Worker):
    """A TCP server on 127.0.0.1:port answering each line `x` with `<greeting>:x`."""

    def __init__(self, greeting: str, port: int) -> None:
        self.greeting = greeting
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self._sock.settimeout(0.05)

    def run(self) -> None:
        self._sock.listen(16)
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = self._sock.accept()
                except socket.timeout:
                    continue
                with conn:
                    conn.settimeout(2.0)
                    try:
                        line = conn.makefile("r").readline().strip()
                    except OSError:   # the launcher's readiness probe closes at once
                        continue
                    if line:
                        conn.sendall(f"{self.greeting}:{line}\n".encode())
        finally:
            self._sock.close()

    def stop(self) -> None:
        self._stop.set()


def make_echo_server(greeting: str, port: int) -> EchoServer:
    return EchoServer(greeting, port)


class EchoClient:
    """Talks to an EchoServer; remembers the pid of the process that built it."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.built_in_pid = os.getpid()

    def ask(self, text: str) -> str:
        host, port = self.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5.0) as conn:
            conn.sendall(f"{text}\n".encode())
            return conn.makefile("r").readline().strip()


def make_echo_client(address: str) -> EchoClient:
    return EchoClient(address)


@dataclasses.dataclass(frozen=True)
class AskConfig:
    """A config dataclass with a handle inside, dereferenced by the launcher."""
    client: Any
    questions: tuple = ("a", "b")


class Asker(Worker):
    """Asks the echo service each question, writes what it saw to out_path, returns."""

    def __init__(self, out_path: str, config: AskConfig, clients: dict, delay_s: float) -> None:
        self.out_path, self.config, self.clients, self.delay_s = out_path, config, clients, delay_s

    def run(self) -> None:
        time.sleep(self.delay_s)
        client = self.config.client
        result = {
            "pid": os.getpid(),
            "client_type": type(client).__name__,
            "client_built_in_pid": client.built_in_pid,
            "same_client_twice": self.clients["again"] is client,
            "raw_address": self.clients["raw"],
            "replies": [client.ask(q) for q in self.config.questions],
            "env": os.environ.get("SAO_LAUNCH_TEST"),
        }
        print("asker result", result, flush=True)
        _write_json(self.out_path, result)


def make_asker(out_path: str, config: AskConfig, clients: dict, delay_s: float = 0.0) -> Asker:
    return Asker(out_path, config, clients, delay_s)


class Forever(Worker):
    """Runs until stop(). Its marker file says {"stopped": false} once run() has started and
    {"stopped": true} after a cooperative stop."""

    def __init__(self, marker_path: Optional[str]) -> None:
        self.marker_path = marker_path
        self._stop = threading.Event()
        self.steps = 0

    def step(self) -> int:
        """One unit of work (a test may call it by hand through the handle under local_mt)."""
        self.steps += 1
        return self.steps

    def run(self) -> None:
        if self.marker_path:
            _write_json(self.marker_path, {"pid": os.getpid(), "stopped": False})
        while not self._stop.wait(0.02):
            pass
        if self.marker_path:
            _write_json(self.marker_path, {"pid": os.getpid(), "stopped": True})

    def stop(self) -> None:
        self._stop.set()


def make_forever(marker_path: Optional[str] = None) -> Forever:
    return Forever(marker_path)


class Failing(Worker):
    """Prints numbered lines, then raises."""

    def __init__(self, message: str, n_lines: int, delay_s: float) -> None:
        self.message, self.n_lines, self.delay_s = message, n_lines, delay_s

    def run(self) -> None:
        time.sleep(self.delay_s)
        for i in range(self.n_lines):
            print(f"failing line {i}")
        raise RuntimeError(self.message)


def make_failing(message: str, n_lines: int = 50, delay_s: float = 0.0) -> Failing:
    return Failing(message, n_lines, delay_s)


class Stubborn(Worker):
    """Ignores stop(): only a kill ends it. Touches `marker_path` (if given) once running."""

    def __init__(self, marker_path: Optional[str] = None) -> None:
        self.marker_path = marker_path

    def run(self) -> None:
        if self.marker_path:
            open(self.marker_path, "w").close()
        while True:
            time.sleep(0.05)

    def stop(self) -> None:
        print("stubborn: ignoring stop", flush=True)


def make_stubborn(marker_path: Optional[str] = None) -> Stubborn:
    return Stubborn(marker_path)


class WaitsForFile(Worker):
    """Returns once `path` exists (e.g. another node's marker: it is running)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stop = threading.Event()

    def run(self) -> None:
        while not os.path.exists(self.path) and not self._stop.wait(0.02):
            pass

    def stop(self) -> None:
        self._stop.set()


def make_waits_for_file(path: str) -> WaitsForFile:
    return WaitsForFile(path)


class LeavesAThread(Forever):
    """Stops when asked, but leaves a non-daemon thread behind that would run for a minute
    (a pool or a client that is slow to shut down)."""

    def run(self) -> None:
        threading.Thread(target=time.sleep, args=(60.0,), daemon=False).start()
        super().run()


def make_leaves_a_thread() -> LeavesAThread:
    return LeavesAThread(None)


def make_silent_server(port: int) -> Forever:
    """A 'service' that never listens on its port."""
    return Forever(None)


def make_broken_server(port: int) -> EchoServer:
    raise ValueError(f"cannot serve on {port}: broken on purpose")


def wait_for_json(path: str, timeout: float = 20.0) -> dict:
    """The JSON in `path` once it exists."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


class Sleeper(Worker):
    """Sleeps, then returns: a node that finishes on its own."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def run(self) -> None:
        time.sleep(self.seconds)


def make_sleeper(seconds: float = 0.1) -> Sleeper:
    return Sleeper(seconds)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie or dead (psutil-free)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


class GroupMember(Worker):
    """One node of a together-group. Each incarnation appends "run <pid>" to `path` when run()
    starts, and "stopped <pid>" after a cooperative stop. Incarnation n (1-based):
    n <= raise_runs: waits until every path in `peers` has n "run" lines (every peer is up),
    then raises; n > stay_runs: returns at once (finished); otherwise runs until stop().
    With `release_path`, stop() is ignored until that file exists."""

    def __init__(self, path: str, stay_runs: int, raise_runs: int, peers: tuple,
                 release_path: Optional[str]) -> None:
        self.path, self.stay_runs, self.raise_runs = path, stay_runs, raise_runs
        self.peers, self.release_path = peers, release_path
        self._stop = threading.Event()

    def run(self) -> None:
        with open(self.path, "a") as f:
            f.write(f"run {os.getpid()}\n")
        n = len(group_runs(self.path))
        if n <= self.raise_runs:
            deadline = time.monotonic() + 60
            while any(len(group_runs(p)) < n for p in self.peers):
                if self._stop.wait(0.02) or time.monotonic() > deadline:
                    return
            raise RuntimeError(f"{os.path.basename(self.path)} crashing on purpose (run {n})")
        if n > self.stay_runs:
            return
        while not self._stop.wait(0.02):
            pass
        if self.release_path:
            while not os.path.exists(self.release_path):
                time.sleep(0.02)
        with open(self.path, "a") as f:
            f.write(f"stopped {os.getpid()}\n")

    def stop(self) -> None:
        self._stop.set()


def make_group_member(path: str, stay_runs: int = 1, raise_runs: int = 0, peers: tuple = (),
                      release_path: Optional[str] = None) -> GroupMember:
    return GroupMember(path, stay_runs, raise_runs, tuple(peers), release_path)


def group_runs(path: str, what: str = "run") -> list:
    """The pids of the `what` lines ("run" or "stopped") of a GroupMember's file, in order."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    words = [line.split() for line in lines]
    return [int(w[1]) for w in words if len(w) == 2 and w[0] == what and w[1].isdigit()]


def make_crash_once_server(marker_path: str, port: int) -> EchoServer:
    """An EchoServer whose first incarnation fails to build (it creates `marker_path`)."""
    if not os.path.exists(marker_path):
        open(marker_path, "w").close()
        raise RuntimeError("first start fails on purpose")
    return EchoServer("again", port)


class PlacementReporter(Worker):
    """Writes where its process runs: CPU affinity, CUDA_VISIBLE_DEVICES, thread settings."""

    def __init__(self, out_path: str) -> None:
        self.out_path = out_path

    def run(self) -> None:
        from sao_actor_learner.launch.placement import node_threads
        _write_json(self.out_path, {
            "pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0)),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "node_threads": node_threads(7)})

    def stop(self) -> None:
        pass


def make_placement_reporter(out_path: str) -> PlacementReporter:
    return PlacementReporter(out_path)
