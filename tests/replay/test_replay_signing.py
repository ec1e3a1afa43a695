"""Signed replay items (replay/validation.py) against a real Reverb server: what an actor's
RolloutWriter signs, the learner's RolloutReader verifies and returns unchanged; anything else
that reaches the unauthenticated port (another run's items, another actor's, unsigned ones,
forgeries, malformed items inserted with a raw Reverb client) is refused with its reason,
counted, and never returned, while the reader keeps serving the good items after it."""
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
RUN = "3f1c0e6a9b2d4c7e8f1a2b3c4d5e6f70"
OTHER_RUN = "a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5"


def actor_signer(actor_id, secret=SECRET, run=RUN):
    """What make_program hands actor `actor_id`: its own key, and the run id."""
    return RolloutSigner(secret, run).for_actor(actor_id)
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


def make_reader(srv, secret, run=RUN):
    verifier = RolloutVerifier(RolloutSigner(secret, run) if secret else None, vocab_size=VOCAB,
                               max_sequence_length=MAX_LEN)
    return RolloutReader(srv.address, verifier=verifier)


def item_columns(rollout):
    """The exact-dtype columns of `rollout` (check_columns' output)."""
    cols, reason = check_columns({n: getattr(rollout, n) for n in TOKEN_COLUMNS + SCALAR_COLUMNS},
                                 VOCAB, MAX_LEN)
    assert reason is None, reason
    return cols


def packed(cols, signer, padded_length=None, run_tag=None):
    """The item RolloutWriter would insert for `cols`, signed by the ActorSigner `signer`
    (None: zeros) and tagged with its run (`run_tag` overrides; None: the signer's, else 0)."""
    if run_tag is None:
        run_tag = signer.run_tag if signer is not None else 0
    return item.pack(cols, padded_length or cols["tokens"].shape[0],
                     signer.sign if signer is not None else None, run_tag=run_tag)


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
    run = RolloutSigner(SECRET, RUN)
    cols = item_columns(signed_rollout(12, seed=1, seq=5))
    actor = int(cols["actor_id"])
    signer = run.for_actor(actor)
    buf = packed(cols, signer)
    parsed = item.parse(buf)
    assert len(parsed.signature) == SIGNATURE_BYTES and parsed.run_tag == run.run_tag != 0
    assert parsed.signature == RolloutSigner(SECRET.hex(), RUN).for_actor(actor).sign(
        parsed.signed)                                                            # hex ok
    assert run.verify(parsed.signed, parsed.signature, actor)
    assert not RolloutSigner(OTHER_SECRET, RUN).verify(parsed.signed, parsed.signature, actor)
    assert not RolloutSigner(SECRET, OTHER_RUN).verify(parsed.signed, parsed.signature, actor)
    assert not run.verify(parsed.signed, parsed.signature, actor + 1)   # another actor's key
    assert not run.verify(parsed.signed, parsed.signature[:16], actor)
    assert not run.verify(parsed.signed, bytes(SIGNATURE_BYTES), actor)
    assert len({run.actor_key(a) for a in range(4)} | {RolloutSigner(SECRET, OTHER_RUN)
                                                         .actor_key(0)}) == 5
    # Padding is not signed: the same rollout padded further verifies alike.
    longer = item.parse(packed(cols, signer, padded_length=20))
    assert longer.signature == parsed.signature and run.verify(longer.signed,
                                                               longer.signature, actor)
    for name in TOKEN_COLUMNS + SCALAR_COLUMNS:   # every column is covered, seq included
        value = np.array(cols[name], copy=True)
        if value.ndim:
            value[-1] = value[-1] + 1
        else:
            value = np.asarray(value + 1, value.dtype)
        changed = item.parse(packed({**cols, name: value}, None, run_tag=run.run_tag))
        assert not run.verify(changed.signed, parsed.signature, actor), name
    retagged = item.parse(packed(cols, None, run_tag=run.run_tag + 1))   # the run tag too
    assert not run.verify(retagged.signed, parsed.signature, actor)
    with pytest.raises(ValueError, match="16 bytes"):
        RolloutSigner(b"short")


