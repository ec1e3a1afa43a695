"""The replay path on a real Reverb server: table, writer, reader (no mocks).

One server per test (a fresh `ReplayServer` starts in ~10 ms once Reverb is imported); the writer
in another process is a spawned child that imports Reverb itself (~3-4 s).
"""
from __future__ import annotations

import multiprocessing
import threading
import time

import numpy as np
import pytest

reverb = pytest.importorskip("reverb")

from sao_actor_learner.replay import (ITEM_COLUMNS, REJECT_REASONS, ReplayServer, RolloutReader,
                                      RolloutWriter, bucket_lengths, make_rollouts_table)
from sao_actor_learner.types import (SCALAR_COLUMNS, SCALAR_DTYPES, TOKEN_COLUMNS, TOKEN_DTYPES,
                                     Rollout)

MAX_LEN = 64
VOCAB = 100


def make_rollout(length: int, seed: int, prompt_id: int = None) -> Rollout:
    """A valid rollout: a prompt of length//3 tokens, then action tokens; distinct values."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(length, np.int8)
    mask[max(1, length // 3):] = 1
    return Rollout(
        tokens=rng.integers(0, VOCAB, length),
        action_mask=mask,
        rollout_logp=np.where(mask == 1, -rng.random(length) * 3, 0.0),
        versions=np.where(mask == 1, rng.integers(0, 5, length), -1),
        rewards=np.where(np.arange(length) == length - 1, rng.normal(), 0.0),
        prompt_id=(2 ** 40 + seed) if prompt_id is None else prompt_id,
        actor_id=seed % 3,
        group_id=7 * seed + 1,
        start_time=1.7e9 + seed / 3.0,
        end_time=1.7e9 + seed / 3.0 + 0.123456789,
        truncated=seed % 2,
    )


def assert_same(a: Rollout, b: Rollout) -> None:
    for name in TOKEN_COLUMNS:
        x, y = getattr(a, name), getattr(b, name)
        assert y.dtype == TOKEN_DTYPES[name], name
        assert x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)
    for name in SCALAR_COLUMNS:
        x, y = getattr(a, name), getattr(b, name)
        assert x == y, (name, x, y)
        assert np.asarray(y, SCALAR_DTYPES[name]) == np.asarray(x, SCALAR_DTYPES[name])


@pytest.fixture
def server():
    srv = ReplayServer(queue_capacity=16)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    srv.start()  # idempotent: returns once serving
    yield srv
    srv.stop()
    thread.join(timeout=10)


@pytest.fixture
def small_server():
    srv = ReplayServer(queue_capacity=4).start()
    yield srv
    srv.stop()
    srv._shutdown()


def make_writer(srv) -> RolloutWriter:
    return RolloutWriter(srv.address, max_sequence_length=MAX_LEN, vocab_size=VOCAB)


def test_table_config():
    table = make_rollouts_table(8)
    info = table.info
    assert info.max_size == 8 and info.max_times_sampled == 1
    assert info.sampler_options.fifo and info.remover_options.fifo
    assert info.rate_limiter_info.max_diff == 8
    assert info.rate_limiter_info.samples_per_insert == 1
    assert set(info.signature) == set(ITEM_COLUMNS)
    with pytest.raises(ValueError, match="queue_capacity=0"):
        make_rollouts_table(0)


def test_server_signature_proto_is_tensorflows_encoding():
    """ReplayServer hands its C++ table the signature as bytes (no TensorFlow in its process):
    they must be what reverb.Table makes of rollouts_signature()."""
    from tensorflow.python.saved_model import nested_structure_coder

    from sao_actor_learner.replay.tables import ROLLOUTS_SIGNATURE_PROTO, rollouts_signature
    encoded = nested_structure_coder.encode_structure(rollouts_signature()).SerializeToString()
    assert ROLLOUTS_SIGNATURE_PROTO == encoded


def test_buckets():
    assert bucket_lengths(64) == [16, 20, 24, 28, 32, 40, 48, 56, 64]
    assert bucket_lengths(64, per_octave=2) == [16, 24, 32, 48, 64]
    assert bucket_lengths(100)[-3:] == [80, 96, 100]
    assert bucket_lengths(8) == [8]
    b = bucket_lengths(4096)
    assert b[-5:] == [2048, 2560, 3072, 3584, 4096] and b == sorted(set(b))


def test_round_trip_varied_lengths_fifo(server):
    lengths = [2, 5, 17, 64, 3, 33, 16, 48, 49, 64, 9]
    sent = [make_rollout(L, seed=i) for i, L in enumerate(lengths)]
    with make_writer(server) as writer, RolloutReader(server.address) as reader:
        for r in sent:
            assert writer.write(r, timeout_s=5.0)
        assert writer.inserted == len(sent) and writer.rejected == {}
        assert reader.queue_size() == len(sent)
        got = []
        while len(got) < len(sent):
            batch = reader.sample(4, timeout_s=5.0)
            assert 1 <= len(batch) <= 4
            got.extend(batch)
    assert len(got) == len(sent)
    for a, b in zip(sent, got):  # FIFO: same order
        assert_same(a, b)


def test_each_item_sampled_once(server):
    with make_writer(server) as writer, RolloutReader(server.address) as reader:
        for i in range(6):
            assert writer.write(make_rollout(10 + i, seed=i), timeout_s=5.0)
        got = reader.sample(10, timeout_s=0.5, min_items=10)  # more than there are: times out
        assert [r.length for r in got] == [10 + i for i in range(6)]
        assert reader.queue_size() == 0
        t0 = time.monotonic()
        assert reader.sample(10, timeout_s=0.3) == []
        assert time.monotonic() - t0 < 2.0


def test_reader_polls_the_table_only_when_its_last_fetch_left_nothing_behind(server):
    """Each fetched item reports the table's size when it was taken; while the last one left
    items behind (only this reader takes items, so they are still there) the next `sample`
    asks for them without a ServerInfo round trip."""
    sent = [make_rollout(10 + i, seed=i) for i in range(10)]
    with make_writer(server) as writer, RolloutReader(server.address) as reader:
        assert all(r.confirmed for r in writer.write_many(sent, timeout_s=30.0))
        polls = []
        status = reader._client.table_status
        reader._client.table_status = lambda *a, **k: polls.append(1) or status(*a, **k)
        got = reader.sample(4, timeout_s=30.0, min_items=4)
        assert len(polls) == 1                  # the first call asks: 10 there
        got += reader.sample(4, timeout_s=30.0, min_items=4)
        got += reader.sample(4, timeout_s=30.0, min_items=2)
        assert len(polls) == 1 and len(got) == 10   # 6, then 2 left behind: no poll
        assert reader.sample(4, timeout_s=0.2) == [] and len(polls) >= 2   # 0 left: it polls
    assert [r.prompt_id for r in got] == [r.prompt_id for r in sent]


def test_empty_table_returns_empty_within_timeout(server):
    with RolloutReader(server.address) as reader:
        t0 = time.monotonic()
        assert reader.sample(8, timeout_s=0.3) == []
        elapsed = time.monotonic() - t0
        assert 0.25 <= elapsed < 1.5, elapsed
        assert reader.sample(8, timeout_s=0.0) == []
        assert reader.buffered == 0


def test_reader_wakes_up_for_a_late_write(server):
    with make_writer(server) as writer, RolloutReader(server.address) as reader:
        timer = threading.Timer(0.2, lambda: writer.write(make_rollout(12, seed=1), 5.0))
        timer.start()
        t0 = time.monotonic()
        got = reader.sample(4, timeout_s=5.0)
        timer.join()
        assert len(got) == 1 and got[0].length == 12
        assert time.monotonic() - t0 < 2.0


def test_rate_limiter_blocks_fifth_write_until_a_sample(small_server):
    sent = [make_rollout(8 + i, seed=i) for i in range(6)]
    with make_writer(small_server) as writer, RolloutReader(small_server.address) as reader:
        for r in sent[:4]:
            assert writer.write(r, timeout_s=5.0)
        t0 = time.monotonic()
        assert writer.write(sent[4], timeout_s=0.3) is False  # full: times out, nothing sent
        assert 0.25 <= time.monotonic() - t0 < 1.5
        assert writer.timeouts == 1 and writer.inserted == 4 and writer.rejected == {}
        assert writer.write(sent[4], timeout_s=0.1) is False
        assert reader.queue_size() == 4

        first = reader.sample(1, timeout_s=5.0)  # frees one slot
        assert len(first) == 1
        assert_same(sent[0], first[0])
        assert writer.write(sent[4], timeout_s=5.0)  # the same rollout, retried: now it fits
        assert writer.write(sent[5], timeout_s=0.2) is False
        assert reader.queue_size() == 4
        rest = reader.sample(10, timeout_s=2.0, min_items=4)
        # No duplicate of the timed-out attempts: exactly rollouts 1..4, in order.
        assert [r.prompt_id for r in rest] == [r.prompt_id for r in sent[1:5]]
        assert reader.queue_size() == 0 and writer.unconfirmed == 0


class _RaceLosingWriter(RolloutWriter):
    """Sends without waiting for a free slot: what a writer does when another one takes the slot
    between its check and its send."""

    def _wait_for_free_slot(self, deadline):
        return True


def test_lost_race_item_lands_later_and_is_not_resent(small_server):
    with make_writer(small_server) as writer, RolloutReader(small_server.address) as reader:
        for i in range(4):
            assert writer.write(make_rollout(8, seed=i), timeout_s=5.0)
        racer = _RaceLosingWriter(small_server.address, max_sequence_length=MAX_LEN,
                                  vocab_size=VOCAB)
        late = make_rollout(9, seed=9)
        t0 = time.monotonic()
        assert racer.write(late, timeout_s=0.2)  # handed over, waits in the rate limiter
        assert 0.15 <= time.monotonic() - t0 < 1.5
        assert racer.unconfirmed == 1 and racer.inserted == 1
        assert reader.queue_size() == 4
        got = reader.sample(1, timeout_s=5.0)  # frees a slot: the waiting item lands
        assert got[0].prompt_id == make_rollout(8, seed=0).prompt_id
        deadline = time.monotonic() + 5
        while reader.queue_size() < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reader.queue_size() == 4
        racer.close()
        rest = reader.sample(4, timeout_s=5.0, min_items=4)
        assert [r.prompt_id for r in rest][-1] == late.prompt_id
        assert_same(late, rest[-1])


def test_concurrent_writers_on_a_full_queue_deliver_each_rollout_once(small_server):
    """Four writers retrying on False against a 4-slot queue and a slow reader: every rollout
    arrives exactly once (False never sent anything; True always lands)."""
    per_writer, n_writers = 15, 4
    results = {}

    def produce(w: int) -> None:
        with make_writer(small_server) as writer:
            for i in range(per_writer):
                r = make_rollout(4 + (i % 40), seed=1000 * w + i, prompt_id=1000 * w + i)
                while not writer.write(r, timeout_s=0.01):
                    pass
            results[w] = writer.stats()

    threads = [threading.Thread(target=produce, args=(w,)) for w in range(n_writers)]
    for t in threads:
        t.start()
    got = []
    with RolloutReader(small_server.address) as reader:
        deadline = time.monotonic() + 60
        while len(got) < per_writer * n_writers and time.monotonic() < deadline:
            got.extend(reader.sample(3, timeout_s=0.5))
            time.sleep(0.02)  # the learner is slower than the actors: the queue stays full
        for t in threads:
            t.join(timeout=30)
        assert reader.sample(4, timeout_s=0.2) == []
    ids = [r.prompt_id for r in got]
    assert sorted(ids) == sorted(1000 * w + i for w in range(n_writers) for i in range(per_writer))
    assert sum(s["inserted"] for s in results.values()) == per_writer * n_writers
    assert sum(s["timeouts"] for s in results.values()) > 0, results  # the queue was full
    for w in range(n_writers):  # each writer's rollouts stay in order
        mine = [i for i in ids if i // 1000 == w]
        assert mine == sorted(mine)


def _invalid_rollouts():
    ok = make_rollout(10, seed=3)

    def but(**changes):
        r = make_rollout(10, seed=3)
        for k, v in changes.items():
            setattr(r, k, v)
        return r

    nan_logp = ok.rollout_logp.copy(); nan_logp[-1] = np.nan
    inf_logp = ok.rollout_logp.copy(); inf_logp[-2] = -np.inf
    big_token = ok.tokens.copy(); big_token[0] = VOCAB
    neg_token = ok.tokens.copy(); neg_token[4] = -1
    bad_mask = ok.action_mask.copy(); bad_mask[5] = 2
    neg_version = ok.versions.copy(); neg_version[-1] = -1
    nan_reward = ok.rewards.copy(); nan_reward[0] = np.nan
    first_action = ok.action_mask.copy(); first_action[0] = 1
    return {
        "nonfinite_logp": [but(rollout_logp=nan_logp), but(rollout_logp=inf_logp)],
        "token_out_of_range": [but(tokens=big_token), but(tokens=neg_token)],
        "too_long": [make_rollout(MAX_LEN + 1, seed=4)],
        "empty": [Rollout(tokens=[], action_mask=[], rollout_logp=[], versions=[], rewards=[],
                          prompt_id=1)],
        "no_action_tokens": [but(action_mask=np.zeros(10, np.int8))],
        "length_mismatch": [but(rewards=np.zeros(9, np.float32)),
                            but(action_mask=np.ones(11, np.int8))],
        "bad_action_mask": [but(action_mask=bad_mask)],
        "negative_version": [but(versions=neg_version)],
        "nonfinite_reward": [but(rewards=nan_reward)],
        "action_at_position_0": [but(action_mask=first_action)],
        "malformed": [but(tokens=np.zeros((2, 5), np.int32)), but(prompt_id="x"),
                      but(tokens=ok.tokens + 0.5)],
    }


def test_invalid_rollouts_are_rejected_and_counted(server):
    cases = _invalid_rollouts()
    assert set(cases) <= set(REJECT_REASONS)
    with make_writer(server) as writer, RolloutReader(server.address) as reader:
        for reason, rollouts in cases.items():
            for r in rollouts:
                assert writer.write(r, timeout_s=1.0) is False, reason
            assert writer.rejected[reason] == len(rollouts), (reason, writer.rejected)
        assert writer.inserted == 0 and writer.timeouts == 0
        assert sum(writer.rejected.values()) == sum(len(v) for v in cases.values())
        assert reader.queue_size() == 0
        # NaN log-probs on non-action tokens are fine (they are never used).
        r = make_rollout(10, seed=5)
        r.rollout_logp[0] = np.nan
        assert writer.write(r, timeout_s=5.0)
        assert reader.queue_size() == 1
        got = reader.sample(1, timeout_s=5.0)
        assert_same(r, got[0])


def _write_in_child(address: str, n: int) -> None:
    writer = RolloutWriter(address, max_sequence_length=MAX_LEN, vocab_size=VOCAB)
    for i in range(n):
        if not writer.write(make_rollout(5 + 7 * i, seed=100 + i), timeout_s=20.0):
            raise SystemExit(f"write {i} failed: {writer.stats()}")
    writer.close()


def test_writer_in_another_process(server):
    n = 5
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_write_in_child, args=(server.address, n))
    child.start()
    got = []
    with RolloutReader(server.address) as reader:
        deadline = time.monotonic() + 60
        while len(got) < n and time.monotonic() < deadline:
            got.extend(reader.sample(n - len(got), timeout_s=1.0))
    child.join(timeout=30)
    assert child.exitcode == 0
    assert len(got) == n
    for i, r in enumerate(got):
        assert_same(make_rollout(5 + 7 * i, seed=100 + i), r)


def test_server_worker_lifecycle_and_checkpoint(tmp_path, caplog):
    srv = ReplayServer(queue_capacity=4, checkpoint_dir=str(tmp_path / "ckpt"))
    assert srv.address == f"127.0.0.1:{srv.port}"
    thread = threading.Thread(target=srv.run)
    thread.start()
    srv.start()
    sent = [make_rollout(6 + i, seed=i) for i in range(3)]
    with make_writer(srv) as writer:
        for r in sent:
            assert writer.write(r, timeout_s=5.0)
    srv.stop()  # run() writes a final checkpoint, then stops the server
    thread.join(timeout=10)
    assert not thread.is_alive() and not srv.started

    # A different queue_capacity: Reverb keeps the checkpoint's limiter, and says so.
    restored = ReplayServer(queue_capacity=8, checkpoint_dir=str(tmp_path / "ckpt")).start()
    try:
        assert "capacity 4, not queue_capacity=8" in caplog.text
        with RolloutReader(restored.address) as reader, make_writer(restored) as writer:
            assert reader.queue_size() == 3
            assert writer.write(make_rollout(5, seed=50), timeout_s=1.0)
            assert not writer.write(make_rollout(5, seed=51), timeout_s=0.1)  # 4 is the bound
            got = reader.sample(4, timeout_s=5.0, min_items=4)
        for a, b in zip(sent, got):
            assert_same(a, b)
    finally:
        restored._shutdown()


def test_bad_arguments():
    with pytest.raises(ValueError, match="queue_capacity"):
        ReplayServer(queue_capacity=0)
    with pytest.raises(ValueError, match="max_sequence_length"):
        RolloutWriter("127.0.0.1:1", max_sequence_length=0, vocab_size=10)
    with pytest.raises(ValueError, match="host:port"):
        RolloutReader("localhost")
