"""The shared-memory directory layout of policy versions (variables/shm.py writes them,
variables/shm_reader.py reads them): names, owners, and the clean-up of dead runs.

Files. `<root>/<run>-XXXXXX/` (0700) holds `owner` (pid and start time of the writing process)
and one `v<version>.safetensors` per kept version. A version is written under
`v<version>.safetensors.tmp` and renamed into place when whole (rename is atomic): a reader that
opens the final name never sees a partial file. `<root>` is per user (`writer_root`) and must be
this user's alone (`check_private_root`).

Clean-up. A writer removes its own directory when it closes. A writer killed with SIGKILL leaves
its directory behind; every new writer under the same root, and the variable server when it
stops, removes the directories whose owner process is gone (pid and start time, so a reused pid
does not count).

Standard library only.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import tempfile
import time
from typing import List, Optional, Tuple

DEFAULT_SHM_DIR = "/dev/shm"
OWNER_FILE = "owner"
SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
# A directory without an owner file this old is a writer that died while starting.
OWNERLESS_GRACE_S = 60.0


class ShmUnavailable(OSError):
    """Shared memory cannot be used here (no such root, no space, not permitted)."""


def writer_root(shm_dir: str = DEFAULT_SHM_DIR) -> str:
    """The per-user directory under `shm_dir` that writers make their run directories in."""
    return os.path.join(shm_dir, f"sao_weights-{os.getuid()}")


def version_file_name(version: int) -> str:
    """The file name of `version` in a run directory."""
    return f"v{version:08d}{SUFFIX}"


# ------------------------------------------------------------------------------ owners and sweeps

def process_start_time(pid: int) -> Optional[int]:
    """Start time of process `pid` (clock ticks since boot, /proc/PID/stat field 22), or None
    when no such process exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:   # the command name (field 2) is in parentheses and may contain spaces
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def _owner_alive(directory: str) -> bool:
    """Whether the process that made run directory `directory` still runs (by its owner file;
    a directory without one counts as alive for OWNERLESS_GRACE_S after it was made)."""
    try:
        with open(os.path.join(directory, OWNER_FILE)) as f:
            owner = json.load(f)
        return process_start_time(int(owner["pid"])) == int(owner["start_time"])
    except FileNotFoundError:
        try:
            return time.time() - os.stat(directory).st_mtime < OWNERLESS_GRACE_S
        except OSError:
            return False
    except (OSError, ValueError, KeyError, TypeError):
        return False


def check_private_root(root: str) -> None:
    """Raises ShmUnavailable unless `root` is a real directory (not a link) of this user that
    nobody else may enter: another user could otherwise have made it first, to read or swap the
    weights."""
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ShmUnavailable(errno.EPERM, f"{root} is not a directory of this user with mode "
                             f"0700 (mode {stat.filemode(st.st_mode)}, uid {st.st_uid}); remove "
                             "it, or choose another shared-memory directory")


def remove_if_empty(root: str) -> None:
    """Removes `root` when no run directory is left in it (so a finished run leaves nothing
    in /dev/shm); a writer starting meanwhile makes it again."""
    try:
        os.rmdir(root)
    except OSError:
        pass


def sweep_dead_runs(root: str) -> List[str]:
    """Removes the run directories under `root` whose writer process is gone (a crashed run's);
    returns their paths. Other entries are left alone."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path) and not _owner_alive(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def make_run_directory(root: str, run_name: str) -> Tuple[str, List[str]]:
    """(a new run directory under `root`, named after `run_name`, with its owner file; the dead
    runs' directories swept on the way). Makes `root` (0700) if missing and checks it is
    private (check_private_root). Raises ShmUnavailable when any of it fails."""
    prefix = re.sub(r"[^A-Za-z0-9_.]+", "_", run_name)[:64] or "run"
    try:
        for attempt in range(3):    # another writer's close may remove an empty root
            os.makedirs(root, mode=0o700, exist_ok=True)
            check_private_root(root)
            swept = sweep_dead_runs(root)
            try:
                directory = tempfile.mkdtemp(prefix=f"{prefix}-", dir=root)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        owner = {"pid": os.getpid(), "start_time": process_start_time(os.getpid())}
        tmp = os.path.join(directory, OWNER_FILE + TMP_SUFFIX)
        with open(tmp, "w") as f:
            json.dump(owner, f)
        os.replace(tmp, os.path.join(directory, OWNER_FILE))
    except OSError as e:
        raise ShmUnavailable(e.errno, f"shared-memory directory under {root}: {e}") from None
    return directory, swept