def test_item_layout_round_trips_and_refuses_what_is_not_an_item():
    cols = item_columns(signed_rollout(9, seed=2, seq=3))
    buf = packed(cols, actor_signer(int(cols["actor_id"])), padded_length=16)
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
def write_each_as_its_actor(server, rollouts):
    """Each rollout written by its own actor's writer (an actor signs with its key only)."""
    for r in rollouts:
        with make_writer(server, actor_signer(r.actor_id)) as writer:
            assert writer.write_many([r], timeout_s=DEADLINE_S)[0].confirmed


def test_signed_rollout_comes_back_unchanged_and_another_secret_refuses_it(server):
    sent = [signed_rollout(L, seed=i, seq=100 + i) for i, L in enumerate([7, 40, 64, 19])]
    sent[1].actor_id, sent[1].seq = 5, 2 ** 40                   # any key survives
    write_each_as_its_actor(server, sent)
    with make_reader(server, SECRET) as reader:
        got = read(reader, len(sent))
        assert reader.rejected == {}
    for a, b in zip(sent, got):                                  # every column, seq included
        assert_same(a, b)
    assert [r.key for r in got] == [r.key for r in sent]

    # The same items, read by a learner of the same run with another secret: all refused.
    write_each_as_its_actor(server, sent[:2])
    with make_reader(server, OTHER_SECRET) as reader:
        wait_for_rejections(reader, 2)
        assert reader.rejected == {"bad_signature": 2} and reader.sampled == 0
        assert reader.queue_size() == 0                          # sampled, hence removed


def test_an_item_of_another_run_is_refused_and_counted_even_under_the_same_secret(server):
    """A reused $SAO_ROLLOUT_SECRET: the earlier run's items (its run id in their header and
    in their keys) are refused in the new run, and its genuine rollouts with the same keys are
    still trained (not skipped as duplicates of the old ones)."""
    old = [signed_rollout(9, seed=i, seq=i) for i in range(3)]
    for r in old:
        with make_writer(server, actor_signer(r.actor_id, run=OTHER_RUN)) as writer:
            assert writer.write_many([r], timeout_s=DEADLINE_S)[0].confirmed
    new = [signed_rollout(11, seed=10 + i, seq=i) for i in range(3)]   # the same keys
    for r, o in zip(new, old):
        r.actor_id = o.actor_id
    write_each_as_its_actor(server, new)
    with make_reader(server, SECRET) as reader:
        got = read(reader, 3)
        assert reader.rejected == {"other_run": 3}
    assert [r.key for r in got] == [r.key for r in new]
    for a, b in zip(new, got):
        assert_same(a, b)
    # An old item re-tagged with the new run's tag still fails: its key is the old run's.
    client = server.client()
    forged = packed(item_columns(old[0]), actor_signer(old[0].actor_id, run=OTHER_RUN),
                    run_tag=RolloutSigner(SECRET, RUN).run_tag)
    raw_insert(client, [forged])
    with make_reader(server, SECRET) as reader:
        wait_for_rejections(reader, 1)
        assert reader.rejected == {"bad_signature": 1}


def test_an_actor_cannot_sign_as_another_actor(server):
    """Actor 0 holds its own key only: an item it signs claiming actor_id 1 is refused."""
    claims_b = signed_rollout(10, seed=1, seq=7)
    claims_b.actor_id = 1
    with make_writer(server, actor_signer(0)) as writer:          # actor A's key
        assert writer.write_many([claims_b], timeout_s=DEADLINE_S)[0].confirmed
    with make_reader(server, SECRET) as reader:
        wait_for_rejections(reader, 1)
        assert reader.rejected == {"bad_signature": 1} and reader.sampled == 0
    write_each_as_its_actor(server, [claims_b])                   # actor B's own: accepted
    with make_reader(server, SECRET) as reader:
        assert_same(read(reader, 1)[0], claims_b)


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
    signer = actor_signer(0)
    client = server.client()
    good = [signed_rollout(L, seed=10 + i, seq=i) for i, L in enumerate([10, 33, 8, 21, 14])]
    for r in good:
        r.actor_id = 0                                           # the writer's actor
    base_rollout = signed_rollout(10, seed=30, seq=50)
    base_rollout.actor_id = 0
    base = item_columns(base_rollout)
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
        ("other_run", changed_in_transit(item.RUN_TAG_OFFSET, int(          # the run tag
            good_item[item.RUN_TAG_OFFSET] ^ 1))),
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
