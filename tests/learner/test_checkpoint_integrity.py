"""Learner checkpoints are durable and verified (learner/checkpoint_files.py, journal.py): each
holds a manifest of its files' sizes and sha256, written last and fsynced with the files, the
folder and its parent; a resumed learner checks the newest one and, when it is damaged, says so
and falls back to the newest intact one, redoing exactly from there with the journal segments
kept for it; a journal write that fails is an error, not silently lost records."""
import hashlib
import json
import os

import numpy as np
import pytest
import torch

from sao_actor_learner import core
from sao_actor_learner.builder import assemble_learner, setup_process
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.learner import journal as journal_lib
from sao_actor_learner.learner.journal import (JournaledReader, ReaderJournal, ResumePoint,
                                               journal_dir, read_segment, segment_path)
from sao_actor_learner.models import CharTokenizer, make_tiny_model
from sao_actor_learner.models import checkpoint as ckpt
from sao_actor_learner.models.value import ValueModel
from sao_actor_learner.types import Rollout, collate

TOK = CharTokenizer()


def _segments(directory):
    return sorted(int(n[len("after_step_"):-len(".log")]) for n in os.listdir(directory)
                  if n.startswith("after_step_") and n.endswith(".log"))


# ------------------------------------------------------------------ journal segments (no torch)
def _fake_checkpoint(root, step, state=b"state"):
    path = os.path.join(root, f"step_{step:06d}")
    os.makedirs(path)
    with open(os.path.join(path, "learner_state.pt"), "wb") as f:
        f.write(state)       # no manifest: checked by size only (an older checkpoint)
    return path


def test_the_journal_keeps_the_segments_the_previous_checkpoint_needs(tmp_path, monkeypatch):
    root = str(tmp_path / "checkpoints")
    jdir = journal_dir(root)
    journal = ReaderJournal(jdir, 0)
    journal.record([0, 1, 2])
    journal.rotate(2, lambda: _fake_checkpoint(root, 2), carry=[[2]])
    assert _segments(jdir) == [0, 2]          # the initial weights' segment is kept too
    journal.record([3, 4])
    journal.rotate(4, lambda: _fake_checkpoint(root, 4), carry=[[4]])
    assert _segments(jdir) == [2, 4]
    journal.record([5, 6])
    journal.rotate(6, lambda: _fake_checkpoint(root, 6), carry=[])
    assert _segments(jdir) == [4, 6]
    journal.record([7])
    journal.close()
    assert read_segment(segment_path(jdir, 4))[0] == [[4], [5, 6]]   # the carry is a record
    assert ResumePoint(root).replay == [[7]]   # the newest intact checkpoint: as before

    # step 6 damaged: back to step 4, redoing segment 4 and what segment 6 adds (not its carry)
    open(os.path.join(root, "step_000006", "learner_state.pt"), "wb").close()
    point = ResumePoint(root)
    assert (point.step, [r for rec in point.replay for r in rec]) == (4, [4, 5, 6, 7])
    assert point.skipped[0][0].endswith("step_000006") and "empty" in point.skipped[0][1]
    real_remove = os.remove
    monkeypatch.setattr(journal_lib.os, "remove", lambda path: (_ for _ in ()).throw(
        OSError("the machine died")))
    with pytest.raises(OSError, match="died"):
        point.reader(_ListReader())           # merged into segment 4, segment 6 not yet gone
    monkeypatch.setattr(journal_lib.os, "remove", real_remove)
    assert _segments(jdir) == [4, 6]
    point = ResumePoint(root)                 # segment 6 is not counted twice
    assert (point.step, [r for rec in point.replay for r in rec]) == (4, [4, 5, 6, 7])
    point.reader(_ListReader()).close()        # the chain is rewritten as one segment
    assert _segments(jdir) == [4]
    again = ResumePoint(root)
    assert (again.step, [r for rec in again.replay for r in rec]) == (4, [4, 5, 6, 7])

    # The redo reaches step 6 again and checkpoints it; the rollouts journalled after that are
    # part of step 4's chain too, should the new step 6 be damaged in turn.
    journal = ReaderJournal(jdir, 4)
    journal.record([8])                                       # fetched after the chain
    journal.rotate(6, lambda: None, carry=[[7, 8]])           # step 6 rewritten in place
    journal.record([9])
    journal.close()
    assert _segments(jdir) == [4, 6]
    point = ResumePoint(root)                                 # step 6 still damaged
    assert (point.step, [r for rec in point.replay for r in rec]) == (4, [4, 5, 6, 7, 8, 9])

    # nothing intact and the initial weights' journal gone: an error naming what was skipped
    for step in (4, 2):
        open(os.path.join(root, f"step_00000{step}", "learner_state.pt"), "wb").close()
    with pytest.raises(RuntimeError, match=r"step_000006 skipped: .*step_000004 skipped: .*"
                                           r"step_000002 skipped"):
        ResumePoint(root)


