"""The learner's data position: what it has sampled since its last checkpoint, and resuming.

A learner checkpoint (learner/checkpointing.py) holds the policy, critic, optimisers,
version, counters and RNG state at the end of a step. Replay hands out each rollout once, so the
rollouts the learner took after that checkpoint exist nowhere else when it crashes. The journal
keeps them: `JournaledReader` (a core.RolloutSource) wraps the learner's replay reader (another)
and appends each rollout, as it arrives from replay (RolloutReader's `on_fetched`), to
`<checkpoints>/journal/after_step_<N>.log` (N: the version of the checkpoint it follows),
before the learner can use it.

Resuming (after a crash, a `kill -9`, or `--resume`): the learner is rebuilt from the newest
complete checkpoint, then its reader first hands back the journalled rollouts, in order, before
sampling replay again. The learner is deterministic given its state and its data (one thread,
no dropout) and never asks for more rollouts than it uses, so it redoes the lost steps exactly:
the same batches, staleness drops, weights and version numbers (a republished version must be
byte-identical, which the variable server checks). No version number is reused for other
weights. With no checkpoint yet, the redo starts from the initial weights (version 0).

Rollouts in transit when the learner is killed (replay removed them as it sent them; the journal
had not yet written them) are not lost: their actors still hold them (they keep every rollout
until the learner acknowledges it) and re-insert them when the restarted learner starts a new
loss epoch (learner/progress.py).

Each journal record is one write (segments.py: a header with a crc32, then the rollouts in
safe_records' format, which never executes code when read). A torn record is ignored. A write that
fails or writes short is an error (`JournalWriteError`): the journal refuses every later record
and the learner stops (records appended after a torn one would be lost at the next resume).

Segments and checkpoints. Checkpoints come on the learner's cadence and, whatever that is, once
the segment being appended to holds the journal limit (`journal_bytes`, disk_bounds.py), so
the journal stays bounded. A checkpoint at step N rotates the journal: segment N starts with a
meta record `{"carry": c}` and the c rollouts fetched before the checkpoint but not yet used
(they are also the last c of the segment before), written and fsynced before the checkpoint.
Segments from the previous complete checkpoint on are kept (older ones are deleted after the
checkpoint), so when the newest checkpoint turns out damaged (checkpoint_files.check_checkpoint)
ResumePoint falls back to the newest intact one, M, and redoes the chain: segment M, then each
later segment without its first c rollouts. Such a fallback first rewrites segment M as the whole
chain (meta `merged`: the sha256 of each later segment it now holds; those are deleted after,
and one still there with that digest is skipped, should a crash come between), so the journal
is again one segment after its checkpoint. With no intact checkpoint left, the redo starts from the
initial weights if segment 0 is still there, else resuming fails, naming what was skipped.

No torch here.
"""
from __future__ import annotations

import collections
import errno
import os
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

from absl import logging

from sao_actor_learner import core
from sao_actor_learner.learner.checkpoint_files import (  # noqa: F401 (checkpoint folders)
    LEARNER_STATE_FILE, check_checkpoint, checkpoint_path, complete_checkpoints,
    latest_checkpoint, prune_checkpoints)
from sao_actor_learner.learner.segments import (  # noqa: F401 (the journal's files)
    JournalWriteError, file_digest, frame, journal_dir, read_segment, read_segment_meta,
    segment_path, segment_steps, write_segment)
from sao_actor_learner.run_dirs import make_owned_dir


