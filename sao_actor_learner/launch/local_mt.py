"""launch_type="local_mt": every node a daemon thread of the launching process.

For tests and debugging. Guarantees:
- A PyNode's handle dereferences to its worker object (waiting until it is built), so a test
  can step a worker by hand; after a restart, to the new worker.
- `env` is set in this process's environment before any node starts (threads share it).
- Exit codes: 0 when run() returned, 1 when it raised; the traceback is the failure's detail.
- A thread cannot be killed: a node that ignores stop() is left behind as a daemon thread
  ("unresponsive"), and a restart that needs it gone fails.

Pure standard library.
"""
from __future__ import annotations

import os
import threading
import traceback
from typing import List

from sao_actor_learner.launch.addresses import port_of
from sao_actor_learner.launch.node_runtime import WorkerControl, build_and_run
from sao_actor_learner.launch.program import PyNodeHandle, ServiceHandle
from sao_actor_learner.launch.records import NodeRecord
from sao_actor_learner.launch.runner import Runner

__all__ = ["ThreadRunner"]


class _Instance:
    def __init__(self, thread: threading.Thread, control: WorkerControl) -> None:
        self.thread, self.control = thread, control


class ThreadRunner(Runner):
    """local_mt: every node a daemon thread of this process."""

    launch_type = "local_mt"

    def setup(self, records: List[NodeRecord]) -> None:
        if self.launched.env:
            os.environ.update(self.launched.env)   # one process: shared by all nodes

    def start(self, r: NodeRecord) -> None:
        handle = r.node.handle
        if r.generation and isinstance(handle, PyNodeHandle):   # a restart: a new worker
            handle.reset()
        control = WorkerControl(r.name)
        thread = threading.Thread(target=self._thread_main, args=(r, r.generation, control),
                                  daemon=True,
                                  name=f"{self.launched.program.name}/{r.name}")
        r.instance = _Instance(thread, control)
        r.thread_name = thread.name
        thread.start()

    def _thread_main(self, r: NodeRecord, generation: int, control: WorkerControl) -> None:
        node, handle = r.node, r.node.handle
        on_built = handle.set_worker if isinstance(handle, PyNodeHandle) else None
        port = port_of(handle.address) if isinstance(handle, ServiceHandle) else None
        try:
            build_and_run(r.name, node.fn, node.args, node.kwargs, port, control, on_built)
        except BaseException:  # noqa: BLE001 - reported through wait()
            tb = traceback.format_exc()
            if isinstance(handle, PyNodeHandle):
                handle.set_error(tb)
            self.launched.node_exited(r, 1, tb, generation)
        else:
            if isinstance(handle, PyNodeHandle):
                handle.set_error("its worker was stopped before it was built")
            self.launched.node_exited(r, 0, None, generation)

    def request_stop(self, r: NodeRecord) -> None:
        if r.instance is not None:
            r.instance.control.request_stop()

    def terminate(self, r: NodeRecord) -> bool:
        return False          # a thread cannot be killed

    def runs_here(self, r: NodeRecord) -> bool:
        return r.instance is not None and r.instance.thread is threading.current_thread()
