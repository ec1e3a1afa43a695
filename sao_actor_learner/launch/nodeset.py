"""The nodes of one launch: their records, the lock that guards them, and ending instances.

Guarantees:
- `cond` (a condition on a re-entrant lock) guards every NodeRecord of the launch and is
  notified whenever a status changes.
- `stop(records)` is the one way instances are ended: ask each worker to stop, give them
  `notice_s` seconds, terminate what is left, kill it `terminate_grace_s` later; it returns
  the nodes that could not be ended (threads). It acts on the instances running when it was
  called (`generations`), never on a node's next instance.
- `wait_exit` never waits for the caller's own node (a node that stops its own program).

Pure standard library.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from sao_actor_learner.launch.program import Program, PyNode
from sao_actor_learner.launch.records import NodeRecord
from sao_actor_learner.launch.runner import Runner

__all__ = ["NodeSet", "terminal_records"]

_logger = logging.getLogger(__name__)

Generations = Dict[NodeRecord, int]


class NodeSet:
    """The records of one launch and the stop/wait mechanics over its runner."""

    def __init__(self, records: List[NodeRecord], runner: Runner, notice_s: float) -> None:
        self.records = records
        self.by_name = {r.name: r for r in records}
        self.runner = runner
        self.notice_s = notice_s
        self.cond = threading.Condition()

    def by_label(self, value: Callable[[NodeRecord], object],
                 kind: Optional[str] = None) -> Dict[str, list]:
        """label -> [value(r) for each node of the group (of `kind` only, when given)]."""
        out: Dict[str, list] = {}
        for r in self.records:
            if kind is None or r.kind == kind:
                out.setdefault(r.label, []).append(value(r))
        return out

    def live(self, records: List[NodeRecord],
             generations: Optional[Generations] = None) -> List[NodeRecord]:
        """The records whose instance of `generations` (default: the current) still runs."""
        generations = generations or {}
        with self.cond:
            return [r for r in records if r.status == "running"
                    and r.generation == generations.get(r, r.generation)]

    def stop(self, records: List[NodeRecord],
             generations: Optional[Generations] = None) -> List[NodeRecord]:
        """Asks, waits `notice_s`, then forces; returns the nodes that could not be ended."""
        generations = generations or {r: r.generation for r in records}
        for r in self.live(records, generations):
            self.runner.request_stop(r)
        self.wait_exit(records, self.notice_s, generations)
        return self.force(records, generations)

    def force(self, records: List[NodeRecord], generations: Generations) -> List[NodeRecord]:
        """Terminates, then kills, what still runs; returns the nodes that cannot be ended."""
        left, stuck = self.live(records, generations), []
        for r in left:
            r.killed = True
            if self.runner.terminate(r):
                _logger.warning("node %s (pid %s) did not stop within notice_s=%g s; "
                                "terminated it", r.name, r.pid, self.notice_s)
            else:
                r.killed = False
                stuck.append(r)
        ended = [r for r in left if r not in stuck]
        self.wait_exit(ended, self.runner.terminate_grace_s, generations)
        for r in self.live(ended, generations):
            self.runner.kill(r)
        self.wait_exit(ended, 10.0, generations)
        return stuck

    def kill_all(self) -> None:
        """Kills every running instance at once (a second interrupt during stop)."""
        live = self.live(self.records)
        for r in live:
            r.killed = True
            self.runner.kill(r)
        self.wait_exit(live, min(5.0, self.runner.terminate_grace_s))

    def wait_exit(self, records: List[NodeRecord], timeout: float,
                  generations: Optional[Generations] = None) -> None:
        """Returns once none of `records` (their instances of `generations`) runs, or after
        `timeout` s."""
        generations = generations or {r: r.generation for r in records}
        deadline = time.monotonic() + timeout
        while True:
            for r in records:
                self.runner.poll(r)
            with self.cond:
                live = [r for r in self.live(records, generations)
                        if not self.runner.runs_here(r)]
                remaining = deadline - time.monotonic()
                if not live or remaining <= 0:
                    return
                self.cond.wait(min(remaining, 0.1))


def terminal_records(program: Program, records: List[NodeRecord],
                     terminal_groups: Optional[Sequence[str]]) -> List[NodeRecord]:
    """The PyNodes `wait()` waits for: those of `terminal_groups` (all PyNodes when None).
    Groups the program lacks are skipped, but one at least must exist and hold a PyNode."""
    if terminal_groups is None:
        return [r for r in records if r.kind == "py"]
    if isinstance(terminal_groups, str):
        terminal_groups = (terminal_groups,)
    groups = program.groups
    present = [g for g in terminal_groups if g in groups]
    for g in present:
        if not any(isinstance(n, PyNode) for n in groups[g]):
            raise ValueError(f"terminal group {g!r} holds only service nodes, which serve "
                             "until stopped: wait() would never return")
    if not present:
        raise ValueError(f"terminal_groups={tuple(terminal_groups)!r}: none of these groups "
                         f"is in program {program.name!r} (groups: {sorted(groups)})")
    missing = [g for g in terminal_groups if g not in groups]
    if missing:
        _logger.info("terminal groups %s are not in program %r; waiting for %s",
                     missing, program.name, present)
    return [r for r in records if r.label in present and r.kind == "py"]
