"""Disks fill: the spool ledger, metrics, the journal and the learner's
checkpoints stay bounded by default, and a full disk fails clearly, naming the file, without
losing what was acknowledged; a failed metrics write is counted, not fatal.

Where root may mount one, the full disk is a real tmpfs of a few hundred KiB (`small_disk`);
elsewhere those tests skip, and the ones that inject ENOSPC into one write (marked) still run.
"""
import errno
import os
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch

from sao_actor_learner.actors import spool as spool_lib
from sao_actor_learner.actors.ledger import compacted_lines, read_ledger, write_compacted
from sao_actor_learner.actors.spool import LEDGER, RolloutSpool, SpoolWriteError
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.learner.checkpoint_files import (CheckpointWriteError,
                                                        complete_checkpoints, write_checkpoint)
from sao_actor_learner.learner.disk_bounds import checkpoint_due
from sao_actor_learner.learner.journal import ResumePoint
from sao_actor_learner.learner.segments import JournalWriteError, segment_steps, write_segment
from sao_actor_learner.observers.metrics import MetricsLogger, read_metrics
from sao_actor_learner.types import Rollout
from test_checkpoint_integrity import (  # noqa: F401 (setting, tiny_dir: fixtures)
    _learner, _Publisher, _StreamReader, setting, tiny_dir)


def rollout(k: int) -> Rollout:
    mask = np.array([0, 0, 1, 1, 1], np.int8)
    return Rollout(tokens=np.arange(k, k + 5), action_mask=mask,
                   rollout_logp=np.where(mask == 1, -0.5, 0.0), versions=np.where(mask, 3, -1),
                   rewards=[0, 0, 0, 0, float(k)], prompt_id=k, actor_id=1)


@pytest.fixture()
def small_disk(tmp_path):
    """A real 256 KiB file system (tmpfs); the test skips where it cannot be mounted."""
    path = str(tmp_path / "disk")
    os.mkdir(path)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", path],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


def fill(directory: str) -> str:
    """Fills the file system of `directory` to the last byte; returns the filler file."""
    path = os.path.join(directory, "filler")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    with open(path, "ab", buffering=0) as f:   # the last partial page too
        try:
            while True:
                f.write(b"\0")
        except OSError:
            pass
    return path


