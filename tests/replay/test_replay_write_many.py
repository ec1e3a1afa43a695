"""RolloutWriter.write_many on a real Reverb server: one result per rollout, in order, rejected
ones never sent (and counted), what does not fit not sent at all, a lost race reported as
unconfirmed and its items landing later, exactly once (counted by sampling replay)."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

pytest.importorskip("reverb")

from sao_actor_learner.replay import ReplayServer, RolloutReader, RolloutWriter, WriteResult
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_replay import MAX_LEN, VOCAB, _invalid_rollouts, assert_same, make_rollout  # noqa: E402


@pytest.fixture
def small_server():
    srv = ReplayServer(queue_capacity=4).start()
    yield srv
    srv._shutdown()


@pytest.fixture
def server():
    srv = ReplayServer(queue_capacity=32).start()
    yield srv
    srv._shutdown()


def make_writer(srv, cls=RolloutWriter) -> RolloutWriter:
    return cls(srv.address, max_sequence_length=MAX_LEN, vocab_size=VOCAB)


def read_all(reader, n, timeout=30.0):
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got.extend(reader.sample(n - len(got), timeout_s=0.5))
    return got


def test_results_in_order_rejected_never_sent(server):
    invalid = _invalid_rollouts()
    bad = [(reason, cases[0]) for reason, cases in sorted(invalid.items())]
    good = [make_rollout(L, seed=i) for i, L in enumerate([3, 64, 17, 40, 2, 33, 9])]
    batch, expect = [], []
    for i, r in enumerate(good):   # valid ones of several buckets, invalid ones in between
        batch.append(r)
        expect.append(None)
        if i < len(bad):
            batch.append(bad[i][1])
            expect.append(bad[i][0])
    with make_writer(server) as writer, RolloutReader(server.address) as reader:
        results = writer.write_many(batch, timeout_s=30.0)
        assert len(results) == len(batch)
        for result, reason in zip(results, expect):
            assert isinstance(result, WriteResult)
            if reason is None:
                assert result == WriteResult(True, True, None)
            else:
                assert result == WriteResult(False, False, reason)
        assert writer.inserted == len(good) and writer.timeouts == 0
        assert writer.unconfirmed == 0
        assert writer.rejected == {reason: 1 for reason, _ in bad[:len(good)]}
        assert reader.queue_size() == len(good)           # nothing invalid reached replay
        got = read_all(reader, len(good))
    assert len(got) == len(good)
    for a, b in zip(good, got):                            # in order, unchanged, unpadded
        assert_same(a, b)


def test_sends_what_fits_and_nothing_more(small_server):
    sent = [make_rollout(8 + i, seed=i) for i in range(7)]
    with make_writer(small_server) as writer, RolloutReader(small_server.address) as reader:
        t0 = time.monotonic()
        results = writer.write_many(sent[:6], timeout_s=1.0)
        assert 0.95 <= time.monotonic() - t0 < 30.0         # waited for room until the timeout
        assert [r.inserted for r in results] == [True] * 4 + [False] * 2
        assert all(r.confirmed for r in results[:4])
        assert results[4:] == [WriteResult(False, False, None)] * 2   # not sent at all
        assert writer.timeouts == 2 and writer.inserted == 4 and writer.unconfirmed == 0
        assert reader.queue_size() == 4
        first = reader.sample(2, timeout_s=30.0, min_items=2)         # frees two slots
        again = writer.write_many(sent[4:7], timeout_s=1.0)            # the same two, retried
        assert [r.inserted for r in again] == [True, True, False]
        rest = read_all(reader, 4)
    # No duplicate of the attempts that sent nothing: exactly rollouts 0..5, in order.
    assert [r.prompt_id for r in first + rest] == [r.prompt_id for r in sent[:6]]


def test_fills_slots_freed_during_the_call(small_server):
    sent = [make_rollout(5 + i, seed=20 + i) for i in range(7)]
    with make_writer(small_server) as writer, RolloutReader(small_server.address) as reader:
        assert all(r.inserted for r in writer.write_many(sent[:4], timeout_s=30.0))
        got = []
        timer = threading.Timer(0.2, lambda: got.extend(reader.sample(3, 30.0, min_items=3)))
        timer.start()
        results = writer.write_many(sent[4:], timeout_s=30.0)  # full now: waits for the reader
        timer.join()
        assert all(r.inserted and r.confirmed for r in results)
        got.extend(read_all(reader, 4))
    assert [r.prompt_id for r in got] == [r.prompt_id for r in sent]


class _RaceLosingWriter(RolloutWriter):
    """Sees room for 8 whatever the table holds: what a writer does when other writers take
    the free slots between its check and its send."""

    def _wait_for_free_slot(self, deadline):
        return 8


def _race_for_the_last_two_slots(small_server, seed, race):
    """2 rollouts in a table of 4, then a racer that sees room for 8 sends 4 more (`race(racer,
    late)` sends and checks what the racer saw): 2 fit, 2 wait in the rate limiter, and land,
    once and in order, when a reader frees room."""
    with make_writer(small_server) as writer, RolloutReader(small_server.address) as reader:
        assert all(r.confirmed for r in writer.write_many(
            [make_rollout(8, seed=i) for i in range(2)], timeout_s=30.0))
        racer = make_writer(small_server, _RaceLosingWriter)
        late = [make_rollout(9 + i, seed=seed + i) for i in range(4)]
        race(racer, late)
        assert racer.unconfirmed == 2 and racer.inserted == 4 and racer.timeouts == 0
        assert reader.queue_size() == 4                       # the table never holds more
        got = reader.sample(4, timeout_s=30.0, min_items=4)  # frees 4: the 2 waiting land
        got += read_all(reader, 2, timeout=30.0)
        racer.close()
        # Exactly once: nothing more arrives, even after the racer is closed.
        assert reader.sample(4, timeout_s=0.5) == [] and reader.queue_size() == 0
    assert len(got) == 6
    assert [r.prompt_id for r in got[2:]] == [r.prompt_id for r in late]
    for a, b in zip(late, got[2:]):
        assert_same(a, b)


def test_lost_race_is_unconfirmed_then_lands_once(small_server):
    def race(racer, late):
        t0 = time.monotonic()
        results = racer.write_many(late, timeout_s=1.0)      # 2 fit, 2 wait in the rate limiter
        assert 0.95 <= time.monotonic() - t0 < 30.0
        assert [r.inserted for r in results] == [True] * 4  # all handed over: never resend
        assert [r.confirmed for r in results] == [True, True, False, False]
        assert all(r.rejected is None for r in results)
    _race_for_the_last_two_slots(small_server, 30, race)


class _RaceLosingNearlyFull(RolloutWriter):
    """Sees 3 free slots whatever the table holds: never room for the rest twice over."""

    def _wait_for_free_slot(self, deadline):
        return 3


def test_nearly_full_sends_one_per_check_so_a_lost_race_leaves_one_waiting(small_server):
    with make_writer(small_server) as writer, RolloutReader(small_server.address) as reader:
        assert all(r.confirmed for r in writer.write_many(
            [make_rollout(8, seed=i) for i in range(2)], timeout_s=30.0))
        racer = make_writer(small_server, _RaceLosingNearlyFull)
        late = [make_rollout(9 + i, seed=50 + i) for i in range(4)]
        results = racer.write_many(late, timeout_s=1.0)
        assert [(r.inserted, r.confirmed) for r in results] == [
            (True, True), (True, True), (True, False), (False, False)]
        assert racer.unconfirmed == 1 and racer.timeouts == 1 and racer.inserted == 3
        got = read_all(reader, 5, timeout=30.0)            # the waiting one lands, once
        racer.close()
        assert reader.sample(4, timeout_s=0.5) == [] and reader.queue_size() == 0
    assert [r.prompt_id for r in got[2:]] == [r.prompt_id for r in late[:3]]


def test_after_close_and_empty(small_server):
    writer = make_writer(small_server)
    assert writer.write_many([], timeout_s=0.1) == []
    writer.close()
    with pytest.raises(RuntimeError, match="after close"):
        writer.write_many([make_rollout(4, seed=1)], timeout_s=0.1)


# --- pipelined: what the actors' `send` does ------------------------------------------------------
def test_send_is_pipelined_lands_everything_in_order_and_flush_confirms(server):
    """`send` leaves its last group in flight (confirmed at the next call), across buckets of
    several sizes, and the items still land in order, each once."""
    sent = [make_rollout(L, seed=i) for i, L in enumerate([3, 64, 17, 40, 2, 33, 9, 50] * 2)]
    with make_writer(server) as writer, RolloutReader(server.address) as reader:
        for i in range(0, len(sent), 4):
            results = writer.write_many(sent[i:i + 4], timeout_s=30.0,
                                        wait_for_confirmation=False)
            assert [(r.inserted, r.confirmed, r.rejected) for r in results] == \
                [(True, False, None)] * 4      # handed over, in flight
        assert writer.send(sent[:0], timeout_s=1.0) == []
        assert writer.flush(timeout_s=30.0) and writer.unconfirmed == 0
        assert writer.flush(timeout_s=0.0)     # nothing in flight: nothing to wait for
        assert writer.inserted == len(sent) and writer.timeouts == 0
        got = read_all(reader, len(sent))
        assert reader.sample(4, timeout_s=0.3) == []
    assert [r.prompt_id for r in got] == [r.prompt_id for r in sent]
    for a, b in zip(sent, got):
        assert_same(a, b)


def test_close_waits_for_what_send_left_in_flight(server):
    sent = [make_rollout(30 + i, seed=i) for i in range(6)]
    writer = make_writer(server)
    assert writer.send(sent, timeout_s=30.0) == [True] * 6
    writer.close()                             # straight after: the in-flight items still land
    with RolloutReader(server.address) as reader:
        got = read_all(reader, 6)
    assert [r.prompt_id for r in got] == [r.prompt_id for r in sent]


def test_pipelined_lost_race_is_found_one_call_later_and_lands_once(small_server):
    def race(racer, late):
        assert racer.send(late, timeout_s=1.0) == [True] * 4   # handed over: never resend
        t0 = time.monotonic()
        assert not racer.flush(timeout_s=0.5)   # 2 fit, 2 wait in the rate limiter
        assert 0.45 <= time.monotonic() - t0 < 30.0
    _race_for_the_last_two_slots(small_server, 70, race)


class _CountingPolls(RolloutWriter):
    polls = 0

    def _wait_for_free_slot(self, deadline):
        self.polls += 1
        return super()._wait_for_free_slot(deadline)


def test_free_slot_answer_is_reused_while_it_leaves_room_twice_over(server, monkeypatch):
    """One ServerInfo poll serves later calls while its answer, less what this writer sent
    since, still fits the batch twice over; then the writer polls again. (The answer's age limit
    is set far away so that machine load cannot change the count.)"""
    from sao_actor_learner.replay import writer as writer_module
    monkeypatch.setattr(writer_module, "_FREE_HINT_S", 3600.0)
    with make_writer(server, _CountingPolls) as writer, RolloutReader(server.address) as reader:
        pair = [make_rollout(8, seed=1), make_rollout(9, seed=2)]
        for _ in range(15):                    # 32 free: 2 per call fit twice over 15 times
            assert writer.send(pair, timeout_s=30.0) == [True, True]
        assert writer.polls == 1
        assert len(read_all(reader, 30)) == 30
        assert writer.send(pair, timeout_s=30.0) == [True, True]
        assert writer.polls == 2               # 2 left by its count: it asked again (32 free)
        assert writer.send(pair, timeout_s=30.0) == [True, True] and writer.polls == 2
        assert writer.flush(timeout_s=30.0)
        got = read_all(reader, 4)
    assert len(got) == 4
