"""Liveness under local_mp: every node process heartbeats; a silent one is killed and restarted.

A node that exits is noticed at once (local_mp's monitor); a node that hangs (SIGSTOP, a
deadlock, a wedged driver call) would be waited for forever. With `node_timeout_s > 0`
(`launch(..., node_timeout_s=...)`, the `--node_timeout_s` flag):

- Each node process runs a heartbeat thread (`start_heartbeat`, started first thing in
  node_runtime.process_main) that adds 1 to a counter in shared memory (a `RawValue` the
  launcher made for that instance) every `heartbeat_interval(node_timeout_s)` seconds.
- The launcher's monitor reads every running instance's counter (`HeartbeatWatch`). An
  instance whose counter has not moved for more than `node_timeout_s` is killed with SIGKILL
  (which also ends a SIGSTOPped process); the exit is then a crash like any other: the node's
  group restart policy restarts it (the learner from its checkpoint and journal, nothing lost)
  or, with no restart left or none configured, the run fails with NodeFailedError naming the
  node and saying it was hung (`HUNG_PREFIX`).
- Slow is not dead: the heartbeat comes from its own thread, not from the node's work loop, so
  a long checkpoint write, a long generation or a long wait for data never stops it. Only a
  process that stops running altogether (stopped, or a thread holding the GIL for longer
  than `node_timeout_s`, which no code of this project does) goes silent.
- Silence counts from an instance's first heartbeat: the spawn before it (the interpreter
  starting, the launcher's own code) gets `START_ALLOWANCE_S` on top, so a loaded machine's slow
  process start never counts as a hang, and a process that stops before its first heartbeat
  (SIGSTOP, a deadlock in start-up) is still killed, `START_ALLOWANCE_S + node_timeout_s` after
  it was spawned. Nor is what follows the worker's run(): the process then sets the
  counter to `FINISHED` (`Heartbeat.finish`), because the interpreter's exit stops daemon
  threads and may take seconds (atexit hooks, extension teardown) in a node whose work is
  done. An instance the launcher asked to stop is not watched either (the stop sequence's
  notice and kill take over).

Not under local_mt (a thread cannot be killed) or Ray (Ray actors are not watched; docs/
DESIGN.md section 1).

Pure standard library.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

__all__ = ["FINISHED", "HUNG_PREFIX", "START_ALLOWANCE_S", "Heartbeat", "HeartbeatWatch", "heartbeat_interval",
           "hang_message", "start_heartbeat", "check_node_timeout"]

# The error text of an instance the launcher killed for silence starts with this.
HUNG_PREFIX = "hung: "
# Heartbeats per timeout: a few missed beats (a busy machine) never look like a hang.
_BEATS_PER_TIMEOUT = 5
_MAX_INTERVAL_S = 1.0
# The counter's value once the worker's run() has ended: the launcher stops watching.
FINISHED = 2 ** 64 - 1
# Seconds a new instance may take to its first heartbeat before silence starts to count (its
# interpreter starting and importing the launcher's node code: seconds, more on a loaded machine).
START_ALLOWANCE_S = 60.0


def check_node_timeout(node_timeout_s: float) -> float:
    """node_timeout_s as a float; ValueError saying what to change when it is invalid."""
    value = float(node_timeout_s)
    if not value >= 0:   # also NaN
        raise ValueError(f"node_timeout_s={node_timeout_s}: must be >= 0 seconds (0: no "
                         "liveness checks)")
    return value


def heartbeat_interval(node_timeout_s: float) -> float:
    """Seconds between two heartbeats of a node: a fifth of the timeout, at most 1 s."""
    return min(_MAX_INTERVAL_S, node_timeout_s / _BEATS_PER_TIMEOUT)


class Heartbeat:
    """A node process's heartbeat thread: adds 1 to `beats.value` every `interval_s` seconds
    (the first beat at once) until `finish()`, which ends it and sets the counter to FINISHED."""

    def __init__(self, beats: Any, interval_s: float) -> None:
        self._beats, self._interval_s = beats, interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="launch-heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        while not self._done.is_set():
            self._beats.value += 1     # only this thread writes it until finish()
            self._done.wait(self._interval_s)

    def finish(self) -> None:
        """The worker's run() has ended: the launcher stops watching this instance."""
        self._done.set()
        self._thread.join(timeout=self._interval_s + 1.0)
        self._beats.value = FINISHED


def start_heartbeat(beats: Any, interval_s: float) -> Heartbeat:
    """Starts a node process's heartbeat thread (see Heartbeat)."""
    return Heartbeat(beats, interval_s)


def hang_message(name: str, silent_s: float, node_timeout_s: float) -> str:
    """What the launcher records (and logs) for an instance it killed for silence."""
    return (f"{HUNG_PREFIX}no heartbeat from node {name} for {silent_s:.1f} s (node_timeout_s="
            f"{node_timeout_s:g}): the process stopped running (SIGSTOP, a deadlock, a call "
            "that never returns while holding the interpreter); the launcher killed it with "
            "SIGKILL. Raise --node_timeout_s if it was only slow")


class HeartbeatWatch:
    """The launcher's view of one instance's heartbeat counter.

    `silent_for(value, now)` takes the counter's current value and a monotonic time and returns
    how long the counter has not moved: before the first heartbeat (value 0) the time since
    `spawned` beyond `start_allowance_s` (0 within it); 0 once the process's run() has ended
    (FINISHED); else the seconds since the value last changed. Pure bookkeeping: tests drive it
    with made-up times.
    """

    def __init__(self, spawned: float, start_allowance_s: float = START_ALLOWANCE_S) -> None:
        self._value = 0
        self._changed: Optional[float] = None   # when the value last changed (None: no beat yet)
        self._spawned, self._allowance = spawned, start_allowance_s

    def silent_for(self, value: int, now: float) -> float:
        if value == FINISHED:
            return 0.0
        if value != self._value:
            self._value, self._changed = value, now
        if self._changed is None:
            return max(0.0, now - self._spawned - self._allowance)
        return now - self._changed