class ReaderJournal:
    """Append-only segments of sample() results (see the module docstring)."""

    def __init__(self, directory: str, after_step: int, run_id: str = "") -> None:
        self.directory = directory
        self.run_id = run_id         # recorded in each segment's meta (ResumePoint checks it)
        make_owned_dir(directory)    # marked: a fresh run may clear it (run_dirs.py)
        self._lock = threading.Lock()
        self._fd: Optional[int] = None
        self.failed: Optional[JournalWriteError] = None
        self.after_step = -1
        self.segment_bytes = 0        # bytes in the segment being appended to
        self._open(after_step)

    def _open(self, after_step: int) -> None:
        path = segment_path(self.directory, after_step)
        _, good = read_segment(path)
        if os.path.exists(path) and os.path.getsize(path) != good:
            with open(path, "r+b") as f:   # drop a torn tail before appending after it
                f.truncate(good)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if self.run_id and os.fstat(fd).st_size == 0:   # a new segment names its run first
            meta = frame({"run_id": self.run_id})
            if os.write(fd, meta) != len(meta):
                os.close(fd)
                raise JournalWriteError(errno.EIO, f"journal {path}: short write of its meta "
                                        "record")
        old, self._fd, self.after_step = self._fd, fd, after_step
        self.segment_bytes = os.fstat(fd).st_size
        if old is not None:
            os.close(old)

    def record(self, rollouts: Sequence[Any]) -> None:
        """Appends one sample() result (one write). Raises JournalWriteError when the record is
        not written whole, and for every record after that."""
        data = frame(list(rollouts))
        with self._lock:
            if self.failed is not None:
                raise self.failed
            try:
                written = os.write(self._fd, data)
                if written != len(data):
                    raise OSError(errno.EIO, f"short write: {written} of {len(data)} bytes")
                self.segment_bytes += written
            except OSError as e:
                self.failed = JournalWriteError(
                    e.errno, f"journal {segment_path(self.directory, self.after_step)}: a record "
                    f"could not be written ({e}); no more records are taken: the learner must "
                    "stop and resume from its checkpoint")
                raise self.failed from e

    def rotate(self, after_step: int, commit: Callable[[], Any],
               carry: Sequence[Sequence[Any]] = ()) -> Any:
        """Moves on to the segment that follows checkpoint `after_step`; returns commit()'s.

        `commit()` writes the checkpoint itself (atomically). The new segment, holding `carry`
        (records not yet handed back to the learner) after the meta record counting them, is on
        disk (fsynced) before the checkpoint; after it the segments older than the previous
        complete checkpoint (and any newer than this one) are deleted: a crash at any point
        leaves a checkpoint whose segment holds every rollout sampled after it, and the
        previous checkpoint its chain of segments (the module docstring).
        """
        with self._lock:
            if self.failed is not None:
                raise self.failed
        meta = {"carry": sum(len(r) for r in carry)}
        if self.run_id:
            meta["run_id"] = self.run_id
        write_segment(segment_path(self.directory, after_step), meta, carry)
        result = commit()
        with self._lock:
            self._open(after_step)
        previous = [s for s, _ in complete_checkpoints(os.path.dirname(
            os.path.abspath(self.directory))) if s < after_step]
        keep_from = previous[0] if previous else 0
        for step in segment_steps(self.directory):
            if step < keep_from or step > after_step:
                os.remove(segment_path(self.directory, step))
        return result

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


OnFetched = Callable[[Any], None]


class JournaledReader(core.RolloutSource):
    """The learner's rollout source: another core.RolloutSource (the replay reader) whose
    rollouts are journalled as they arrive, after handing back the journalled `replay` first.

    `JournaledReader(source, journal, replay)` journals what `source.sample()` returns.
    `JournaledReader.at_fetch(make_source, journal, replay)` builds the source with
    `make_source(on_fetched)`, a source that calls `on_fetched(rollout)` as each rollout arrives
    from replay (RolloutReader's `on_fetched`): then rollouts are journalled at once, even those
    a crash leaves in the source's buffer.

    replay: journalled records to hand back, in order, before sampling replay again (a
      deterministic learner then redoes exactly the steps it lost: only the order of the
      rollouts matters, as the learner never asks for more than it uses).
    """

    def __init__(self, source: core.RolloutSource, journal: ReaderJournal,
                 replay: Sequence[Sequence[Any]] = (), fetched: Optional[FetchedRollouts] = None
                 ) -> None:
        """`fetched`: what `source` journals as it fetches (set by `at_fetch`), else None."""
        self.journal = journal
        self._source = source
        self._fetched = fetched
        self._lock = fetched.lock if fetched is not None else threading.Lock()
        self._replay: List[Any] = [r for record in replay for r in record]
        self.replayed = 0              # rollouts handed back from the journal

    @classmethod
    def at_fetch(cls, make_source: Callable[[OnFetched], core.RolloutSource],
                 journal: ReaderJournal, replay: Sequence[Sequence[Any]] = ()
                 ) -> "JournaledReader":
        """A JournaledReader over `make_source(on_fetched)`, journalling in `on_fetched`."""
        fetched = FetchedRollouts(journal)
        return cls(make_source(fetched.record), journal, replay, fetched)

    @property
    def replaying(self) -> bool:
        """Whether journalled rollouts are still waiting to be handed back."""
        return bool(self._replay)

    def sample(self, n: int, timeout_s: float) -> List[Any]:
        if self._replay and n > 0:
            got, self._replay = self._replay[:n], self._replay[n:]
            self.replayed += len(got)
            return got           # already in the journal segment being appended to
        try:
            got = self._source.sample(n, timeout_s)
        except RuntimeError as e:
            if self.journal.failed is not None:   # the fetch thread could not journal: stop
                raise self.journal.failed from e
            # Replay went away mid-fetch (a restart): its items that reached the source stay
            # buffered for the next call; wait a little and report nothing now.
            logging.warning("replay sampling failed (%s); retrying", e)
            time.sleep(min(max(timeout_s, 0.0), 0.5))
            return []
        if self._fetched is not None:
            self._fetched.returned(got)
        elif got:
            self.journal.record(got)
        return got

    def checkpoint(self, after_step: int, commit: Callable[[], Any]) -> Any:
        """Writes checkpoint `after_step` with `commit()` and starts the journal segment after
        it, carrying what the learner has not used yet (journalled rollouts still to hand back,
        and fetched ones still in the source's buffer); returns commit()'s result."""
        with self._lock:     # no fetch is journalled while the segments rotate
            pending = [] if self._fetched is None else list(self._fetched.unreturned)
            carry = [r for r in (self._replay, pending) if r]
            return self.journal.rotate(after_step, commit, carry=carry)

    def journal_bytes(self) -> int:
        """Bytes in the journal segment after the newest checkpoint (the learner checkpoints
        when they pass its journal limit, which bounds the journal)."""
        return self.journal.segment_bytes

    def queue_size(self) -> int:
        """Rollouts waiting in replay; -1 while replay does not answer (it is restarting): a
        metric must not take the learner down."""
        try:
            return self._source.queue_size()
        except (TimeoutError, RuntimeError) as e:
            logging.log_every_n_seconds(logging.WARNING, "replay unreachable for queue_size: %s",
                                        30, e)
            return -1

    @property
    def buffered(self) -> int:
        return self._source.buffered

    @property
    def rejected(self) -> dict:
        return dict(self._source.rejected)

    @property
    def interruptions(self) -> int:
        return self._source.interruptions

    def close(self) -> None:
        self._source.close()
        self.journal.close()


