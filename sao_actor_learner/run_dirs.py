"""The folders a run writes that a fresh run clears, and the marker that says they are ours.

A fresh run (resume=False) deletes what a resumed one would pick up: the learner's checkpoint
and journal folders (`<run_dir>/checkpoints/step_*`, `journal*`), the actors' spools
(`<run_dir>/spool`), the replay checkpoint (`--replay_checkpoint_dir`, default
`<run_dir>/checkpoints/replay`) and the variable server's state (`<run_dir>/checkpoints/variables`).
It deletes only folders this project made: whoever makes one of them (`make_owned_dir`, the
learner's checkpoint writer) puts the marker file `MARKER` in it first; a folder that was
already there, even empty, is never marked. A folder whose contents a dependency manages is never
marked inside (Reverb's checkpointer deletes every file of the replay checkpoint folder it did not
write, a marker included): the run records it instead, in the run folder's own `RECORD` file
(`make_recorded_dir`, same rule), and a fresh run clears what the record names. Temporary
siblings (`<x>.tmp-<pid>`, `<x>.partial`) are deleted only when ours as well (`remove_if_ours`).
A missing or empty folder is fine; anything else there without the marker or a record (a folder
of one's own data given as `--replay_checkpoint_dir`, say, or a run folder of a version before
the marker) is a ConfigError
naming the flag and the folder, raised before anything is deleted (`check_fresh_run`, also run by
preflight.check_before_launch).

Standard library only (the launcher runs it).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import List, Optional, Tuple

from sao_actor_learner.config import ConfigError, SAOConfig

MARKER = ".sao_actor_learner"
_MARKER_TEXT = ("Made by sao-actor-learner: a fresh run (without --resume) may delete this "
                "folder and everything in it.\n")


# In the run folder: the folders the run made whose contents a dependency manages (JSON list of
# paths, relative to the run folder when inside it).
RECORD = ".sao_actor_learner_dirs.json"


def replay_checkpoint_dir(config: SAOConfig, run_dir: Optional[str] = None) -> str:
    return config.replay_checkpoint_dir or os.path.join(run_dir or config.run_dir, "checkpoints",
                                                        "replay")


def variables_state_dir(run_dir: str) -> str:
    """Where the variable server keeps its admission counters and progress (a restart resumes
    them, so the staleness bound holds across it)."""
    return os.path.join(run_dir, "checkpoints", "variables")


def mark_owned(path: str) -> None:
    """Writes the marker into the folder `path` (which this project made)."""
    with open(os.path.join(path, MARKER), "w") as f:
        f.write(_MARKER_TEXT)


def make_owned_dir(path: str) -> str:
    """Makes the folder `path` (and its parents) and marks it as ours when this call made it. A
    folder that was already there is used as it is: a user's (even empty) folder is never
    marked, so a fresh run later refuses to delete it once it holds something."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path)
    except FileExistsError:
        return path
    mark_owned(path)
    return path


def is_owned(path: str, run_dir: Optional[str] = None) -> bool:
    """Whether this project made the folder `path`: it holds the marker, or the record of
    `run_dir` names it."""
    return os.path.isfile(os.path.join(path, MARKER)) or (
        run_dir is not None and _record_entry(path, run_dir) in _read_record(run_dir))


def _record_entry(path: str, run_dir: str) -> str:
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(run_dir))
    return os.path.abspath(path) if rel == ".." or rel.startswith(".." + os.sep) else rel


def _read_record(run_dir: str) -> List[str]:
    try:
        with open(os.path.join(run_dir, RECORD)) as f:
            entries = json.load(f)
    except (OSError, ValueError):   # none yet (or torn): nothing recorded
        return []
    return [e for e in entries if isinstance(e, str)] if isinstance(entries, list) else []


def _write_record(run_dir: str, entries: List[str]) -> None:
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, RECORD)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(sorted(set(entries)), f)
    os.replace(tmp, path)


