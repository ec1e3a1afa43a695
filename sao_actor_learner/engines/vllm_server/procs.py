"""Stopping a vLLM server's process group and the shared memory it leaves behind (stdlib only).

Used on both sides: by serve.py's watchdog inside the vLLM environment and by
`sao_actor_learner.engines.vllm_engine.VLLMServer.stop` in the main one (this module imports only
the standard library, so both can import it).

vLLM's processes talk through POSIX shared memory (/dev/shm/psm_*, named semaphores
/dev/shm/sem.*). A process killed with SIGKILL, or whose resource tracker dies with it, never
unlinks them: ~160-250 MB (sparse) files accumulate run after run. `stop_group` notes every
/dev/shm file the group's processes map before stopping them, lets the resource trackers outlive
the rest (they unlink what was registered with them), and unlinks what is left afterwards.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Iterable, List, Set


def group_pids(pgid: int) -> List[int]:
    """PIDs of the live processes whose process group is `pgid` (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields[0] is the state, fields[2] the process group.
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def shm_files(pids: Iterable[int]) -> Set[str]:
    """The /dev/shm files the processes `pids` have mapped."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)   # address perms offset dev inode [path]
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if path.startswith("/dev/shm/"):
                        found.add(path.replace(" (deleted)", ""))
        except OSError:
            continue
    return found


def is_resource_tracker(pid: int) -> bool:
    """Whether `pid` is a multiprocessing resource tracker (it unlinks the semaphores and shared
    memory its processes registered once they are all gone, so it is stopped last)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def stop_group(pgid: int, grace_s: float = 10.0, spare: int = 0) -> None:
    """Stops every process of group `pgid` except `spare` (the caller, when it is in the group):
    SIGTERM, SIGKILL to those left after `grace_s`; resource trackers are left to clean up and
    exit by themselves first (killed after 5 s). Then unlinks the /dev/shm files the group
    (`spare` included) had mapped."""
    members = group_pids(pgid)
    files = shm_files(members)
    trackers = {p for p in members if is_resource_tracker(p)}

    def left(include_trackers: bool) -> List[int]:
        return [p for p in group_pids(pgid)
                if p != spare and (include_trackers or p not in trackers)]

    _signal(left(False), signal.SIGTERM)
    _wait(lambda: left(False), grace_s)
    _signal(left(False), signal.SIGKILL)
    _wait(lambda: left(False), 5.0)
    _wait(lambda: left(True), 5.0)    # trackers see their clients gone, clean up, exit
    _signal(left(True), signal.SIGKILL)
    _wait(lambda: left(True), 5.0)
    for path in files:
        try:
            os.unlink(path)
        except OSError:
            pass


def _wait(pending, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline and pending():
        time.sleep(0.05)


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