class _ListReader(core.RolloutSource):
    def __init__(self, items=()):
        self.items = list(items)

    def sample(self, n, timeout_s):
        got, self.items = self.items[:n], self.items[n:]
        return got

    def queue_size(self):
        return len(self.items)


def test_a_failed_journal_write_is_an_error_not_lost_records(tmp_path, monkeypatch):
    journal = ReaderJournal(str(tmp_path / "journal"), 0)
    journal.record([1])
    real_write = os.write
    monkeypatch.setattr(journal_lib.os, "write", lambda fd, data: real_write(fd, data[:5]))
    with pytest.raises(OSError, match="short write: 5 of"):
        journal.record([2])
    monkeypatch.setattr(journal_lib.os, "write", real_write)
    with pytest.raises(OSError, match="could not be written"):
        journal.record([3])                    # nothing is appended after a torn record
    # A fetch thread's journal failure stops the learner's sampling instead of a retry.
    source = JournaledReader.at_fetch(lambda on_fetched: _FailingFetchReader(on_fetched),
                                     journal)
    with pytest.raises(OSError, match="could not be written"):
        source.sample(1, 0.1)
    journal.close()
    assert read_segment(segment_path(str(tmp_path / "journal"), 0))[0] == [[1]]


class _FailingFetchReader(core.RolloutSource):
    """A reader factory whose fetch thread hands each rollout to on_fetched (which fails) and
    then reports the failure from sample(), as RolloutReader does."""

    def __init__(self, on_fetched):
        self.on_fetched = on_fetched

    def sample(self, n, timeout_s):
        try:
            self.on_fetched(99)
        except OSError as e:
            raise RuntimeError(f"sampling failed: {e}") from e
        return [99]

    def queue_size(self):
        return 0


# ----------------------------------------------------------------- the learner's checkpoints
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny"))
    ckpt.save_checkpoint(make_tiny_model("llama", vocab_size=TOK.vocab_size, hidden_size=64,
                                         num_heads=2, intermediate_size=64, seed=3), TOK, out)
    return out


def _rollout(i, version):
    rng = np.random.default_rng(i)
    length = 6 + i % 5
    mask = np.zeros(length, np.int8)
    mask[3:] = 1
    return Rollout(tokens=rng.integers(3, TOK.vocab_size, length), action_mask=mask,
                   rollout_logp=np.zeros(length), versions=np.where(mask == 1, version, -1),
                   rewards=np.where(np.arange(length) == length - 1, float(i % 2), 0.0),
                   prompt_id=i, actor_id=0, seq=i)


class _StreamReader(core.RolloutSource):
    def __init__(self, stream, position=0):
        self.stream, self.position, self.calls = stream, position, 0

    def sample(self, n, timeout_s):
        piece = (3, 1, 4, 2)[self.calls % 4]
        self.calls += 1
        got = self.stream[self.position:self.position + min(n, piece)]
        self.position += len(got)
        return got

    def queue_size(self):
        return len(self.stream) - self.position


class _Publisher:
    """Records the sha256 of every published version's weights."""

    def __init__(self):
        self.versions = {}

    def publish(self, version, payload, dropped_total=0):
        self.versions.setdefault(version, []).append(hashlib.sha256(payload).hexdigest())

    def report_progress(self, version, dropped_total, trained_total, loss_epoch=0, acks=None):
        from sao_actor_learner.variables.publisher import ProgressResult
        return ProgressResult(0, 0, False, loss_epoch, version)


def _learner(config, run_dir, reader, publisher):
    """builder.make_learner's resume path with a stand-in reader."""
    setup_process(config, offset=10_000)
    resume = ResumePoint(os.path.join(run_dir, "checkpoints"))
    policy, tokenizer = ckpt.load_policy(resume.checkpoint or config.init_checkpoint)
    critic = ValueModel.from_policy(policy)
    critic.freeze(config.critic_frozen_patterns)
    learner = assemble_learner(config, policy, critic, resume.reader(reader),
                               publisher=publisher, serialize=ckpt.state_dict_to_bytes,
                               tokenizer=tokenizer,
                               checkpoint_root=os.path.join(run_dir, "checkpoints"),
                               pad_id=tokenizer.pad_id)
    resume.restore(learner)
    return learner, resume


