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
from sao_actor_learner.replay import item
from sao_actor_learner.replay.validation import (REJECT_REASONS, SIGNATURE_BYTES, RolloutSigner,
                                                 RolloutVerifier, check_columns)
from sao_actor_learner.types import SCALAR_COLUMNS, TOKEN_COLUMNS

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def item_columns(rollout):
    """The exact-dtype columns of `rollout` (check_columns' output)."""
    cols, reason = check_columns({n: getattr(rollout, n) for n in TOKEN_COLUMNS + SCALAR_COLUMNS},
                                 VOCAB, MAX_LEN)
    assert reason is None, reason
    return cols


def packed(cols, signer, padded_length=None):
    """The item RolloutWriter would insert for `cols`, signed by `signer` (None: zeros)."""
    return item.pack(cols, padded_length or cols["tokens"].shape[0],
                     signer.sign if signer is not None else None)


def raw_insert(client, flat):
    """Inserts one item with the columns `flat` (a list; [the packed item] when well formed)
    through a raw Reverb TrajectoryWriter that skips the table-signature check: what anyone who
    reaches the port can do."""
    writer = client.trajectory_writer(num_keep_alive_refs=1, validate_items=False)
    try:
        writer.append(list(flat))
        writer.create_item("rollouts", 1.0, [column[-1] for column in writer.history])
        writer.flush(timeout_ms=int(DEADLINE_S * 1000))
    finally:
        writer.close()


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
def test_signer_is_a_keyed_digest_of_the_header_and_every_column():
    signer = RolloutSigner(SECRET)
    cols = item_columns(signed_rollout(12, seed=1, seq=5))
    buf = packed(cols, signer)
    parsed = item.parse(buf)
    assert len(parsed.signature) == SIGNATURE_BYTES
    assert parsed.signature == RolloutSigner(SECRET.hex()).sign(parsed.signed)   # hex ok
    assert signer.verify(parsed.signed, parsed.signature)
    assert not RolloutSigner(OTHER_SECRET).verify(parsed.signed, parsed.signature)
    assert not signer.verify(parsed.signed, parsed.signature[:16])
    assert not signer.verify(parsed.signed, bytes(SIGNATURE_BYTES))
    # Padding is not signed: the same rollout padded further verifies alike.
    longer = item.parse(packed(cols, signer, padded_length=20))
    assert longer.signature == parsed.signature and signer.verify(longer.signed,
                                                                  longer.signature)
    for name in TOKEN_COLUMNS + SCALAR_COLUMNS:   # every column is covered, seq included
        value = np.array(cols[name], copy=True)
        if value.ndim:
            value[-1] = value[-1] + 1
        else:
            value = np.asarray(value + 1, value.dtype)
        changed = item.parse(packed({**cols, name: value}, None))
        assert not signer.verify(changed.signed, parsed.signature), name
    with pytest.raises(ValueError, match="16 bytes"):
        RolloutSigner(b"short")


def test_item_layout_round_trips_and_refuses_what_is_not_an_item():
    cols = item_columns(signed_rollout(9, seed=2, seq=3))
    buf = packed(cols, RolloutSigner(SECRET), padded_length=16)
    assert buf.dtype == np.uint8 and buf.shape == (item.item_bytes(16),)
    parsed = item.parse(buf)
    for name in TOKEN_COLUMNS:
        np.testing.assert_array_equal(parsed.columns[name], cols[name], err_msg=name)
        assert parsed.columns[name].dtype == cols[name].dtype, name
    for name in SCALAR_COLUMNS:   # Python numbers, equal to the columns' values
        assert type(parsed.columns[name]) in (int, float), name
        assert parsed.columns[name] == cols[name].item(), name
    assert parsed.columns["tokens"].base is not None        # a view, not a copy
    for bad in (buf.astype(np.int32), buf[None], buf[:40], np.zeros_like(buf),
                np.concatenate([buf[:4], np.full(4, 255, np.uint8), buf[8:]]),   # length -1
                buf[:item.item_bytes(9) - 1]):                                    # cut short
        with pytest.raises(ValueError):
            item.parse(bad)


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
    base = item_columns(signed_rollout(10, seed=30, seq=50))
    good_item = packed(base, signer)
    rng = np.random.default_rng(0)

    def resigned(**changes):
        """A column changed and the item signed again with the run's secret: only the column
        checks can catch it (they run before the signature)."""
        return [packed({**base, **changes}, signer)]

    def changed_in_transit(offset, value):
        forged = good_item.copy()
        forged[offset] = value
        return [forged]

    out_of_vocab = base["tokens"].copy()
    out_of_vocab[3] = VOCAB
    nan_logp = base["rollout_logp"].copy()
    nan_logp[np.flatnonzero(base["action_mask"])[0]] = np.nan
    signature_at = item.signed_bytes(10)
    long_header = good_item.copy()
    long_header[4:8] = np.frombuffer(np.int32(11).tobytes(), np.uint8)  # claims 11 tokens
    bad = [  # (expected reason, the item's flat columns)
        ("malformed", [np.zeros(0, np.uint8)]),                             # empty
        ("malformed", [good_item, np.zeros(3, np.int32)]),                  # 2 columns
        ("malformed", [good_item.view(np.int8)]),                           # not uint8
        ("malformed", [good_item[None]]),                                   # 2-D
        ("malformed", [good_item[:signature_at]]),                          # cut short
        ("malformed", [long_header]),                                       # length too big
        ("malformed", changed_in_transit(0, ord("X"))),                     # no SAO1 header
        ("token_out_of_range", resigned(tokens=out_of_vocab)),
        ("nonfinite_logp", resigned(rollout_logp=nan_logp)),
        ("bad_signature", [packed(base, None)]),                            # zeros
        ("bad_signature", [np.concatenate([good_item[:signature_at],
                                           rng.integers(0, 256, 32).astype(np.uint8)])]),
        ("bad_signature", changed_in_transit(signature_at - 1 - 10, 0)),   # a reward byte
        ("bad_signature", changed_in_transit(8, 99)),                       # prompt_id
    ]
    assert {reason for reason, _ in bad} <= set(REJECT_REASONS)
    # A signed, well-formed item from a raw client is accepted: the check is of the item, not
    # of who sent it.
    raw_good = [good_item]
    with make_writer(server, signer) as writer:
        # good0, bad0..3, good1, raw_good, bad4..7, good2, ..., good4 last.
        order = []
        pending_bad = list(bad)
        for i, r in enumerate(good):
            assert writer.write_many([r], timeout_s=DEADLINE_S)[0].confirmed
            order.append(("good", r.seq))
            if i == 1:
                raw_insert(client, raw_good)
                order.append(("good", 50))
            if i < len(good) - 1:
                for reason, flat in pending_bad[:4]:
                    raw_insert(client, flat)
                    order.append((reason, None))
                pending_bad = pending_bad[4:]
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
