"""The files of the learner's journal (journal.py): one segment per checkpoint,
`<journal dir>/after_step_<N>.log`, a sequence of records, each one write of a 12-byte header
(magic, payload length, crc32 of the payload) and a payload in safe_records' format (plain
data, arrays and Rollouts; reading it never executes code): a list of rollouts, or a meta dict
(`run_id`: the run that wrote the segment, run_identity.py; `carry`: how many rollouts at the
segment's start were carried over from the one before; `merged`: the sha256 of each later
segment a fallback merged into it). A torn or corrupt record ends the segment's intact prefix.
A segment of a version before this format (pickled records) is refused (OldJournalError), never
unpickled.

No torch here.
"""
from __future__ import annotations

import hashlib
import os
import re
import struct
import zlib
from typing import Any, Dict, List, Sequence, Tuple

from absl import logging

from sao_actor_learner import safe_records
from sao_actor_learner.learner.checkpoint_files import fsync_path

_MAGIC = b"SAOJ"
_HEADER = struct.Struct("<4sII")      # magic, payload length, crc32 of the payload
_SEGMENT_RE = re.compile(r"^after_step_(\d{6,})\.log$")


class JournalWriteError(OSError):
    """A journal record could not be written whole; the journal takes no more records."""


class OldJournalError(RuntimeError):
    """A journal segment whose intact records are not in safe_records' format (a version
    before it pickled them, or a tampered file); the message names it and what to do."""


def journal_dir(checkpoint_root: str, rank: int = 0) -> str:
    """Rank 0's journal is checkpoints/journal; rank r's of a learner group journal_rank<r>."""
    return os.path.join(checkpoint_root, "journal" if rank == 0 else f"journal_rank{rank}")


def segment_path(directory: str, after_step: int) -> str:
    return os.path.join(directory, f"after_step_{after_step:06d}.log")


def frame(obj: Any) -> bytes:
    payload = safe_records.dumps(obj)
    return _HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload


def file_digest(path: str) -> str:
    """sha256 hex of a file's bytes ("" when it does not exist)."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return ""


def segment_steps(directory: str) -> List[int]:
    """The steps of the journal segments in `directory`, ascending."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(m.group(1)) for m in map(_SEGMENT_RE.match, os.listdir(directory)) if m)


def read_segment(path: str) -> Tuple[List[List[Any]], int]:
    """(the records of one journal segment, the byte length of its intact prefix)."""
    records, _, good = read_segment_meta(path)
    return records, good


def read_segment_meta(path: str) -> Tuple[List[List[Any]], Dict[str, Any], int]:
    """(records, meta record (empty before segments had one), intact prefix length)."""
    records: List[List[Any]] = []
    meta: Dict[str, Any] = {}
    good = 0
    if not os.path.exists(path):
        return records, meta, 0
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos + _HEADER.size <= len(data):
        magic, length, crc = _HEADER.unpack_from(data, pos)
        start, end = pos + _HEADER.size, pos + _HEADER.size + length
        if magic != _MAGIC or end > len(data) or zlib.crc32(data[start:end]) != crc:
            logging.warning("journal %s: torn or corrupt record at byte %d (of %d); ignoring "
                            "the rest", path, pos, len(data))
            break
        try:
            record = safe_records.loads(data[start:end])
        except safe_records.UnsafeRecordError as e:
            raise OldJournalError(
                f"journal segment {path}: record at byte {pos} is not in this version's format "
                f"({e}); it is not read (an older journal was pickled, and unpickling a copied "
                "or changed file can run code). Resume with the version that wrote it, or "
                "start a fresh run (without --resume)") from None
        if isinstance(record, dict):
            meta.update(record)
        else:
            records.append(record)
        pos = good = end
    return records, meta, good


def write_segment(path: str, meta: Dict[str, Any], records: Sequence[Sequence[Any]]) -> None:
    """Writes a whole segment (meta record first) durably: temporary file, fsync, rename, fsync
    of the folder. JournalWriteError naming `path` when it cannot (e.g. ENOSPC): then the
    temporary file is removed and `path` is as it was."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(frame(dict(meta)))
            for record in records:
                f.write(frame(list(record)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(os.path.dirname(os.path.abspath(path)))
    except OSError as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise JournalWriteError(e.errno, f"journal segment {path}: could not be written ({e}); "
                                "free space on that disk (or put --run_dir on another) and "
                                "resume the learner") from e
