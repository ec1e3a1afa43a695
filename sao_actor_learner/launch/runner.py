"""The hooks one launcher implements: where a node's instance runs, and how it is ended.

`Launched` owns the start sequence, the stop sequence, restarts and nodes.json, and calls
these hooks; a launcher (local_mt.py, local_mp.py, ray.py) subclasses `Runner`. Contract:

- Hooks are called without the `Launched`'s lock held, and may block.
- `start(r)` is called with `r.status` already "running" and `r.generation` the instance to
  start; it sets what it knows (`r.pid`, `r.thread_name`, `r.extra`, `r.instance`). When that
  instance ends, the runner calls `launched.node_exited(r, exitcode, error, generation)`
  (from `poll`, or from its own thread); reports of an older instance are ignored.
- Exit codes: 0 when the worker's run() returned, 1 when it raised (threads and Ray actors),
  a process's own code otherwise, minus the signal number when a signal ended it.
- `terminate(r)` ends a running instance by force and returns False when it cannot (a
  thread); `kill(r)` is the last resort `terminate_grace_s` seconds later.
- `release(r)` frees what an ended instance still holds, before its restart; `finish()` runs
  once, after the program stopped.

Pure standard library.
"""
from __future__ import annotations

import pickle
from typing import Any, Dict, List, Optional

from sao_actor_learner.launch.addresses import free_ports, join_address, local_service_host
from sao_actor_learner.launch.addresses import port_open as tcp_port_open
from sao_actor_learner.launch.program import Node, PyNodeHandle, find_handles
from sao_actor_learner.launch.records import NodeRecord

__all__ = ["Runner", "pickle_nodes"]


class Runner:
    """Per-launcher hooks (see the module docstring); the defaults suit local launchers."""

    launch_type = ""
    terminate_grace_s = 2.0      # after terminate(), before kill()
    launched: Any = None         # the `Launched` this runner serves (it imports this module)

    def attach(self, launched: Any) -> None:
        """Called once, by the `Launched` this runner serves."""
        self.launched = launched

    def log_path(self, node: Node) -> Optional[str]:
        """The node's log file (None: it has none, e.g. a thread)."""
        return None

    def setup(self, records: List[NodeRecord]) -> None:
        """Checks and setup before addresses are chosen (connect to a cluster, make folders)."""

    def service_addresses(self, services: List[NodeRecord]) -> List[str]:
        """One "host:port" per service, in order: free ports on this machine by default."""
        host = local_service_host(self.launched.bind_host)
        return [join_address(host, p) for p in free_ports(len(services), host)]

    def prepare(self, records: List[NodeRecord]) -> None:
        """Checks once every address is bound and before any node starts (e.g. pickling)."""

    def start(self, r: NodeRecord) -> None:
        raise NotImplementedError

    def poll(self, r: NodeRecord) -> None:
        """Reports r's exit if its instance ended (runners that report on their own: no-op)."""

    def port_open(self, r: NodeRecord, host: str, port: int) -> bool:
        """Whether service r accepts TCP connections at host:port, probed from its machine."""
        return tcp_port_open(host, port)

    def request_stop(self, r: NodeRecord) -> None:
        """Asks r's worker to stop (its stop()); returns at once."""
        raise NotImplementedError

    def terminate(self, r: NodeRecord) -> bool:
        """Ends r's instance by force; False when it cannot be ended that way."""
        return False

    def kill(self, r: NodeRecord) -> None:
        """Ends r's instance at once (after terminate() was not enough, or a second Ctrl-C)."""
        self.terminate(r)

    def runs_here(self, r: NodeRecord) -> bool:
        """Whether the caller is r's own instance (a node stopping its own program)."""
        return False

    def release(self, r: NodeRecord) -> None:
        """Frees what r's ended instance still holds, before it is started again."""

    def finish(self, records: List[NodeRecord]) -> None:
        """Cleanup after every node stopped."""

    def details(self, r: NodeRecord) -> str:
        """What NodeFailedError carries about r: its log tail or traceback."""
        return r.error or "(no traceback)"


def pickle_nodes(records: List[NodeRecord], launcher: str) -> Dict[str, bytes]:
    """name -> the pickled (function, args, kwargs) of each node; raises ValueError for a
    PyNode's handle among the arguments and TypeError for what cannot be pickled."""
    payloads = {}
    for r in records:
        node = r.node
        for h in find_handles((node.args, node.kwargs)):
            if isinstance(h, PyNodeHandle):
                raise ValueError(
                    f"node {node.name} gets the handle of PyNode {h.name} in its arguments: "
                    f"under {launcher} a PyNode's worker lives in its own process and cannot "
                    "be dereferenced elsewhere; pass a ServiceNode's handle instead (or use "
                    "local_mt)")
        try:
            payloads[r.name] = pickle.dumps((node.fn, node.args, node.kwargs),
                                            protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(
                f"node {node.name}: its function and arguments can't be pickled for {launcher} "
                f"({type(e).__name__}: {e}); use module-level functions and picklable "
                "arguments (or launch_type='local_mt')") from e
    return payloads
