"""Toy workers for tests/test_faults.py and tests/launch/test_ray.py: module-level, picklable, light."""
from __future__ import annotations

import json
import os
import threading
import time

from sao_actor_learner.core import Worker


class CountingNode(Worker):
    """Appends its pid to `path` (one line per incarnation); crashes (os._exit(3)) after
    `crash_after_s` while fewer than `crashes` incarnations have run, else runs until stop() or,
    with `finish_after_s`, returns then."""

    def __init__(self, path: str, crashes: int, crash_after_s: float,
                 finish_after_s: float = 0.0) -> None:
        self.path, self.crashes = path, crashes
        self.crash_after_s, self.finish_after_s = crash_after_s, finish_after_s
        self._stop = threading.Event()

    def run(self) -> None:
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")
        with open(self.path) as f:
            incarnation = len(f.read().split())
        if incarnation <= self.crashes:
            time.sleep(self.crash_after_s)
            os._exit(3)
        if self.finish_after_s:
            self._stop.wait(self.finish_after_s)
            return
        self._stop.wait()

    def stop(self) -> None:
        self._stop.set()


def make_counting_node(path: str, crashes: int = 0, crash_after_s: float = 0.2,
                       finish_after_s: float = 0.0) -> CountingNode:
    return CountingNode(path, crashes, crash_after_s, finish_after_s)


class RaisingNode(Worker):
    """Raises at once, every incarnation."""

    def run(self) -> None:
        raise RuntimeError("raising on purpose")


def make_raising_node() -> RaisingNode:
    return RaisingNode()


def read_pids(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [int(x) for x in f.read().split()]


def wait_for(predicate, timeout: float = 30.0, what: str = "condition", poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not met within {timeout} s")
        time.sleep(poll)


def nodes_json(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "nodes.json")) as f:
        return {n["name"]: n for n in json.load(f)["nodes"]}


def make_echo_server_on_all_interfaces(greeting: str, port: int):
    """launch_fixtures.EchoServer, bound to 0.0.0.0 instead of 127.0.0.1."""
    import socket

    from launch_fixtures import EchoServer
    server = EchoServer.__new__(EchoServer)
    server.greeting = greeting
    server._stop = threading.Event()
    server._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server._sock.bind(("0.0.0.0", port))
    server._sock.settimeout(0.05)
    return server
