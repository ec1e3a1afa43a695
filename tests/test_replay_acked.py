"""AckedReader's one-stream protocol (issue 8) on a real Reverb server: what it relies on in the
installed Reverb (one sample of prefetch, table_size semantics), the journal-before-removal
property it exists for, crashes around the read, and the old per-sample protocol for tables
with 2 samples per rollout (checkpoints of issue 7)."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

reverb = pytest.importorskip("reverb")

from sao_actor_learner.replay import ReplayServer, RolloutWriter, rollouts_signature  # noqa: E402
from sao_actor_learner.replay.acked_reader import AckedReader  # noqa: E402
from sao_actor_learner.replay.tables import ACK_TIMES_SAMPLED, table_info  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_replay import MAX_LEN, VOCAB, assert_same, make_rollout  # noqa: E402


@pytest.fixture
def acked():
    srv = ReplayServer(queue_capacity=16, acknowledged=True).start()
    yield srv
    srv._shutdown()


def _fifo_table(name, capacity, times_sampled):
    return reverb.Table(
        name=name, sampler=reverb.selectors.Fifo(), remover=reverb.selectors.Fifo(),
        max_size=capacity, max_times_sampled=times_sampled, signature=rollouts_signature(),
        rate_limiter=reverb.rate_limiters.RateLimiter(
            samples_per_insert=max(1, times_sampled), min_size_to_sample=1, min_diff=0,
            max_diff=max(1, times_sampled) * capacity))


def write(srv_address, rollouts, table="rollouts"):
    with RolloutWriter(srv_address, table, max_sequence_length=MAX_LEN,
                       vocab_size=VOCAB) as writer:
        assert all(r.confirmed for r in writer.write_many(rollouts, timeout_s=5.0))


def samples_served(client, table="rollouts"):
    return int(table_info(client, table).rate_limiter_info.sample_stats.completed)


def test_installed_reverb_prefetches_one_sample(acked):
    """What the protocol's safety rests on (acked_reader.py): a sampler stream with one sample
    in flight has replay serve at most one sample more than were taken from it, and a sample's
    table_size counts the rollout that sample removes."""
    client = acked.client()
    write(acked.address, [make_rollout(10, seed=1), make_rollout(11, seed=2)])
    stream = client._client.NewSampler("rollouts", -1, 1)
    try:
        time.sleep(0.3)
        assert samples_served(client) == 1                   # asked for before any is taken
        infos = []
        for taken in range(1, ACK_TIMES_SAMPLED + 1):
            flat = stream.GetNextTrajectory()
            infos.append((int(flat[2]), int(flat[4])))       # (table_size, times_sampled)
            time.sleep(0.3)                                  # time for any further prefetch
            assert samples_served(client) == taken + 1, taken
        # 4 samples of the first rollout; its 4th (which removed it) still counts it.
        assert infos == [(2, 1), (2, 2), (2, 3), (2, 4)]
        assert table_info(client, "rollouts").current_size == 1
    finally:
        del stream


def test_every_rollout_is_journalled_before_replay_removes_it(acked):
    sent = [make_rollout(5 + i, seed=i) for i in range(9)]
    write(acked.address, sent)
    client = acked.client()
    sizes = []

    def journal(rollout):
        time.sleep(0.05)   # a removal the prefetch had triggered would have landed by now
        sizes.append(table_info(client, "rollouts").current_size)

    with AckedReader(acked.address, on_peeked=journal) as reader:
        got = []
        for n in (4, 4, 4):
            got += reader.sample(n, timeout_s=5.0)
        assert reader.queue_size() == 0 and reader.buffered == 0
    assert sizes == [9 - i for i in range(9)]               # still in replay at journal time
    assert [r.prompt_id for r in got] == [r.prompt_id for r in sent]
    for a, b in zip(sent, got):
        assert_same(a, b)
    assert all(isinstance(r.replay_key, int) for r in got)
    # Exactly ACK_TIMES_SAMPLED samples per rollout (a sample a call left unread is one of them).
    assert samples_served(client) == 9 * ACK_TIMES_SAMPLED


class _Crash(Exception):
    pass


def test_a_crash_around_the_journal_loses_nothing_and_uses_nothing_twice(acked):
    sent = [make_rollout(6 + i, seed=10 + i) for i in range(6)]
    write(acked.address, sent)
    journal = []

    def dies_before_journal(rollout):
        raise _Crash()

    def dies_after_journal(rollout):
        journal.append(rollout)
        if len(journal) == 2:
            raise _Crash()

    with pytest.raises(_Crash):
        AckedReader(acked.address, on_peeked=dies_before_journal).sample(3, timeout_s=5.0)
    with pytest.raises(_Crash):
        AckedReader(acked.address, on_peeked=dies_after_journal).sample(3, timeout_s=5.0)
    assert [r.prompt_id for r in journal] == [r.prompt_id for r in sent[:2]]
    # The restarted consumer knows the keys its journal holds: skips those, loses none.
    survivor = AckedReader(acked.address, on_peeked=journal.append,
                           skip_keys=[r.replay_key for r in journal])
    got = survivor.sample(10, timeout_s=2.0, min_items=4)
    assert [r.prompt_id for r in got] == [r.prompt_id for r in sent[2:]]
    assert survivor.skipped == 1                            # the one journalled, not acked
    assert [r.prompt_id for r in journal] == [r.prompt_id for r in sent]
    assert survivor.sample(1, timeout_s=0.1) == [] and survivor.queue_size() == 0


def test_empty_table_returns_within_timeout_and_wakes_for_a_late_write(acked):
    reader = AckedReader(acked.address)
    t0 = time.monotonic()
    assert reader.sample(4, timeout_s=0.3) == []
    assert 0.25 <= time.monotonic() - t0 < 1.5
    assert reader.sample(0, timeout_s=1.0) == []
    timer = threading.Timer(0.2, lambda: write(acked.address, [make_rollout(7, seed=3)]))
    timer.start()
    got = reader.sample(4, timeout_s=5.0)
    timer.join()
    assert [r.length for r in got] == [7]


def test_older_two_sample_table_is_read_a_sampler_per_sample_and_others_refused():
    server = reverb.Server(tables=[_fifo_table("two", 8, 2), _fifo_table("three", 8, 3),
                                   _fifo_table("plain", 8, 1)])
    address = f"127.0.0.1:{server.port}"
    try:
        sent = [make_rollout(4 + i, seed=40 + i) for i in range(5)]
        write(address, sent, table="two")
        reader = AckedReader(address, table="two")
        got = reader.sample(3, timeout_s=5.0) + reader.sample(3, timeout_s=5.0)
        assert [r.prompt_id for r in got] == [r.prompt_id for r in sent]
        assert reader.queue_size() == 0 and reader._stream is None
        for table in ("three", "plain"):
            with pytest.raises(RuntimeError, match="max_times_sampled"):
                AckedReader(address, table=table).sample(1, timeout_s=0.1)
    finally:
        server.stop()
