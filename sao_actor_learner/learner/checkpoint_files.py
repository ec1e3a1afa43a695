"""Learner checkpoint folders on disk: durable when written, verified when read back.

`seal_checkpoint(tmp, path)` finishes a checkpoint the learner wrote into the temporary folder
`tmp`: it puts the run-folder marker in it (run_dirs.MARKER: a fresh run may delete it), fsyncs
every file, writes `manifest.json` last (each file's size and sha256), fsyncs the manifest and
the folder, renames the folder to `path` (atomic) and fsyncs the parent, so once it returns the
checkpoint survives a machine crash, and a name `step_<N>` only ever shows a whole checkpoint.

`check_checkpoint(path)` says whether a checkpoint can be resumed from: every file of its
manifest is there with its size and sha256. A checkpoint without a manifest (written before
checkpoints had one) is accepted with a note, after the cheap checks that need no manifest
(`learner_state.pt` is not empty, every safetensors file holds the bytes its header describes).
The learner's ResumePoint (journal.py) skips a checkpoint that fails, saying why, and falls back
to the newest intact one.

Standard library only (and models/model_dir, which needs no torch).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from typing import Callable, Dict, List, Optional, Tuple

from sao_actor_learner.models.model_dir import ModelDirError, read_safetensors_header
from sao_actor_learner.run_dirs import is_owned, make_owned_dir, mark_owned, remove_if_ours

LEARNER_STATE_FILE = "learner_state.pt"
MANIFEST_FILE = "manifest.json"
_CHECKPOINT_RE = re.compile(r"^step_(\d{6,})$")
_CHUNK = 1 << 20


def fsync_path(path: str) -> None:
    """fsync of a file or a folder (a folder's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: str) -> Tuple[int, str]:
    """(size, sha256 hex) of a file."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                return size, h.hexdigest()
            h.update(chunk)
            size += len(chunk)


def write_manifest(directory: str) -> Dict:
    """fsyncs every file under `directory`, then writes (and fsyncs) its manifest: each file's
    relative path -> {size, sha256}; then fsyncs every folder. Returns the manifest."""
    files: Dict[str, Dict] = {}
    folders: List[str] = []
    for folder, subdirs, names in os.walk(directory):
        subdirs.sort()
        folders.append(folder)
        for name in sorted(names):
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, directory)
            if rel == MANIFEST_FILE:
                continue
            fsync_path(path)
            size, sha = _digest(path)
            files[rel] = {"size": size, "sha256": sha}
    manifest = {"format": 1, "files": files}
    with open(os.path.join(directory, MANIFEST_FILE), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    for folder in reversed(folders):
        fsync_path(folder)
    return manifest


class CheckpointWriteError(OSError):
    """A learner checkpoint could not be written (e.g. ENOSPC); the message names it."""


def write_checkpoint(path: str, write: Callable[[str], None]) -> str:
    """Writes the checkpoint `path`: `write(tmp)` fills a fresh temporary folder, then
    seal_checkpoint makes it durable and renames it into place. Whatever fails on the way (a
    full disk surfaces as OSError, or as the error of a library that wrapped it) removes the
    temporary folder and raises CheckpointWriteError naming `path`; the checkpoints already
    there are untouched. Returns `path`."""
    tmp = None
    try:
        tmp = begin_checkpoint(path)
        write(tmp)
        return seal_checkpoint(tmp, path)
    except Exception as e:  # noqa: BLE001 - re-raised, naming the checkpoint
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        code = getattr(e, "errno", None) or errno.EIO
        raise CheckpointWriteError(
            code, f"learner checkpoint {path}: could not be written ({type(e).__name__}: {e}); "
            "the learner stops (the newest complete checkpoint is kept). Free space on that "
            "disk (or put --run_dir on another) and resume") from e


def begin_checkpoint(path: str) -> str:
    """A fresh, marked temporary folder for the checkpoint `path` (a fresh run may clear it
    even if a crash leaves it half written); seal_checkpoint finishes it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    remove_if_ours(tmp, "a learner checkpoint")   # a crashed writer's with our pid: ours
    return make_owned_dir(tmp)


def seal_checkpoint(tmp: str, path: str) -> str:
    """Marks, manifests and fsyncs the folder `tmp`, then renames it to `path` (replacing an
    older folder of that name, e.g. a damaged one a resumed learner skipped) and fsyncs the
    parent. Returns `path`."""
    mark_owned(tmp)
    write_manifest(tmp)
    old = None
    if os.path.exists(path):   # os.replace cannot replace a non-empty folder: move it aside
        old = f"{path}.tmp-old-{os.getpid()}"
        remove_if_ours(old, "a learner checkpoint")
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))
    if old is not None and is_owned(old):   # the folder moved aside, if it was ours
        shutil.rmtree(old, ignore_errors=True)
    return path


