"""The learner's parts on their own: the progress protocol (learner/progress.py), the key
exchange between ranks (learner/group_keys.py), the journal over a core.RolloutSource
(learner/journal.py), and the layering of the shared math (learner_math.py)."""
import ast
import os
import threading

import numpy as np
import pytest

from sao_actor_learner import core
from sao_actor_learner.learner import distributed, group_keys
from sao_actor_learner.learner.journal import JournaledReader, ReaderJournal
from sao_actor_learner.learner.progress import LearnerProgress
from sao_actor_learner.learner.sampling import RolloutSampler
from sao_actor_learner.replay.reader import RolloutReader
from sao_actor_learner.learner.segments import read_segment, segment_path
from sao_actor_learner.types import Rollout

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "sao_actor_learner")


def _rollout(seq, actor=0, version=0):
    mask = np.array([0, 0, 1, 1], np.int8)
    return Rollout(tokens=np.arange(3, 7), action_mask=mask, rollout_logp=np.zeros(4),
                   versions=np.where(mask == 1, version, -1), rewards=np.zeros(4),
                   prompt_id=seq, actor_id=actor, seq=seq)


class _ListSource(core.RolloutSource):
    def __init__(self, items=()):
        self.items = list(items)
        self.closed = False

    def sample(self, n, timeout_s):
        got, self.items = self.items[:n], self.items[n:]
        return got

    def close(self):
        self.closed = True


# --------------------------------------------------------------------------------- progress
class _Answer:
    def __init__(self, loss_epoch):
        self.loss_epoch = loss_epoch


class _Server(core.WeightPublisher):
    """A variable server that already holds loss epoch `epoch` and refuses republishing."""

    def __init__(self, epoch=0, refuse=None):
        self.epoch, self.refuse, self.reports, self.published = epoch, refuse, [], []

    def publish(self, version, payload, dropped_total=0):
        if self.refuse is not None:
            raise self.refuse
        self.published.append((version, payload, dropped_total))
        return version

    def report_progress(self, version, dropped_total, trained_total, loss_epoch=0, acks=None):
        self.reports.append((version, dropped_total, trained_total, loss_epoch, acks))
        self.epoch = max(self.epoch, loss_epoch)
        return _Answer(self.epoch)


def _counters():
    return {"version": 3, "dropped_total": 2, "trained_total": 12, "acks": {0: (5, [])}}


def test_a_new_loss_epoch_goes_above_the_one_the_server_holds():
    server = _Server(epoch=7)
    progress = LearnerProgress(server, None, _counters)
    progress.start_loss_epoch()
    assert progress.loss_epoch == 8
    assert [r[3] for r in server.reports] == [1, 8]
    assert server.reports[-1][:3] == (3, 2, 12) and server.reports[-1][4] == {0: (5, [])}


def test_interruptions_start_a_loss_epoch_only_when_they_grow():
    server = _Server()
    progress = LearnerProgress(server, None, _counters)
    progress.interruptions_seen = 2
    progress.notice_interruptions(2)
    assert progress.loss_epoch == 0 and server.reports == []
    progress.notice_interruptions(3)
    assert progress.loss_epoch == 1 and progress.interruptions_seen == 3


def test_without_a_publisher_nothing_is_sent_but_loss_epochs_count():
    calls = []
    progress = LearnerProgress(None, None, lambda: calls.append(1) or _counters())
    progress.start_loss_epoch()
    progress.publish(1, lambda: calls.append(2) or {}, dropped_total=0, resumed=False)
    assert progress.report() is None and progress.loss_epoch == 1 and calls == []


class _Refused(core.VersionConflict):
    """What the variable server's publisher raises for a version it holds (PublishConflictError)."""


def test_a_resumed_learner_counts_a_diverged_republish_and_a_fresh_one_raises():
    server = _Server(refuse=_Refused("version 4: different payload"))
    progress = LearnerProgress(server, lambda weights: b"w", _counters)
    progress.publish(4, dict, dropped_total=0, resumed=True)
    assert progress.resume_publish_conflicts == 1
    server.refuse = _Refused("version 4 is not newer than 4")
    progress.publish(4, dict, dropped_total=0, resumed=True)
    assert progress.resume_publish_conflicts == 1
    with pytest.raises(_Refused):
        progress.publish(4, dict, dropped_total=0, resumed=False)
    server.refuse = RuntimeError("the server is away")     # not a conflict: never swallowed
    with pytest.raises(RuntimeError, match="away"):
        progress.publish(4, dict, dropped_total=0, resumed=True)
    server.refuse = None
    progress.publish(5, dict, dropped_total=9, resumed=False)
    assert server.published == [(5, b"w", 9)]


