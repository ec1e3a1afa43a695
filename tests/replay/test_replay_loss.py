"""Items that leave the replay table without reaching the learner (issue 26, finding 3).

replay/loss.py's `ReplayLossDetector` on its own (made-up counters and times, and a simulated
run checked against the obvious count of what a thief took), then inside a real `RolloutReader`
against a real Reverb server while a stranger's `reverb.Client` samples items away and resets
the table. The whole program under a thief is in tests/launch/test_liveness.py's SAO run.
"""
from __future__ import annotations

import os
import random
import sys

import pytest

from sao_actor_learner.replay.loss import ReplayLossDetector

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.timeout(120)


def test_in_transit_items_are_not_lost_and_stolen_ones_are_reported_once():
    d = ReplayLossDetector(timeout_s=1.0)
    assert d.observe(0.0, inserts=10, current_size=10, fetched=0) is None   # the baseline
    # The reader takes 4; they are in transit for a moment (removed, not yet fetched).
    assert d.observe(0.2, inserts=10, current_size=6, fetched=0) is None
    assert d.observe(0.5, inserts=10, current_size=6, fetched=4) is None
    assert d.observe(1.6, inserts=10, current_size=6, fetched=4) is None    # judged: all there
    # Someone else takes 3: not fetched within the timeout.
    assert d.observe(2.0, inserts=12, current_size=5, fetched=4) is None
    assert d.observe(2.5, inserts=12, current_size=5, fetched=4) is None
    verdict = d.observe(3.0, inserts=12, current_size=5, fetched=4)
    assert verdict is not None and verdict.missing == 3 and "3 items" in verdict.why
    for t in (3.5, 4.5, 6.0):                          # reported once, not again
        assert d.observe(t, inserts=12, current_size=5, fetched=4) is None
    assert d.missing_total == 3 and d.resets == 0


def test_baseline_covers_items_taken_before_the_reader_and_heals_an_inflated_one():
    d = ReplayLossDetector(timeout_s=1.0)
    # A previous learner took 7 of 9 (its restart's loss epoch covers them): not ours to report.
    assert d.observe(0.0, inserts=9, current_size=2, fetched=0) is None
    assert d.observe(2.0, inserts=9, current_size=2, fetched=0) is None
    assert d.observe(4.0, inserts=9, current_size=2, fetched=0) is None
    # A baseline taken while 2 of ours were in transit is too high by 2 ...
    d = ReplayLossDetector(timeout_s=1.0)
    assert d.observe(0.0, inserts=6, current_size=2, fetched=2) is None     # 4 removed, 2 here
    assert d.observe(0.1, inserts=6, current_size=2, fetched=4) is None     # healed
    # ... so a theft of 2 afterwards is still seen.
    assert d.observe(1.0, inserts=6, current_size=0, fetched=4) is None
    verdict = d.observe(2.5, inserts=6, current_size=0, fetched=4)
    assert verdict is not None and verdict.missing == 2


def test_a_reset_is_reported_and_junk_inserts_are_not_a_loss():
    d = ReplayLossDetector(timeout_s=1.0)
    assert d.observe(0.0, inserts=5, current_size=5, fetched=0) is None
    verdict = d.observe(0.5, inserts=0, current_size=0, fetched=0)          # Table::Reset
    assert verdict is not None and verdict.missing == -1 and "reset" in verdict.why
    assert d.resets == 1
    # 4 junk items inserted by a stranger, fetched (and refused) by the reader: no loss.
    assert d.observe(1.0, inserts=4, current_size=4, fetched=0) is None
    assert d.observe(1.5, inserts=4, current_size=0, fetched=4) is None
    assert d.observe(3.0, inserts=4, current_size=0, fetched=4) is None
    assert d.missing_total == 0
    with pytest.raises(ValueError, match="replay_loss_timeout_s=-1"):
        ReplayLossDetector(-1)


@pytest.mark.parametrize("seed", range(20))
def test_simulated_runs_report_exactly_what_a_thief_took(seed):
    """The detector against the obvious count: a table fed by inserts, drained by the reader
    (each fetch in transit for up to half the timeout) and by a thief; observed every 0.1 s
    with the reader's count read before the counters. Reported == stolen, and nothing is
    reported before the first theft."""
    rng = random.Random(seed)
    timeout = 1.0
    d = ReplayLossDetector(timeout)
    inserts = size = fetched = stolen = reported = 0
    in_transit = []                     # arrival times of the reader's items
    first_theft = None
    t = 0.0
    for step in range(400):
        t = step * 0.1
        arrived = [a for a in in_transit if a <= t]
        in_transit = [a for a in in_transit if a > t]
        observed_fetched = fetched          # read before the counters ...
        fetched += len(arrived)             # ... items that arrive meanwhile are not in it
        # The first observation comes before the reader's first fetch (as RolloutReader's).
        verdict = d.observe(t, inserts, size, observed_fetched)
        if verdict is not None:
            assert first_theft is not None and verdict.missing > 0, (seed, t, verdict)
            reported += verdict.missing
        if step < 300:
            n = rng.randint(0, 3)
            inserts, size = inserts + n, size + n
            take = min(size, rng.randint(0, 3))
            size -= take
            in_transit += [t + rng.uniform(0.0, timeout / 2)] * take
            if size and rng.random() < 0.05:
                k = rng.randint(1, size)
                size, stolen = size - k, stolen + k
                first_theft = t if first_theft is None else first_theft
    assert reported == stolen == d.missing_total, seed


