"""A content-keyed disk cache for start-up work that does not change between runs.

Two things are cached (docs/DESIGN.md, "Start-up"):
  - the rendered token ids of a dataset's prompts (tasks/dataset.py: the pre-launch checks, each
    actor and the evaluator render all of them otherwise, ~2.5 s per 20k GSM8K rows);
  - the pre-launch checks' verdict on a config (preflight.py: a passed check, never a failed
    one, so a bad config always meets the full checks).

An entry's key is a SHA-256 over everything its value depends on, so a changed input is a miss,
not a stale hit (as Hugging Face datasets' fingerprints): data files by path and content (up to
64 MB; larger ones by size and modification time in nanoseconds), a model directory's small
files (config, tokenizer, chat template) by content and its weights by size and time, the
settings involved, the installed versions of the libraries that tokenize and read files, and
the size and modification time of every Python file of this package (an edit to the code
invalidates everything).

Where: $SAO_CACHE_DIR, else ~/.cache/sao_actor_learner; SAO_CACHE_DIR=off turns caching off.
Entries are written atomically (a temporary file renamed); an entry that does not parse or
does not fit (a damaged or truncated file) is a miss and is rewritten; a cache that cannot be
written (a read-only or full disk) costs its speed only, never the run. Each kind keeps its
MAX_ENTRIES most recently written entries.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import secrets
import sys
import warnings
from typing import Any, Dict, Iterable, Optional

import numpy as np

ENV = "SAO_CACHE_DIR"
FORMAT = 1          # bump when what an entry holds changes
MAX_ENTRIES = 16    # per kind
_SMALL_FILE = 4 << 20   # model-directory files up to this size are hashed by content
HASHED_FILE_BYTES = 64 << 20   # data files up to this size are hashed by content (~0.1 s)
_LIBRARIES = ("transformers", "tokenizers", "pyarrow", "jinja2")
_code_fingerprint: Optional[str] = None


def cache_root() -> Optional[str]:
    """The cache directory, or None when SAO_CACHE_DIR=off."""
    value = os.environ.get(ENV)
    if value is not None and value.strip().lower() in ("off", "0", "none", ""):
        return None
    return value or os.path.join(os.path.expanduser("~"), ".cache", "sao_actor_learner")


def file_stamp(path: str) -> list:
    """[absolute path, size, mtime_ns] of a file (what changes when it is rewritten)."""
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_fingerprint(path: str) -> list:
    """A data file: [absolute path, size, content hash] up to HASHED_FILE_BYTES (a rewrite
    within the file system's timestamp granularity is still told apart), else its stamp."""
    st = os.stat(path)
    if st.st_size <= HASHED_FILE_BYTES:
        return [os.path.abspath(path), st.st_size, _sha256(path)]
    return file_stamp(path)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".npz")


def directory_fingerprint(path: str, weights: bool = True) -> list:
    """A model or critic directory: small files by content, large ones (weights) by stamp;
    weights=False leaves weight files out (what a tokenizer depends on)."""
    out = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if not os.path.isfile(full) or (not weights and name.endswith(WEIGHT_SUFFIXES)):
            continue
        if os.path.getsize(full) <= _SMALL_FILE:
            out.append([name, _sha256(full)])
        else:
            out.append([name, *file_stamp(full)[1:]])
    return out


def code_fingerprint() -> str:
    """Size and mtime of every .py file of this package, with the library versions."""
    global _code_fingerprint
    if _code_fingerprint is None:
        package = os.path.dirname(os.path.abspath(__file__))
        h = hashlib.sha256(sys.version.encode())
        for root, dirs, files in os.walk(package):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    h.update(json.dumps(file_stamp(os.path.join(root, name))).encode())
        for lib in _LIBRARIES:
            try:
                h.update(f"{lib}={importlib.metadata.version(lib)}".encode())
            except importlib.metadata.PackageNotFoundError:
                h.update(f"{lib}=none".encode())
        _code_fingerprint = h.hexdigest()
    return _code_fingerprint


def make_key(kind: str, parts: Any) -> str:
    """The key of an entry of `kind` whose value depends on `parts` (JSON-able)."""
    blob = json.dumps([FORMAT, kind, code_fingerprint(), parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:40]


def _path(kind: str, key: str, suffix: str) -> Optional[str]:
    root = cache_root()
    return None if root is None else os.path.join(root, kind, key + suffix)


def _write_atomic(path: str, write) -> None:
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        # Made with mode 0o666 less the umask by the kernel itself: no process-wide umask
        # round trip (another thread's file made meanwhile would get mode 0o666).
        tmp = os.path.join(folder, f".tmp-{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        _prune(folder)
    except OSError as e:   # read-only or full disk: the run goes on uncached
        warnings.warn(f"the start-up cache could not write {path} ({e}); set {ENV} to a "
                      f"writable folder, or {ENV}=off", RuntimeWarning, stacklevel=3)


def _prune(folder: str) -> None:
    entries = [os.path.join(folder, n) for n in os.listdir(folder) if not n.startswith(".")]
    if len(entries) <= MAX_ENTRIES:
        return
    entries.sort(key=lambda p: os.stat(p).st_mtime_ns)
    for old in entries[:-MAX_ENTRIES]:
        try:
            os.remove(old)
        except OSError:
            pass


def load_json(kind: str, key: str) -> Optional[Dict]:
    """The JSON object stored under (kind, key), or None (missing, damaged or caching off)."""
    path = _path(kind, key, ".json")
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def save_json(kind: str, key: str, value: Dict) -> None:
    path = _path(kind, key, ".json")
    if path is not None:
        _write_atomic(path, lambda f: f.write(json.dumps(value).encode()))


def load_sequences(kind: str, key: str, count: int) -> Optional[list]:
    """`count` int sequences stored under (kind, key) as tuples, or None (missing, damaged, a
    different count, or caching off)."""
    path = _path(kind, key, ".npz")
    if path is None or not os.path.exists(path):
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            flat, offsets = z["flat"], z["offsets"]
    except Exception:   # truncated or damaged: numpy/zipfile raise several kinds
        return None
    if (offsets.ndim != 1 or len(offsets) != count + 1 or offsets[0] != 0
            or offsets[-1] != len(flat) or np.any(np.diff(offsets) < 0)):
        return None
    values = flat.tolist()
    bounds = offsets.tolist()
    return [tuple(values[bounds[i]:bounds[i + 1]]) for i in range(count)]


def save_sequences(kind: str, key: str, sequences: Iterable) -> None:
    """Stores int sequences (token ids: below 2**31) under (kind, key)."""
    path = _path(kind, key, ".npz")
    if path is None:
        return
    sequences = list(sequences)
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in sequences], out=offsets[1:])
    flat = np.fromiter((t for s in sequences for t in s), dtype=np.int32, count=int(offsets[-1]))
    _write_atomic(path, lambda f: np.savez(f, flat=flat, offsets=offsets))