# -------------------------------------------------------------------------------- group keys
class _SecondRank(distributed.Collective):
    """Rank 1 of two, the other rank having drawn `other_keys` first (then nothing)."""
    rank, world_size = 1, 2

    def __init__(self, other_keys):
        self.other_keys = list(other_keys)

    def gather_objects(self, obj):
        if isinstance(obj, list):        # the keys of a draw
            other, self.other_keys = self.other_keys, []
            return [other, obj]
        return [obj, obj]

    def max(self, values):
        return [float(v) for v in values]


def test_a_key_two_ranks_drew_stays_with_the_lower_rank_and_the_other_draws_again():
    source = _ListSource([_rollout(s) for s in range(6)])
    sampler = RolloutSampler(source, max_staleness=4)
    rollouts, _, dropped = group_keys.draw_exclusive(
        sampler, _SecondRank([(0, 1), (0, 9)]), 3, 0, threading.Event())
    assert [r.key for r in rollouts] == [(0, 0), (0, 2), (0, 3)]
    assert sampler.duplicates == 1 and dropped == 0


def test_one_process_draws_plainly_and_shares_nothing():
    sampler = RolloutSampler(_ListSource([_rollout(s) for s in range(3)]), max_staleness=4)
    rollouts, _, _ = group_keys.draw_exclusive(sampler, distributed.SINGLE, 2, 0,
                                               threading.Event())
    group_keys.share_consumed(sampler, distributed.SINGLE)
    assert [r.key for r in rollouts] == [(0, 0), (0, 1)] and sampler.duplicates == 0


# ---------------------------------------------------------------------------------- journal
def test_the_journal_takes_a_rollout_source_and_uses_its_interface(tmp_path):
    source = _ListSource([_rollout(s) for s in range(3)])
    reader = JournaledReader(source, ReaderJournal(str(tmp_path), 0))
    assert [r.key for r in reader.sample(2, 0.1)] == [(0, 0), (0, 1)]
    assert (reader.buffered, reader.rejected, reader.interruptions) == (0, {}, 0)
    assert reader.queue_size() == -1            # the interface's "unknown"
    reader.close()
    assert source.closed
    records, _ = read_segment(segment_path(str(tmp_path), 0))
    assert [[r.key for r in record] for record in records] == [[(0, 0), (0, 1)]]


class _FetchingSource(core.RolloutSource):
    """Hands each rollout to on_fetched as it 'arrives', keeps it buffered until sampled."""

    def __init__(self, on_fetched, items):
        self.on_fetched, self.buffer = on_fetched, []
        for r in items:
            self.on_fetched(r)
            self.buffer.append(r)

    def sample(self, n, timeout_s):
        got, self.buffer = self.buffer[:n], self.buffer[n:]
        return got

    @property
    def buffered(self):
        return len(self.buffer)


def test_at_fetch_journals_on_arrival_and_a_checkpoint_carries_what_is_unreturned(tmp_path):
    journal = ReaderJournal(str(tmp_path), 0)
    reader = JournaledReader.at_fetch(
        lambda on_fetched: _FetchingSource(on_fetched, [_rollout(s) for s in range(3)]),
        journal)
    records, _ = read_segment(segment_path(str(tmp_path), 0))
    assert len(records) == 3 and reader.buffered == 3       # journalled before any sample()
    assert [r.key for r in reader.sample(1, 0.1)] == [(0, 0)]
    assert reader.checkpoint(1, lambda: "done") == "done"
    records, _ = read_segment(segment_path(str(tmp_path), 1))
    assert [r.key for record in records for r in record] == [(0, 1), (0, 2)]
    reader.close()


def test_the_replay_reader_is_a_rollout_source():
    assert issubclass(RolloutReader, core.RolloutSource)


# ---------------------------------------------------------------------------------- layering
def _package_imports(folder):
    """module paths imported at the top level of every .py under `folder` (absolute form)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(folder, name)).read())
        found = []
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0 or node.module, f"{name}: `from . import` hides the import"
                base = node.module if node.level == 0 else f"<relative>.{node.module}"
                found += [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                found += [a.name for a in node.names]
        out[name] = found
    return out


def test_kernels_import_no_learner_and_the_shared_math_imports_neither():
    for name, found in _package_imports(os.path.join(PACKAGE, "kernels")).items():
        assert not [m for m in found if m.startswith("sao_actor_learner.learner.")], name
    shared = ast.parse(open(os.path.join(PACKAGE, "learner_math.py")).read())
    imported = [n.module or "" for n in shared.body if isinstance(n, ast.ImportFrom)] + \
        [a.name for n in shared.body if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith("sao_actor_learner")], imported
