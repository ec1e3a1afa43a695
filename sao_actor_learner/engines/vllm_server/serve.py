"""Entry point of the vLLM server process (runs inside the vLLM environment).

  python serve.py --parent-pid PID <arguments of vllm.entrypoints.openai.api_server>

Starts a watchdog thread, registers the CPU weight-transfer backend, then runs vLLM's
OpenAI-compatible api_server in this process. The client starts this script in a new session,
so its process group holds the api_server and vLLM's engine-core and worker processes. The
watchdog stops that group (and unlinks the shared memory it mapped, see procs.py) when the
parent PID disappears, so a server never outlives the actor that started it, even when that
actor is killed with SIGKILL.
"""
from __future__ import annotations

import os
import runpy
import sys
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))


def _parent_alive(pid: int) -> bool:
    if os.getppid() != pid:  # re-parented: the parent died
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch_parent(pid: int, period_s: float = 0.5) -> None:
    from vllm_server import procs

    while _parent_alive(pid):
        time.sleep(period_s)
    print(f"[sao vllm_server] parent pid {pid} is gone; stopping the server", flush=True)
    procs.stop_group(os.getpgrp(), grace_s=5.0, spare=os.getpid())
    os._exit(0)


def main() -> None:
    # `vllm_server` (this folder) must be importable here and in vLLM's worker processes.
    parent_dir = os.path.dirname(_HERE)
    if parent_dir not in sys.path:
        sys.path.insert(0, parent_dir)
    args = sys.argv[1:]
    parent_pid = None
    if len(args) >= 2 and args[0] == "--parent-pid":
        parent_pid = int(args[1])
        args = args[2:]
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                         name="sao-parent-watchdog").start()
    from vllm_server import weight_transfer
    weight_transfer.register()
    sys.argv = ["vllm.entrypoints.openai.api_server"] + args
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
