"""Admission control and the progress report as pure objects, against slow obvious re-statements."""
import json
import random

import pytest

from sao_actor_learner.variables.admission import MAX_TRACKED_ACTORS, OTHER_ACTORS, Admission
from sao_actor_learner.variables.progress import (MAX_ACKS, MAX_SEQS, ActorAcks, Progress,
                                                  make_progress)


class SlowAdmission:
    """AReaL's rule, one rollout at a time: an actor may start a rollout while the rollouts
    started (it included) number at most (v + eta + 1) * B + dropped, v the newest published
    version (0 before any) and dropped the credit. Released slots are forgotten starts."""

    def __init__(self, batch_size, max_staleness, enabled):
        self.b, self.eta, self.enabled = batch_size, max_staleness, enabled
        self.started = []          # one entry per started rollout still counted: its actor
        self.granted_to = {}
        self.dropped = 0

    def admit(self, actor, count, released, version):
        for _ in range(released):
            if self.started:
                self.started.pop()
        bound = (max(version, 0) + self.eta + 1) * self.b + self.dropped
        granted = 0
        for _ in range(count):
            if not self.enabled or len(self.started) + 1 <= bound:
                self.started.append(actor)
                granted += 1
        self.granted_to[actor] = self.granted_to.get(actor, 0) + granted
        return granted, len(self.started), bound


@pytest.mark.parametrize("seed", range(6))
def test_admit_matches_the_rule_stated_one_rollout_at_a_time(seed):
    rng = random.Random(seed)
    b, eta, enabled = rng.randint(1, 5), rng.randint(0, 3), seed != 5
    fast, slow = Admission(b, eta, enabled), SlowAdmission(b, eta, enabled)
    version = -1
    for step in range(400):
        roll = rng.random()
        if roll < 0.1:
            version += 1
        elif roll < 0.2:
            dropped = slow.dropped + rng.randint(-2, 4)       # may go down: ignored
            changed = fast.add_credit(max(dropped, 0))
            assert changed == (dropped > slow.dropped)
            slow.dropped = max(slow.dropped, dropped)
        elif roll < 0.25:                                      # a restart, from the state
            fast = Admission.from_state(json.loads(json.dumps(fast.state())), b, eta, enabled)
        actor = f"actor-{rng.randint(0, 3)}"
        count, released = rng.randint(1, 6), rng.choice([0, 0, 0, 1, 3])
        got = fast.admit(actor, count, released, version)
        want = slow.admit(actor, count, released, version)
        assert (got.granted, got.started_total, got.capacity) == want, step
        assert fast.capacity(version) == want[2] and fast.credit == slow.dropped
        assert fast.started_by_actor == {a: n for a, n in slow.granted_to.items()}
    assert sum(fast.started_by_actor.values()) - fast.released_total == fast.started_total


def test_capacity_released_and_argument_checks():
    a = Admission(batch_size=3, max_staleness=1)
    assert a.capacity(-1) == a.capacity(0) == 6 and a.capacity(2) == 12
    assert a.admit("a", 4, 0, -1).granted == 4
    assert a.admit("b", 4, 0, -1).granted == 2
    decision = a.admit("a", 5, 3, 0)                     # 3 slots back, then 3 granted
    assert (decision.granted, decision.started_total, decision.capacity) == (3, 6, 6)
    assert a.admit("a", 1, 99, 0).started_total == 1     # released clamps to what was started
    assert a.released_total == 3 + 6
    for bad in ({"count": 0}, {"released": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            a.admit("a", **{"count": 1, "released": 0, "version": 0, **bad})
    with pytest.raises(ValueError, match="dropped_total"):
        a.add_credit(-1)
    for kwargs in ({"batch_size": 0, "max_staleness": 0}, {"batch_size": 1, "max_staleness": -1}):
        with pytest.raises(ValueError):
            Admission(**kwargs)


def test_state_round_trip_and_malformed_states():
    a = Admission(2, 0)
    a.admit("x", 2, 0, 0)
    a.add_credit(5)
    a.admit("y", 9, 1, 3)
    b = Admission.from_state(a.state(), 2, 0)
    assert b.state() == a.state() and b.capacity(3) == a.capacity(3)
    assert b.admit("x", 1, 0, 3) == a.admit("x", 1, 0, 3)
    for bad in ({}, {"started_total": 1}, {**a.state(), "credit": -1},
                {**a.state(), "started_by_actor": {"x": "many"}}, [1, 2]):
        with pytest.raises(ValueError, match="admission state"):
            Admission.from_state(bad, 2, 0)


def test_many_actors_share_one_bucket():
    a = Admission(1, 0, enabled=False)
    for i in range(MAX_TRACKED_ACTORS + 10):
        a.admit(str(i), 1, 0, 0)
    assert len(a.started_by_actor) == MAX_TRACKED_ACTORS + 1
    assert a.started_by_actor[OTHER_ACTORS] == 10 and a.started_total == MAX_TRACKED_ACTORS + 10


# ------------------------------------------------------------------------------ progress
def test_progress_is_normalised_and_merges_forward():
    p = make_progress(3, 2, 40, 0, {7: (5, [9, 1, 6, 6, 4]), 2: (0, ())})
    assert p.acks == {2: ActorAcks(0, ()), 7: ActorAcks(5, (6, 9))}   # below watermark: dropped
    assert [s for s in range(12) if p.acked(7).consumed(s)] == [0, 1, 2, 3, 4, 6, 9]
    assert p.acked(99) == ActorAcks() and not p.acked(99).consumed(0)
    assert Progress.from_state(json.loads(json.dumps(p.to_state()))) == p
    assert p.merged(make_progress(3, 2, 40, 0, {2: (0, []), 7: (5, [9, 6])})) == p  # identical
    later = p.merged(make_progress(4, 2, 41, 1, {7: (8, [10])}))
    assert (later.version, later.trained_total, later.loss_epoch) == (4, 41, 1)
    assert later.acked(7) == ActorAcks(8, (9, 10)) and later.acked(2) == ActorAcks(0, ())
    base = {"version": 3, "dropped_total": 2, "trained_total": 40, "loss_epoch": 1}
    stored = make_progress(**base, acks={1: (4, [6])})
    for field in base:                                                # any total backwards
        behind = make_progress(**{**base, field: base[field] - 1}, acks={1: (2, [])})
        assert stored.merged(behind) == stored


def test_progress_limits():
    with pytest.raises(ValueError, match="acks"):
        make_progress(0, 0, 0, 0, {i: (0, ()) for i in range(MAX_ACKS + 1)})
    with pytest.raises(ValueError, match="seqs"):
        make_progress(0, 0, 0, 0, {0: (0, range(MAX_SEQS)), 1: (0, [1])})
    assert len(make_progress(0, 0, 0, 0, {0: (0, range(MAX_SEQS))}).acks[0].seqs) == MAX_SEQS
    for kwargs in ({"version": -2}, {"dropped_total": -1}, {"trained_total": -1},
                   {"loss_epoch": -1}, {"acks": {-1: (0, ())}}, {"acks": {1: (-1, ())}}):
        with pytest.raises(ValueError):
            make_progress(**{"version": 0, "dropped_total": 0, "trained_total": 0,
                             "loss_epoch": 0, "acks": {}, **kwargs})
    with pytest.raises(ValueError, match="progress state"):
        Progress.from_state({"version": 1})
