"""What the launcher knows about each node, and the error a failed node raises.

A `NodeRecord` holds one node's state across all its instances (its first start and each
restart). Statuses:

  pending       not started yet
  running       its current instance runs
  restarting    ended (crashed, or asked to restart) and waits to be started again
  finished      its worker's run() returned
  failed        an exception or a non-zero exit code, with no restart left (or its restart
                could not be carried out)
  killed        terminated by the launcher after the notice period
  stopped       the program stopped while the node waited to restart
  unresponsive  a thread that ignored stop; left behind as a daemon thread
  not_started   the launch failed before reaching it

`info()` is the node's entry in nodes.json. Records are guarded by the owning `Launched`'s
lock; launcher hooks set `pid`, `thread_name`, `extra`, `log_path` and `instance` (their own
per-instance state) and never change `status`.

Pure standard library.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from sao_actor_learner.launch.program import Node, ServiceNode

__all__ = ["NodeFailedError", "NodeRecord", "ACTIVE_STATUSES", "write_json_atomic"]

ACTIVE_STATUSES = ("pending", "running", "not_started", "restarting")


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


class NodeRecord:
    """One node of a launched program: its status, current instance and restart history."""

    def __init__(self, node: Node, log_path: Optional[str]) -> None:
        self.node = node
        self.kind = "service" if isinstance(node, ServiceNode) else "py"
        self.status = "pending"
        self.exitcode: Optional[int] = None
        self.pid: Optional[int] = None
        self.thread_name: Optional[str] = None
        self.log_path = log_path
        self.error: Optional[str] = None      # traceback or the launcher's account of the end
        self.headline: Optional[str] = None   # NodeFailedError's first line, when not the usual
        self.killed = False                   # the launcher terminated its current instance
        self.instance: Any = None             # the launcher's handle on the current instance
        self.generation = 0                   # 0 for the first start, +1 per restart
        self.restarts = 0                     # restarts after crashes (counted by the policy)
        self.requested_restarts = 0           # restarts asked for (restart_node), not counted
        self.restart_requested = False        # restart_node() asked for the current exit
        self.starting = False                 # the launcher is starting its current instance
        self.plan: Any = None                 # the restart plan this node waits in, if any
        self.history: List[dict] = []         # one entry per restart
        self.extra: Dict[str, Any] = {}       # launcher-specific fields for nodes.json

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def label(self) -> str:
        return self.node.label

    @property
    def done(self) -> bool:
        """Whether the node has ended for good (it will not run again in this launch)."""
        return self.status not in ACTIVE_STATUSES

    def info(self) -> dict:
        return {"name": self.name, "label": self.node.label, "index": self.node.index,
                "kind": self.kind, "pid": self.pid, "thread": self.thread_name,
                "address": self.node.handle.address if self.node.handle else None,
                "status": self.status, "exitcode": self.exitcode, "log": self.log_path,
                "restarts": self.restarts, "restarts_requested": self.requested_restarts,
                "restart_history": list(self.history), **self.extra}

    def __repr__(self) -> str:
        return f"NodeRecord({self.name!r}, {self.status}, generation {self.generation})"


def write_json_atomic(path: str, data: Any) -> None:
    """Writes `data` as JSON to `path` through a temporary file and a rename."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