class FetchedRollouts:
    """The rollouts a source journalled as they arrived (in its fetch thread, `record`) and
    `sample()` has not returned yet (`unreturned`: a checkpoint carries them)."""

    def __init__(self, journal: ReaderJournal) -> None:
        self.journal = journal
        self.lock = threading.Lock()
        self.unreturned: "collections.deque" = collections.deque()

    def record(self, rollout: Any) -> None:
        """In the source's fetch thread: journal the rollout before anyone can use it."""
        with self.lock:
            self.journal.record([rollout])
            self.unreturned.append(rollout)

    def returned(self, got: Sequence[Any]) -> None:
        """`got` left through sample(): usually the oldest ones; removed wherever they are."""
        with self.lock:
            if got:
                ids = {id(r) for r in got}
                self.unreturned = collections.deque(r for r in self.unreturned
                                                    if id(r) not in ids)
            if len(self.unreturned) > 4096:
                logging.log_every_n_seconds(
                    logging.WARNING, "JournaledReader: %d journalled rollouts were never "
                    "returned by the source", 60, len(self.unreturned))


# --- resuming -----------------------------------------------------------------------------------
class ResumePoint:
    """Where a learner picks up in `checkpoint_root`: the newest intact checkpoint (None: the
    initial weights), its step, and the rollouts journalled after it (its chain of segments,
    the module docstring). `skipped`: (checkpoint, why) of each newer one it could not use,
    also logged. Reading changes nothing on disk; `reader()` does (a fallback's chain is
    rewritten as one segment)."""

    def __init__(self, checkpoint_root: str, rank: int = 0, run_id: str = "") -> None:
        self.checkpoint_root = checkpoint_root
        self.journal_dir = journal_dir(checkpoint_root, rank)
        self.run_id = run_id     # given: only what this run's journal names is resumed from
        self.skipped: List[Tuple[str, str]] = []
        self._later: List[int] = []     # segments after the chosen one's (its chain)
        self._extra = False             # whether they add rollouts to it
        candidates = complete_checkpoints(checkpoint_root)
        for i, (step, path) in enumerate(candidates):
            problem, note = check_checkpoint(path)
            if problem is None:
                problem = self._chain(step, newest=i == 0)
            if problem is None:
                if note:
                    logging.warning("learner checkpoint %s: %s", path, note)
                self.checkpoint, self.step = path, step
                return
            self.skipped.append((path, problem))
            logging.warning("learner checkpoint %s skipped: %s", path, problem)
        self.checkpoint, self.step = None, 0
        problem = self._chain(0, newest=not candidates)
        if problem is not None:
            raise RuntimeError(
                f"no learner checkpoint in {checkpoint_root!r} can be resumed from: " +
                "; ".join(f"{p} skipped: {why}" for p, why in self.skipped) +
                f"; and the journal from the initial weights: {problem}. Restore an intact "
                "checkpoint (with its journal segment) there, or start a fresh run")
        if self.skipped:
            logging.warning("learner: no intact checkpoint left; redoing from the initial "
                            "weights with the journal since")

    def _chain(self, step: int, newest: bool) -> Optional[str]:
        """Reads the rollouts journalled after checkpoint `step` into `replay`; returns why
        they cannot be had (None: they can)."""
        first = segment_path(self.journal_dir, step)
        if not newest and not os.path.exists(first):
            return f"its journal segment {first} is gone"
        records, meta, _ = read_segment_meta(first)
        if self.run_id and (os.path.exists(first) or step > 0) and \
                meta.get("run_id") != self.run_id:   # a fresh run never resumes another's
            return (f"its journal segment {first} names run {meta.get('run_id')!r}, not this "
                    f"run {self.run_id!r} (run_identity.py): another run's, or an older "
                    "version's; a run resumes only what it wrote itself")
        later = [s for s in segment_steps(self.journal_dir) if s > step]
        extra: List[Any] = []
        merged = meta.get("merged", {})
        for s in later:
            if merged.get(str(s)) == file_digest(segment_path(self.journal_dir, s)):
                continue        # already in `first` (a fallback's rewrite), not yet deleted
            got, meta_s, _ = read_segment_meta(segment_path(self.journal_dir, s))
            flat = [r for record in got for r in record]
            if "carry" in meta_s:
                extra += flat[meta_s["carry"]:]
            elif os.path.exists(os.path.join(checkpoint_path(self.checkpoint_root, s),
                                             LEARNER_STATE_FILE)):
                return (f"journal segment {segment_path(self.journal_dir, s)} has no carry "
                        "count (written by an older version): the redo cannot be rebuilt")
            # else: a segment whose checkpoint never completed holds only carried rollouts
        self.replay = records + ([extra] if extra else [])
        self._later, self._extra = later, bool(extra)
        return None

    @property
    def resuming(self) -> bool:
        """Whether there is anything to resume from (else a fresh start)."""
        return self.checkpoint is not None or bool(self.replay)

    def reader(self, source: core.RolloutSource) -> JournaledReader:
        """`source` wrapped to journal what it returns from here on, after handing back
        `replay`. After a fallback the chain is first written as one segment."""
        return JournaledReader(source, self._journal(), self.replay)

    def reader_at_fetch(self, make_source: Callable[[OnFetched], core.RolloutSource]
                        ) -> JournaledReader:
        """As `reader`, over `make_source(on_fetched)`, journalling each rollout as it arrives
        (JournaledReader.at_fetch): the learner's replay reader."""
        return JournaledReader.at_fetch(make_source, self._journal(), self.replay)

    def _journal(self) -> ReaderJournal:
        """The journal from here on (a fallback's chain first rewritten as one segment)."""
        if self._later and (self.skipped or self._extra):
            path = segment_path(self.journal_dir, self.step)
            _, meta, _ = read_segment_meta(path)
            merged = {str(s): file_digest(segment_path(self.journal_dir, s))
                      for s in self._later}
            write_segment(path, {**meta, "merged": merged}, self.replay)
            for step in self._later:
                os.remove(segment_path(self.journal_dir, step))
            logging.warning("learner: journal segments after step %d merged into %s: %s",
                            self.step, path, self._later)
            self._later = []
        return ReaderJournal(self.journal_dir, self.step, self.run_id)

    def restore(self, learner: Any) -> None:
        """Loads the checkpoint's learner state into `learner` (whose policy was built from the
        checkpoint's weights) and marks it resumed."""
        if self.checkpoint is not None:
            # torch only here: the rest of this module needs none
            from sao_actor_learner.learner.checkpointing import read_learner_state
            learner.restore(read_learner_state(os.path.join(self.checkpoint,
                                                            LEARNER_STATE_FILE)))
        elif self.replay:
            learner.resumed_from = 0
        if self.resuming:
            logging.info("learner: resumed from %s (version %d); redoing %d journalled rollouts%s",
                         self.checkpoint or "the initial weights", learner.version,
                         sum(len(r) for r in self.replay),
                         "".join(f"; skipped {p}: {why}" for p, why in self.skipped))
