"""Signed replay items (replay/validation.py) against a real Reverb server: what an actor's
RolloutWriter signs, the learner's RolloutReader verifies and returns unchanged; anything else
that reaches the unauthenticated port (another run's items, unsigned ones, forgeries, malformed
items inserted with a raw Reverb client) is refused with its reason, counted, and never
returned, while the reader keeps serving the good items after it."""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

pytest.importorskip("reverb")

from sao_actor_learner.replay import ReplayServer, RolloutReader, RolloutWriter
from sao_actor_learner.replay.tables import FLAT_COLUMN_ORDER, LENGTH_COLUMN, SIGNATURE_COLUMN
from sao_actor_learner.replay.validation import (REJECT_REASONS, SIGNATURE_BYTES, RolloutSigner,
                                                 RolloutVerifier, check_columns)
from sao_actor_learner.types import SCALAR_COLUMNS, TOKEN_COLUMNS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_replay import MAX_LEN, VOCAB, assert_same, make_rollout  # noqa: E402

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(100, 132))
DEADLINE_S = 60.0


@pytest.fixture
def server():
    srv = ReplayServer(queue_capacity=32).start()
    yield srv
    srv._shutdown()


def signed_rollout(length, seed, seq):
    r = make_rollout(length, seed=seed)
    r.seq = seq
    return r


def make_writer(srv, signer):
    return RolloutWriter(srv.address, max_sequence_length=MAX_LEN, vocab_size=VOCAB,
                         signer=signer)


def make_reader(srv, secret):
    verifier = RolloutVerifier(RolloutSigner(secret) if secret else None, vocab_size=VOCAB,
                               max_sequence_length=MAX_LEN)
    return RolloutReader(srv.address, verifier=verifier)


def item_columns(rollout, signer):
    """The columns of the item RolloutWriter would insert for `rollout` (unpadded), as a dict:
    exact dtypes, the true length and the signature under `signer`."""
    cols, reason = check_columns({n: getattr(rollout, n) for n in TOKEN_COLUMNS + SCALAR_COLUMNS},
                                 VOCAB, MAX_LEN)
    assert reason is None, reason
    cols[LENGTH_COLUMN] = np.asarray(rollout.length, np.int32)
    cols[SIGNATURE_COLUMN] = signer.signature(cols)
    return cols


def raw_insert(client, flat):
    """Inserts one item with the columns `flat` (a list, in FLAT_COLUMN_ORDER when well formed)
    through a raw Reverb TrajectoryWriter that skips the table-signature check: what anyone who
    reaches the port can do."""
    writer = client.trajectory_writer(num_keep_alive_refs=1, validate_items=False)
    try:
        writer.append(list(flat))
        writer.create_item("rollouts", 1.0, [column[-1] for column in writer.history])
        writer.flush(timeout_ms=int(DEADLINE_S * 1000))
    finally:
        writer.close()


def flat_of(cols, **changes):
    cols = {**cols, **changes}
    return [cols[name] for name in FLAT_COLUMN_ORDER]


def read(reader, n):
    """Exactly n accepted rollouts (waits for them), oldest first."""
    got, deadline = [], time.monotonic() + DEADLINE_S
    while len(got) < n and time.monotonic() < deadline:
        got.extend(reader.sample(n - len(got), timeout_s=1.0))
    assert len(got) == n, (len(got), n, reader.rejected)
    return got


def wait_for_rejections(reader, total):
    """Samples (returning nothing) until `total` items were refused."""
    deadline = time.monotonic() + DEADLINE_S
    while sum(reader.rejected.values()) < total:
        assert time.monotonic() < deadline, reader.rejected
        assert reader.sample(1, timeout_s=0.2) == []


# --- the signer and verifier alone ----------------------------------------------------------------
def test_signer_is_a_keyed_digest_of_every_column():
    signer = RolloutSigner(SECRET)
    cols = item_columns(signed_rollout(12, seed=1, seq=5), signer)
    sig = signer.signature(cols)
    assert sig.dtype == np.uint8 and sig.shape == (SIGNATURE_BYTES,)
    np.testing.assert_array_equal(sig, RolloutSigner(SECRET.hex()).signature(cols))  # hex ok
    assert signer.verify(cols, sig)
    assert not RolloutSigner(OTHER_SECRET).verify(cols, sig)
    assert not signer.verify(cols, sig[:16]) and not signer.verify(cols, sig.astype(np.int32))
    assert not signer.verify(cols, np.zeros(SIGNATURE_BYTES, np.uint8))
    for name in TOKEN_COLUMNS + SCALAR_COLUMNS:   # every column is covered, seq included
        changed = dict(cols)
        value = np.array(cols[name], copy=True)
        if value.ndim:
            value[-1] = value[-1] + 1
        else:
            value = np.asarray(value + 1, value.dtype)
        changed[name] = value
        assert not signer.verify(changed, sig), name
    with pytest.raises(ValueError, match="16 bytes"):
        RolloutSigner(b"short")