# --------------------------------------------------------------- a real Reverb server
def test_the_reader_notices_a_stranger_sampling_and_a_reset():
    pytest.importorskip("reverb")
    import reverb

    from fault_fixtures import wait_for
    from sao_actor_learner.replay import ReplayServer, RolloutReader, RolloutWriter, connect
    from test_replay import MAX_LEN, VOCAB, make_rollout

    server = ReplayServer(queue_capacity=12).start()
    try:
        client = connect(server.address)
        reader = RolloutReader(client, loss_detector=ReplayLossDetector(timeout_s=2.0))
        with RolloutWriter(client, max_sequence_length=MAX_LEN, vocab_size=VOCAB) as writer:
            assert all(r.confirmed for r in writer.write_many(
                [make_rollout(8 + i, seed=i) for i in range(6)], timeout_s=30.0))
            got = reader.sample(2, timeout_s=30.0, min_items=2)
            assert len(got) == 2 and reader.interruptions == 0
            stranger = reverb.Client(server.address)
            assert len(list(stranger.sample("rollouts", num_samples=3))) == 3
            # The reader keeps sampling (the learner's wait): the one item left, then nothing;
            # the 3 items it never fetched are noticed, once.
            wait_for(lambda: reader.sample(4, timeout_s=0.2) is not None and
                     reader.interruptions, timeout=60, what="the theft noticed")
            assert reader.lost_to_others == 3 and reader.interruptions == 1
            assert reader.fetched == 3
            # A reset empties the table (its rate limiter's counts too).
            assert all(r.confirmed for r in writer.write_many(
                [make_rollout(8, seed=10 + i) for i in range(2)], timeout_s=30.0))
            stranger.reset("rollouts")
            wait_for(lambda: reader.sample(1, timeout_s=0.2) is not None and
                     reader.interruptions == 2, timeout=60, what="the reset noticed")
            assert reader.lost_to_others == 3
        reader.close()
    finally:
        server._shutdown()


def test_a_group_judges_its_ranks_fetches_together_and_notices_a_stranger():
    """Two readers of one table (a learner group's ranks) count their fetches in one shared
    counter: rank 0's detector sees rank 1's fetches as legitimate, and a stranger's as lost."""
    pytest.importorskip("reverb")
    import threading
    import time

    from fault_fixtures import wait_for
    from sao_actor_learner.replay import ReplayServer, RolloutReader, RolloutWriter, connect
    from sao_actor_learner.replay.loss import loss_detector
    from test_replay import MAX_LEN, VOCAB, make_rollout

    assert loss_detector(2.0, judge=False) is None and loss_detector(0.0) is None
    total, lock = [0], threading.Lock()

    def group_counter(n):   # what ProcessGroup.counter_total("replay_fetched", n) does
        with lock:
            total[0] += n
            return total[0]

    server = ReplayServer(queue_capacity=16).start()
    try:
        client = connect(server.address)
        rank0 = RolloutReader(client, loss_detector=loss_detector(2.0, judge=True),
                              fetch_counter=group_counter)
        rank1 = RolloutReader(connect(server.address), loss_detector=loss_detector(2.0, False),
                              fetch_counter=group_counter)
        with RolloutWriter(client, max_sequence_length=MAX_LEN, vocab_size=VOCAB) as writer:
            assert all(r.confirmed for r in writer.write_many(
                [make_rollout(8 + i, seed=i) for i in range(5)], timeout_s=30.0))
            assert len(rank0.sample(1, timeout_s=30.0, min_items=1)) == 1
            assert len(rank1.sample(4, timeout_s=30.0, min_items=4)) == 4
            # Rank 0 keeps sampling an empty table past its timeout: rank 1's 4 fetches are
            # no loss.
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline:
                rank0.sample(1, timeout_s=0.2)
            assert rank0.interruptions == 0 and total[0] == rank0.fetched + rank1.fetched == 5
            assert all(r.confirmed for r in writer.write_many(
                [make_rollout(8, seed=20 + i) for i in range(3)], timeout_s=30.0))
            # A stranger takes what it finds (rank 0 may have a fetch waiting in Reverb since
            # its loop, which takes one of the three first: that one is its own).
            stranger = RolloutReader(connect(server.address))
            stolen = stranger.sample(3, timeout_s=5.0, min_items=3)
            assert 2 <= len(stolen) <= 3
            wait_for(lambda: rank0.sample(4, timeout_s=0.2) is not None and
                     rank0.interruptions, timeout=60, what="the theft noticed")
            assert rank0.lost_to_others == len(stolen) and rank1.interruptions == 0
            assert total[0] == rank0.fetched + rank1.fetched == 8 - len(stolen)
            stranger.close()
        rank0.close()
        rank1.close()
    finally:
        server._shutdown()