def make_recorded_dir(path: str, run_dir: str) -> str:
    """make_owned_dir for a folder whose contents a dependency manages (and may delete): the
    mark goes into run_dir's RECORD, not into the folder. Recorded only when this call made it;
    a folder that was already there keeps its standing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        os.mkdir(path)
    except FileExistsError:   # already there, even empty: someone else's or already recorded
        return path
    entry = _record_entry(path, run_dir)
    entries = _read_record(run_dir)
    if entry not in entries:
        _write_record(run_dir, entries + [entry])
    return path


def clearable(path: str, run_dir: Optional[str] = None) -> bool:
    """Whether `path` may be deleted: it is missing, an empty folder, or a folder we made (its
    marker, or run_dir's record)."""
    if not os.path.lexists(path):
        return True
    return os.path.isdir(path) and not os.path.islink(path) and (
        is_owned(path, run_dir) or not os.listdir(path))


def remove_if_ours(path: str, what: str) -> None:
    """Deletes the scratch path `path` (a temporary sibling such as `<x>.tmp-<pid>` or
    `<x>.partial`) when it is missing, an empty folder, or a folder we marked; anything else
    there is someone else's: RuntimeError naming it (`what`: whose scratch it is), and
    nothing is deleted."""
    if clearable(path):
        if os.path.lexists(path):
            shutil.rmtree(path)
        return
    raise RuntimeError(
        f"{path!r} is in the way of {what}, and it is not a folder this project made (it has "
        f"no {MARKER} marker), so it is not deleted; move or remove it yourself")


def fresh_run_paths(config: SAOConfig, run_dir: Optional[str] = None) -> List[Tuple[str, str]]:
    """(folder, flag that chose it) for every folder a fresh run clears."""
    run_dir = run_dir or config.run_dir
    checkpoints = os.path.join(run_dir, "checkpoints")
    paths = [(os.path.join(checkpoints, name), "--run_dir")
             for name in _learner_entries(checkpoints)]
    paths.append((os.path.join(run_dir, "spool"), "--run_dir"))
    paths.append((replay_checkpoint_dir(config, run_dir),
                  "--replay_checkpoint_dir" if config.replay_checkpoint_dir else "--run_dir"))
    paths.append((variables_state_dir(run_dir), "--run_dir"))
    return paths


def _learner_entries(checkpoints: str) -> List[str]:
    """The names in `checkpoints` that are the learner's (`step_*`, `journal*`), sorted. The
    folder is listed and its names matched: `checkpoints` comes from a user's --run_dir, and a
    glob pattern built from it would read "[", "*" and "?" in it as wildcards (--run_dir=g/x[1]
    would match g/x1)."""
    try:
        names = os.listdir(checkpoints)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(n for n in names if n.startswith("step_") or n.startswith("journal"))


def check_clearable(path: str, flag: str, run_dir: Optional[str] = None) -> None:
    """Raises ConfigError unless `path` is missing, an empty folder, or a folder we marked (or
    run_dir's record names)."""
    if clearable(path, run_dir):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        what = "a folder this project did not make (it has no " + MARKER + " marker)"
    else:
        what = "not a folder this project made"
    raise ConfigError(
        f"{flag}: {path!r} is {what}, and a fresh run would delete it. Pick an empty or new "
        f"folder (for {flag}), or remove {path!r} yourself if its contents may go; --resume "
        "continues a run there instead.")


def check_fresh_run(config: SAOConfig, run_dir: Optional[str] = None) -> None:
    """Raises ConfigError naming the first folder a fresh run must not delete (none with
    --resume, which deletes nothing)."""
    if config.resume:
        return
    run_dir = run_dir or config.run_dir
    for path, flag in fresh_run_paths(config, run_dir):
        check_clearable(path, flag, run_dir)


def clear_fresh_run(config: SAOConfig, run_dir: Optional[str] = None) -> None:
    """Checks every folder a fresh run clears (check_fresh_run), then deletes the ones we
    made (an empty one that is not ours is left) and their entries in the record (a folder made
    there later is recorded again by whoever makes it)."""
    run_dir = run_dir or config.run_dir
    paths = fresh_run_paths(config, run_dir)
    for path, flag in paths:
        check_clearable(path, flag, run_dir)
    for path, _ in paths:
        if os.path.isdir(path) and not os.path.islink(path) and is_owned(path, run_dir):
            shutil.rmtree(path)   # an empty folder that is not ours stays where it is
    entries = _read_record(run_dir)
    kept = [e for e in entries if e not in {_record_entry(p, run_dir) for p, _ in paths}]
    if kept != entries:
        _write_record(run_dir, kept)