@pytest.fixture(scope="module")
def setting(tiny_dir):
    config = SAOConfig(init_checkpoint=tiny_dir, batch_size=4, max_steps=6, max_staleness=1,
                       checkpoint_every=2, critic_updates=1)
    stream = [_rollout(i, version=max(0, i // 5 - 1)) for i in range(60)]
    policy0 = ckpt.load_policy(tiny_dir)[0]
    with torch.no_grad():     # behaviour log-probs of the start, so the policy trains
        logp = assemble_learner(config, policy0, ValueModel.from_policy(policy0)
                                ).policy_trainer.logprobs(collate(stream))
    for i, r in enumerate(stream):
        r.rollout_logp = (logp[i, :r.length].numpy() * r.action_mask).astype(np.float32)
    return config, stream


def test_a_checkpoint_has_a_manifest_and_is_fsynced(setting, tmp_path, monkeypatch):
    config, stream = setting
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    learner, _ = _learner(config, str(tmp_path), _StreamReader(stream), _Publisher())
    learner.publish()
    for _ in range(2):
        learner.step()                                   # checkpoint at 2
    path = str(tmp_path / "checkpoints" / "step_000002")
    with open(os.path.join(path, "manifest.json")) as f:
        files = json.load(f)["files"]
    on_disk = {os.path.relpath(os.path.join(d, n), path) for d, _, names in os.walk(path)
               for n in names} - {"manifest.json"}
    assert set(files) == on_disk and {"model.safetensors", "learner_state.pt"} <= on_disk
    for rel, entry in files.items():
        data = open(os.path.join(path, rel), "rb").read()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    # Every file and the folder were fsynced (under their temporary name), then the parent.
    tmp_name = [p for p in synced if "step_000002.tmp-" in p]
    assert {os.path.basename(p) for p in tmp_name} >= on_disk | {"manifest.json"}
    assert any(p.endswith(".tmp-" + str(os.getpid())) for p in tmp_name)
    assert os.path.realpath(str(tmp_path / "checkpoints")) in synced
    assert ResumePoint(str(tmp_path / "checkpoints")).skipped == []


def test_a_damaged_newest_checkpoint_is_skipped_and_the_redo_is_exact(setting, tmp_path,
                                                                       caplog):
    config, stream = setting
    pub_a = _Publisher()
    a, _ = _learner(config, str(tmp_path / "a"), _StreamReader(stream), pub_a)   # uninterrupted
    a.run()
    assert a.version == 6

    run_b = str(tmp_path / "b")
    pub_b = _Publisher()
    reader_b = _StreamReader(stream)
    b, _ = _learner(config, run_b, reader_b, pub_b)
    b.publish()
    for _ in range(5):
        b.step()                                 # checkpoints at 2 and 4; 5 published; "crash"
    b.source.sample(2, 1.0)                      # sampled, never trained: in the journal only
    del b
    assert _segments(os.path.join(run_b, "checkpoints", "journal")) == [2, 4]
    weights = os.path.join(run_b, "checkpoints", "step_000004", "model.safetensors")
    with open(weights, "r+b") as f:              # the machine died before the disk had it all
        f.truncate(os.path.getsize(weights) // 2)

    c, resume = _learner(config, run_b, _StreamReader(stream, reader_b.position), pub_b)
    assert [os.path.basename(p) for p, _ in resume.skipped] == ["step_000004"]
    assert "model.safetensors has" in resume.skipped[0][1]
    assert (c.version, c.resumed_from, c.source.replaying) == (2, 2, True)
    c.run()
    assert c.version == 6
    assert all(len(pub_b.versions[v]) == 2 for v in (3, 4, 5))    # published twice: redone
    for version, hashes in pub_b.versions.items():  # each redone version: the same weights
        assert set(hashes) == set(pub_a.versions[version]), version
    assert len(set(pub_a.versions[0]) | set(pub_a.versions[6])) == 2   # it did train
    for name, tensor in a.policy.state_dict().items():
        assert torch.equal(tensor, c.policy.state_dict()[name]), name
    assert (c.dropped_stale, c.rollouts_trained) == (a.dropped_stale, a.rollouts_trained)
    final = ResumePoint(os.path.join(run_b, "checkpoints"))
    assert final.step == 6 and not final.replay and final.skipped == []


def test_a_checkpoint_without_a_manifest_is_accepted_unless_its_files_are_short(tmp_path):
    root = str(tmp_path / "checkpoints")
    path = _fake_checkpoint(root, 2)
    ckpt.save_checkpoint(make_tiny_model("llama", vocab_size=TOK.vocab_size, hidden_size=64,
                                         num_heads=2, intermediate_size=64), TOK, path)
    point = ResumePoint(root)
    assert (point.checkpoint, point.skipped) == (path, [])    # accepted (with a warning)
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) - 3)
    with pytest.raises(RuntimeError, match=r"step_000002 skipped: .*model.safetensors: "
                                           r"truncated: expected \d+ bytes, found \d+"):
        ResumePoint(root)       # and no journal from the initial weights to redo instead
