"""Node log files and the words for how a node ended.

Guarantees:
- A node's log (`run_dir/logs/<label>_<index>.log`) starts afresh at launch; each restart
  appends to it, after a "[launch] <program>/<node>: restarting (restart N)" line, so a
  crash's traceback stays above the restart that followed it.
- `redirect_output(path)` sends this process's stdout and stderr to `path` at the
  file-descriptor level (C extensions and child processes included), line-buffered.
- `tail` never raises: an unreadable log yields a sentence saying so.

Pure standard library.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Optional

__all__ = ["LOG_TAIL_LINES", "start_log", "redirect_output", "flush_std_streams", "tail",
           "describe_exit"]

LOG_TAIL_LINES = 40


def start_log(path: str, program: str, node: str, generation: int, restart_number: int,
              where: str = "") -> None:
    """Opens node `node`'s log for instance `generation` (0: truncate, else append)."""
    with open(path, "a" if generation else "w") as f:
        what = f"restarting (restart {restart_number})" if generation else "starting"
        f.write(f"[launch] {program}/{node}: {what}{where} ({time.ctime()})\n")


def redirect_output(log_path: str) -> None:
    """Points this process's stdout and stderr (file descriptors 1 and 2 too) at log_path."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    flush_std_streams()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream_name, fdno in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, stream_name)
        if stream is None or not hasattr(stream, "reconfigure"):
            setattr(sys, stream_name, open(fdno, "w", buffering=1, closefd=False))
        else:
            stream.reconfigure(line_buffering=True)


def flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


def tail(path: str, n: int) -> str:
    """The last n lines of a text file (a note instead if it can't be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            data = f.read()
    except OSError as e:
        return f"(could not read the log: {e})"
    lines = data.decode("utf-8", "replace").splitlines()
    return "\n".join(lines[-n:])


def describe_exit(code: Optional[int]) -> str:
    """", killed by SIGKILL" for exit code -9 and the like; "" for other codes."""
    if code is not None and code < 0:
        try:
            return f", killed by {signal.Signals(-code).name}"
        except ValueError:
            return ""
    return ""