# --- the spool's ledger ---------------------------------------------------------------------
def test_the_spool_ledger_is_compacted_and_reads_back_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(spool_lib, "COMPACT_MIN_BYTES", 2048)
    directory = str(tmp_path / "actor_1")
    spool = RolloutSpool(directory)
    rng = random.Random(0)
    held, acked, sizes = [], set(), []
    admitted = released = refused = 0
    for k in range(1500):
        spool.asking(2)
        spool.admitted(2)
        admitted += 2
        if k % 50 == 7:
            spool.refuse("bad_value")
            spool.released(1)
            refused, released = refused + 1, released + 1
        seq = spool.put(rollout(k))
        spool.sent([seq], epoch=k // 500)
        held.append(seq)
        if len(held) > 8:                      # acknowledged a little out of order
            done = set(rng.sample(held[:6], 3))
            assert spool.acknowledge(lambda s: s in done) == 3
            held = [s for s in held if s not in done]
            acked |= done
        sizes.append(os.path.getsize(os.path.join(directory, LEDGER)))
    assert spool.compactions > 10
    assert max(sizes) < 2048 + 1024       # one compacted ledger + what grew since
    state = read_ledger(directory)
    assert state["completed"] == set(range(1500)) and state["acked"] == acked
    assert state["held"] == set(held) and state["sent_once"] == 1500
    assert (state["admitted"], state["released"]) == (admitted, released)
    assert state["refused"] == {"bad_value": refused}
    spool.close()
    again = RolloutSpool(directory)           # a restart reads the compacted ledger
    assert (again.completed, again.sent_once, again.acknowledged, again.held) == (
        1500, 1500, len(acked), len(held))
    assert again.owed_releases() == admitted - 1500 - released
    assert [s for s, _ in again.to_send(epoch=2)] == sorted(held)   # sent before the restart
    assert again.put(rollout(0)) == 1500


def _random_ledger(directory, rng):
    """A ledger of random events (and the files of the rollouts it holds), written as the
    spool writes them, torn last line included."""
    os.makedirs(directory)
    lines, held = [], set()
    for seq in range(rng.randrange(1, 60)):
        lines += [f"ask {rng.randrange(1, 4)}", f"adm {rng.randrange(0, 4)}"]
        if rng.random() < 0.1:
            lines.append(f"rej 0 {rng.choice(['too_long', 'bad_value'])}")
        if rng.random() < 0.1:
            lines.append(f"rel {rng.randrange(1, 3)}")
        if rng.random() < 0.9:
            lines.append(f"put {seq}")
        for _ in range(rng.randrange(0, 3)):
            lines.append(f"sent {seq} {rng.randrange(0, 3)}")
        if rng.random() < 0.6:
            lines.append(f"ack {seq}")
        else:
            held.add(seq)
    if rng.random() < 0.5:
        lines.append(f"ask {rng.randrange(1, 4)}")        # unanswered
    for seq in held:
        open(os.path.join(directory, f"{seq:012d}.rollout"), "wb").close()
    with open(os.path.join(directory, LEDGER), "w") as f:
        f.write("".join(line + "\n" for line in lines) + "put 9")      # torn


def test_a_compacted_ledger_says_what_the_raw_one_said(tmp_path):
    for seed in range(30):
        directory = str(tmp_path / str(seed))
        _random_ledger(directory, random.Random(seed))
        raw = read_ledger(directory)                    # the slow, obvious reading
        write_compacted(directory)
        compact = read_ledger(directory)
        for key in ("completed", "acked", "held", "refused", "admitted", "released", "asked",
                    "sent_once"):
            assert compact[key] == raw[key], (seed, key)
        kept = raw["completed"] - raw["acked"]
        assert compact["sent"] == {s: e for s, e in raw["sent"].items() if s in kept}
        assert compacted_lines(compact) == compacted_lines(raw)     # a fixed point


def test_a_failed_ledger_write_names_the_ledger_and_takes_no_more(tmp_path, monkeypatch):
    """Injected ENOSPC on one ledger append (the real disk is in the next test)."""
    directory = str(tmp_path / "actor_1")
    spool = RolloutSpool(directory)
    kept = [spool.put(rollout(k)) for k in range(3)]
    real_write = os.write

    def write(fd, data):
        if fd == spool._ledger:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(SpoolWriteError, match=f"spool ledger {directory}/ledger.log: .*No "
                                              "space left"):
        spool.sent(kept, epoch=0)
    monkeypatch.setattr(os, "write", real_write)     # space again: still no more lines
    with pytest.raises(SpoolWriteError):
        spool.put(rollout(3))
    spool.close()
    again = RolloutSpool(directory)
    assert again.held == 3 and [s for s, _ in again.to_send(0)] == kept   # nothing lost


def test_a_full_disk_stops_the_spool_naming_the_file_and_loses_nothing(small_disk):
    directory = os.path.join(small_disk, "actor_1")
    spool = RolloutSpool(directory)
    kept = []
    with pytest.raises(SpoolWriteError, match=f"spool (file|ledger) {directory}/.*No space "
                                              "left on device"):
        for k in range(10_000):
            kept.append(spool.put(rollout(k)))
            spool.sent([kept[-1]], epoch=0)
            spool.acknowledge(lambda s: s < len(kept) - 20)
    spool.close()
    assert len(kept) > 20
    subprocess.run(["mount", "-o", "remount,size=2m", small_disk], check=True)   # freed
    again = RolloutSpool(directory)
    acked = set(read_ledger(directory)["acked"])
    assert acked and set(kept) - acked <= {s for s, _ in again.to_send(1)}
    assert not [n for n in os.listdir(directory) if n.endswith(".tmp")]


# --- metrics --------------------------------------------------------------------------------
def test_a_metrics_write_that_fails_is_counted_and_training_goes_on(tmp_path, monkeypatch):
    """Injected ENOSPC on the metrics file (the real disk is in the next test)."""
    logger = MetricsLogger(str(tmp_path), role=None)
    logger.write({"step": 1})
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")) if fd == logger._fd else
        real_write(fd, data))
    logger.write({"step": 2})                      # no exception
    assert logger.write_failures == 1
    monkeypatch.setattr(os, "write", real_write)
    logger.write({"step": 3})
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 3]


def test_metrics_on_a_full_disk_are_lost_not_fatal(small_disk):
    logger = MetricsLogger(small_disk, role=None)
    logger.write({"step": 1})
    filler = fill(small_disk)
    for step in range(2, 5):
        logger.write({"step": step, "padding": "x" * 5000})   # beyond the file's last page
    assert logger.write_failures == 3
    os.remove(filler)
    logger.write({"step": 5})
    assert [r["step"] for r in read_metrics(small_disk)] == [1, 5]