# --- through replay -------------------------------------------------------------------------------
def test_signed_rollout_comes_back_unchanged_and_another_secret_refuses_it(server):
    sent = [signed_rollout(L, seed=i, seq=100 + i) for i, L in enumerate([7, 40, 64, 19])]
    sent[1].actor_id, sent[1].seq = 5, 2 ** 40                   # any key survives
    with make_writer(server, RolloutSigner(SECRET)) as writer:
        assert all(r.confirmed for r in writer.write_many(sent, timeout_s=DEADLINE_S))
        with make_reader(server, SECRET) as reader:
            got = read(reader, len(sent))
            assert reader.rejected == {}
        for a, b in zip(sent, got):                              # every column, seq included
            assert_same(a, b)
        assert [r.key for r in got] == [r.key for r in sent]

        # The same items, read by a learner of another run (another secret): all refused.
        assert all(r.confirmed for r in writer.write_many(sent[:2], timeout_s=DEADLINE_S))
    with make_reader(server, OTHER_SECRET) as reader:
        wait_for_rejections(reader, 2)
        assert reader.rejected == {"bad_signature": 2} and reader.sampled == 0
        assert reader.queue_size() == 0                          # sampled, hence removed


def test_unsigned_items_are_refused_by_a_checking_reader_and_read_by_a_trusting_one(server):
    sent = [signed_rollout(9, seed=3, seq=1), signed_rollout(11, seed=4, seq=2)]
    with make_writer(server, None) as writer:                    # no signer: zero signatures
        assert writer.write_many(sent[:1], timeout_s=DEADLINE_S)[0].confirmed
        with make_reader(server, SECRET) as reader:
            wait_for_rejections(reader, 1)
            assert reader.rejected == {"bad_signature": 1} and reader.queue_size() == 0
        assert writer.write_many(sent[1:], timeout_s=DEADLINE_S)[0].confirmed
        with make_reader(server, None) as trusting:               # no verifier: accepted
            assert_same(read(trusting, 1)[0], sent[1])


def test_forged_and_malformed_items_are_refused_and_counted(server):
    signer = RolloutSigner(SECRET)
    client = server.client()
    good = [signed_rollout(L, seed=10 + i, seq=i) for i, L in enumerate([10, 33, 8, 21, 14])]
    base = item_columns(signed_rollout(10, seed=30, seq=50), signer)
    rng = np.random.default_rng(0)

    def resigned(**changes):
        """A column changed and the item signed again with the run's secret: only the column
        checks can catch it (they run before the signature)."""
        cols = {**base, **changes}
        cols[SIGNATURE_COLUMN] = signer.signature({n: cols[n] for n in signer.ORDER})
        return [cols[name] for name in FLAT_COLUMN_ORDER]

    out_of_vocab = base["tokens"].copy()
    out_of_vocab[3] = VOCAB
    nan_logp = base["rollout_logp"].copy()
    nan_logp[np.flatnonzero(base["action_mask"])[0]] = np.nan
    tampered_rewards = base["rewards"].copy()
    tampered_rewards[-1] += 1.0
    bad = [  # (expected reason, the item's flat columns)
        ("malformed", flat_of(base)[:-1]),                                 # 13 columns
        ("malformed", flat_of(base) + [np.zeros(3, np.int32)]),            # 15 columns
        ("malformed", flat_of(base, rewards=base["rewards"][:6])),        # a short column
        ("malformed", flat_of(base, tokens=base["tokens"][None])),        # 2-D tokens
        ("token_out_of_range", resigned(tokens=out_of_vocab)),
        ("nonfinite_logp", resigned(rollout_logp=nan_logp)),
        ("bad_signature", flat_of(base, signature=np.zeros(SIGNATURE_BYTES, np.uint8))),
        ("bad_signature", flat_of(base, signature=rng.integers(0, 256, SIGNATURE_BYTES)
                                  .astype(np.uint8))),
        ("bad_signature", flat_of(base, signature=base[SIGNATURE_COLUMN][:16])),
        ("bad_signature", flat_of(base, rewards=tampered_rewards)),         # changed in transit
    ]
    assert {reason for reason, _ in bad} <= set(REJECT_REASONS)
    # A signed, well-formed item from a raw client is accepted: the check is of the item, not
    # of who sent it.
    raw_good = [base[name] for name in FLAT_COLUMN_ORDER]
    with make_writer(server, signer) as writer:
        # good0, bad0, bad1, good1, bad2, bad3, raw_good, bad4, bad5, good2, ... good4 last.
        order = []
        pending_bad = list(bad)
        for i, r in enumerate(good):
            assert writer.write_many([r], timeout_s=DEADLINE_S)[0].confirmed
            order.append(("good", r.seq))
            if i == 1:
                raw_insert(client, raw_good)
                order.append(("good", 50))
            if i < len(good) - 1:
                for reason, flat in pending_bad[:3]:
                    raw_insert(client, flat)
                    order.append((reason, None))
                pending_bad = pending_bad[3:]
        assert not pending_bad and order[-1] == ("good", good[-1].seq)
        with make_reader(server, SECRET) as reader:
            assert reader.queue_size() == len(order)             # Reverb took them all
            got = read(reader, len(good) + 1)
            expected = {}
            for reason, _ in bad:
                expected[reason] = expected.get(reason, 0) + 1
            assert reader.rejected == expected
            assert reader.queue_size() == 0 and reader.sampled == len(good) + 1
    assert [r.seq for r in got] == [seq for kind, seq in order if kind == "good"]
    for a, b in zip(good, [g for g in got if g.seq != 50]):
        assert_same(a, b)
    [from_raw] = [g for g in got if g.seq == 50]
    for name in TOKEN_COLUMNS + SCALAR_COLUMNS:
        np.testing.assert_array_equal(getattr(from_raw, name), base[name], err_msg=name)