def check_checkpoint(path: str) -> Tuple[Optional[str], Optional[str]]:
    """(problem, note) of the checkpoint folder `path`: problem says why it cannot be resumed
    from (None: it can); note is something to warn about (no manifest)."""
    manifest_path = os.path.join(path, MANIFEST_FILE)
    try:
        if not os.path.exists(manifest_path):
            return _check_without_manifest(path), (
                f"no {MANIFEST_FILE} (written before checkpoints had one): only the sizes of "
                "its safetensors files and learner_state.pt were checked, not their contents")
        try:
            with open(manifest_path) as f:
                files = json.load(f)["files"]
            items = sorted(files.items())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{MANIFEST_FILE} is unreadable ({e!r})", None
        for rel, entry in items:
            file = os.path.join(path, rel)
            if not os.path.isfile(file):
                return f"{rel} is missing", None
            size = os.path.getsize(file)
            if size != entry["size"]:
                return f"{rel} has {size} bytes, its manifest says {entry['size']}", None
            if _digest(file)[1] != entry["sha256"]:
                return f"{rel} does not match its sha256 in {MANIFEST_FILE}", None
        if LEARNER_STATE_FILE not in files:
            return f"{MANIFEST_FILE} lists no {LEARNER_STATE_FILE}", None
    except OSError as e:        # unreadable, or removed while being read
        return f"cannot be read ({e})", None
    return None, None


def _check_without_manifest(path: str) -> Optional[str]:
    state = os.path.join(path, LEARNER_STATE_FILE)
    if not os.path.isfile(state) or os.path.getsize(state) == 0:
        return f"{LEARNER_STATE_FILE} is missing or empty"
    for file in sorted(os.path.join(path, n) for n in os.listdir(path)   # no glob: path is
                       if n.endswith(".safetensors")):                     # under --run_dir
        try:
            read_safetensors_header(file)
        except ModelDirError as e:
            return str(e)
    return None


# --- checkpoint folders -------------------------------------------------------------------------
def checkpoint_path(checkpoint_root: str, step: int) -> str:
    return os.path.join(checkpoint_root, f"step_{step:06d}")


def complete_checkpoints(checkpoint_root: str) -> List[Tuple[int, str]]:
    """(step, path) of every complete (renamed into place) checkpoint folder, newest first.
    Complete is not intact: check_checkpoint says that."""
    found = []
    if os.path.isdir(checkpoint_root):
        for name in os.listdir(checkpoint_root):
            m = _CHECKPOINT_RE.match(name)
            path = os.path.join(checkpoint_root, name)
            if m and os.path.exists(os.path.join(path, LEARNER_STATE_FILE)):
                found.append((int(m.group(1)), path))
    return sorted(found, reverse=True)


def latest_checkpoint(checkpoint_root: str) -> Tuple[Optional[str], int]:
    """(path, step) of the newest complete learner checkpoint, or (None, 0)."""
    found = complete_checkpoints(checkpoint_root)
    return (found[0][1], found[0][0]) if found else (None, 0)


def prune_checkpoints(checkpoint_root: str, keep: int) -> None:
    """Deletes all but the newest `keep` complete checkpoints (keep=0: none deleted) and any
    unfinished temporary folders."""
    steps = []
    for name in os.listdir(checkpoint_root):
        path = os.path.join(checkpoint_root, name)
        if name.startswith("step_") and ".tmp" in name:
            if is_owned(path):     # an unfinished one of ours; anything else is left alone
                shutil.rmtree(path, ignore_errors=True)
            continue
        m = _CHECKPOINT_RE.match(name)
        if m:
            steps.append(int(m.group(1)))
    if keep > 0:
        for step in sorted(steps)[:-keep]:
            shutil.rmtree(checkpoint_path(checkpoint_root, step), ignore_errors=True)