def test_metrics_rotate_and_the_newest_rows_are_read_back(tmp_path):
    learner = MetricsLogger(str(tmp_path), role=None, max_bytes=4096)
    evaluator = MetricsLogger(str(tmp_path), role=None, default_kind="eval",
                              max_bytes=4096)
    for step in range(300):
        learner.write({"step": step})
        if step % 3 == 0:
            evaluator.write({"policy_version": step})
    assert learner.rotations + evaluator.rotations >= 5
    path = str(tmp_path / "metrics.jsonl")
    assert os.path.getsize(path) < 4096 + 200 and os.path.getsize(path + ".1") < 4096 + 200
    train = [r["step"] for r in read_metrics(str(tmp_path), "train")]
    evals = [r["policy_version"] for r in read_metrics(str(tmp_path), "eval")]
    assert train == list(range(300 - len(train), 300)) and len(train) > 20   # newest, in order
    assert evals == list(range(evals[0], 300, 3))


# --- the journal and the learner's checkpoints ----------------------------------------------
def test_checkpoint_due():
    sizes = iter([10, 99, 100])
    assert checkpoint_due(4, 2, lambda: 0, 100)                   # the cadence
    assert not checkpoint_due(3, 2, lambda: next(sizes), 100)     # 10 bytes
    assert not checkpoint_due(5, 0, lambda: next(sizes), 100)     # 99
    assert checkpoint_due(7, 0, lambda: next(sizes), 100)         # 100: the limit
    assert not checkpoint_due(7, 0, lambda: 10 ** 12, 0)          # no limit


def test_the_journal_and_the_checkpoints_stay_bounded_by_default(setting, tmp_path):
    """checkpoint_every=0 (a checkpoint only at the end) and default retention: the journal
    limit makes checkpoints as the journal grows, and only the newest two are kept."""
    config, stream = setting
    config = config.replace(checkpoint_every=0,
                            keep_checkpoints=SAOConfig().keep_checkpoints)
    learner, _ = _learner(config, str(tmp_path), _StreamReader(stream), _Publisher())
    learner.journal_max_bytes = 3000          # ~6 of these small rollouts
    journal = str(tmp_path / "checkpoints" / "journal")
    learner.publish()
    largest, written = 0, set()
    for _ in range(6):
        learner.step()
        written.add(learner.checkpointed_version)
        segments = [os.path.getsize(os.path.join(journal, f"after_step_{s:06d}.log"))
                    for s in segment_steps(journal)]
        largest = max(largest, segments[-1])
        assert sum(segments) < 2 * 3000 + 2 * 4 * 700, segments   # two segments at most
    assert largest < 3000 + 4 * 700          # the limit + one step's rollouts
    written.discard(None)
    assert len(written) >= 3                 # checkpoints without a cadence (run() not called)
    steps = [s for s, _ in complete_checkpoints(str(tmp_path / "checkpoints"))]
    assert steps == sorted(written, reverse=True)[:2]        # the newest two are kept
    point = ResumePoint(str(tmp_path / "checkpoints"))   # and resumable from the newest
    assert point.step == steps[0] and point.skipped == []


def test_a_checkpoint_that_cannot_be_written_fails_naming_it(setting, tmp_path, monkeypatch):
    """torch.save on a full disk raises RuntimeError('[enforce fail at inline_container.cc
    ...] unexpected pos'), with no errno and no path (measured on a tmpfs); injected here."""
    config, stream = setting
    learner, _ = _learner(config, str(tmp_path), _StreamReader(stream), _Publisher())
    learner.publish()
    for _ in range(2):
        learner.step()                          # checkpoint 2 written
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if str(f).endswith("learner_state.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos "
                               "576 vs 534")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    learner.step()
    with pytest.raises(CheckpointWriteError, match=r"learner checkpoint .*step_000004: could "
                                                   r"not be written .*unexpected pos.*Free "
                                                   r"space"):
        learner.step()                          # checkpoint 4 fails
    root = str(tmp_path / "checkpoints")
    assert not [n for n in os.listdir(root) if ".tmp" in n]    # its temporary folder is gone
    assert ResumePoint(root).step == 2          # the run resumes from the one before


def test_checkpoint_and_journal_segment_on_a_full_disk_fail_naming_them(small_disk):
    path = os.path.join(small_disk, "step_000002")
    with pytest.raises(CheckpointWriteError, match=f"learner checkpoint {path}: could not be "
                                                   "written"):
        write_checkpoint(path, lambda tmp: torch.save(torch.zeros(1 << 17),
                                                      os.path.join(tmp, "learner_state.pt")))
    assert os.listdir(small_disk) == []                        # nothing left behind
    segment = os.path.join(small_disk, "after_step_000002.log")
    with pytest.raises(JournalWriteError, match=f"journal segment {segment}: .*No space"):
        write_segment(segment, {"carry": 1}, [[b"x" * (1 << 19)]])
    assert os.listdir(small_disk) == []
