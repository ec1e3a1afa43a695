"""The actor's data path (actors/actor.py) end to end: spool, delayed delivery, replay, and the
learner's acknowledgements.

With injected per-episode delays a generated batch waits out its delays in a delivery thread
while the actor generates the next batch, so one slow episode does not hold back the actor.
Every rollout is spooled before it is sent and kept until the learner acknowledges it: what
waits when the actor stops stays in the spool, unsent, and a restarted actor sends it; what the
learner acknowledges is forgotten; a new loss epoch makes the actor send again what it holds.

A real Actor writes through a real RolloutWriter into a real Reverb replay server and keeps a
real on-disk RolloutSpool; the engine (records when each generate call ran), the task (one-turn
episodes, reward 1) and the variable client (version 0, grants what is asked, acknowledges what
the test says) are small fakes. Every wait is on a condition with a generous deadline; the only
timings asserted are lower bounds (a rollout is never sent before its delay has passed) and
orderings the delays are far apart enough for on any machine.
"""
import collections
import os
import threading
import time

import numpy as np
import pytest

pytest.importorskip("reverb")

from sao_actor_learner import core
from sao_actor_learner.actors.actor import Actor
from sao_actor_learner.actors.spool import LEDGER, RolloutSpool, read_ledger
from sao_actor_learner.models import CharTokenizer
from sao_actor_learner.replay import ReplayServer, RolloutReader, RolloutWriter
from sao_actor_learner.variables.client import AckInfo, AdmitResult

TOK = CharTokenizer()
PARAMS = core.SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=(TOK.eos_id,))
BATCH = 4
DEADLINE_S = 60.0   # how long any condition is waited for before the test fails


class TimedEngine(core.Engine):
    """Answers "7<eos>" to every prompt after `busy_s`; logs (start, end, prompt count) per
    call."""

    version = 0

    def __init__(self, busy_s=0.05):
        self.busy_s, self.calls = busy_s, []

    def generate(self, prompts, params):
        t0 = time.monotonic()
        time.sleep(self.busy_s)
        self.calls.append((t0, time.monotonic(), len(prompts)))
        return [core.Generation(tokens=[TOK.token_id("7"), TOK.eos_id], logprobs=[-0.1, -0.2],
                                versions=[0, 0], finish_reason="stop") for _ in prompts]

    def load_weights(self, state_dict, version):
        raise AssertionError("version 0 throughout: no weight load expected")


class OneTurnEnv(core.Environment):
    def step(self, action_tokens):
        return core.StepResult([], 1.0, True, {})


class NumberedTask(core.Task):
    """Prompt k has prompt_id k (1, 2, ...)."""
    name = "numbered"
    tokenizer = TOK
    turn_stop_token_ids = ()

    def __init__(self):
        self.n = 0

    def sample_prompt(self, rng):
        self.n += 1
        return core.Prompt(prompt_id=self.n, token_ids=tuple(TOK.encode("1+6=")), text="1+6=")

    def eval_prompts(self):
        return []

    def make_environment(self, prompt):
        return OneTurnEnv()

    def is_correct(self, prompt, completion_tokens):
        return True


class FakeVariables:
    """A variable client at version 0. Admits every request while `budget` (None: unlimited)
    lasts, then grants nothing; `ack` is what the learner's latest progress report says about
    actor 0 (by default: loss epoch 0, nothing consumed)."""
    version = 0

    def __init__(self, budget=None):
        self.budget = budget
        self.ack = AckInfo(loss_epoch=0, watermark=0, seqs=(), version=0, trained_total=0)
        self.ack_calls = 0
        self._lock = threading.Lock()

    def update(self):
        pass

    def update_and_wait(self):
        pass

    def get_variables(self):
        return 0, None

    def wait_for_version(self, version):
        assert version <= 0, version

    def fetch_version(self, version):
        raise AssertionError("no forced staleness here")

    def admit_details(self, actor_id, count, released=0):
        with self._lock:
            granted = count if self.budget is None else min(count, self.budget)
            if self.budget is not None:
                self.budget -= granted
        return AdmitResult(granted, 0, count, 1 << 20)

    def acknowledged(self, actor_id):
        assert actor_id == 0
        with self._lock:
            self.ack_calls += 1
            return self.ack


class TimedSink(core.RolloutSink):
    """A RolloutWriter that notes (prompt_id, seq, time) of every rollout it sent."""

    def __init__(self, writer):
        self._writer, self.inserts = writer, []

    def check(self, rollout):
        return self._writer.check(rollout)

    def send(self, rollouts, timeout_s):
        sent = self._writer.send(rollouts, timeout_s)
        now = time.monotonic()
        self.inserts.extend((r.prompt_id, r.seq, now) for r, ok in zip(rollouts, sent) if ok)
        return sent

    def close(self):
        self._writer.close()


def scripted_delays(batches):
    """A delay sampler returning the given per-batch delays, then `batches[-1]` for ever."""
    it = iter(batches)
    last = [batches[-1]]

    def sample(n):
        d = next(it, last[0])
        assert len(d) == n, (d, n)
        return np.asarray(d, dtype=np.float64)
    return sample


def wait_until(condition, what, deadline_s=DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def read_replay(address, n):
    """Exactly n rollouts from replay (waits for them), then checks nothing more is there."""
    got = []
    with RolloutReader(address) as reader:
        deadline = time.monotonic() + DEADLINE_S
        while len(got) < n and time.monotonic() < deadline:
            got.extend(reader.sample(n - len(got), timeout_s=1.0))
        assert len(got) == n, (len(got), n)
        assert reader.sample(1, timeout_s=0.3) == [] and reader.queue_size() == 0
    return got


def spool_files(directory):
    return sorted(int(name.split(".")[0]) for name in os.listdir(directory)
                  if name.endswith(".rollout"))


@pytest.fixture()
def replay():
    server = ReplayServer(64).start()
    try:
        yield server
    finally:
        server._shutdown()


@pytest.fixture()
def cleanup():
    things = []
    yield things
    for thing in reversed(things):
        thing.close()


def _actor(replay, spool_dir, delays, cleanup, variables=None, **kwargs):
    sink = TimedSink(RolloutWriter(replay.address, max_sequence_length=32,
                                   vocab_size=TOK.vocab_size))
    spool = RolloutSpool(str(spool_dir))
    cleanup.extend([sink, spool])
    engine = TimedEngine()
    actor = Actor(0, NumberedTask(), engine, variables or FakeVariables(), sink, decode=None,
                  params=PARAMS, spool=spool, actor_batch=BATCH, delay_sampler=delays,
                  **kwargs)
    return actor, engine, sink, spool


def _start(actor):
    errors = []

    def run():
        try:
            actor.run()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def test_actor_generates_the_next_batch_while_earlier_rollouts_wait_for_their_delay(
        replay, tmp_path, cleanup):
    # Batch 0's slowest rollout waits 3 s: batches 1 and 2 (~0.05 s of generation each) are
    # generated long before it is due, however loaded the machine.
    delays = [[3.0, 0.0, 0.4, 0.1], [0.0, 0.3, 0.05, 0.6], [0.2, 0.2, 0.0, 0.1]]
    actor, engine, sink, spool = _actor(replay, tmp_path / "spool", scripted_delays(delays),
                                        cleanup, max_rollouts=12)
    actor.run()   # returns after 3 batches, once all 12 rollouts are delivered
    assert [n for _, _, n in engine.calls] == [BATCH] * 3
    when = {p: t for p, _, t in sink.inserts}
    # Batches 1 and 2 were generated while batch 0's slowest rollout still waited.
    slowest_0 = when[1]
    assert engine.calls[1][0] < slowest_0 and engine.calls[2][0] < slowest_0, \
        (engine.calls, sink.inserts)
    # Every rollout inserted exactly once, each when its delay had passed, and within its
    # batch in ready order (batch k holds prompt ids 4k+1 .. 4k+4, seqs 4k .. 4k+3).
    assert sorted(p for p, _, _ in sink.inserts) == list(range(1, 13))
    assert all(seq == p - 1 for p, seq, _ in sink.inserts), sink.inserts
    for k, (d, (_, gen_end, _)) in enumerate(zip(delays, engine.calls)):
        ids = [4 * k + 1 + i for i in range(BATCH)]
        assert [p for p, _, _ in sink.inserts if p in ids] == \
            [ids[i] for i in np.argsort(d, kind="stable")], (k, sink.inserts)
        for i, p in enumerate(ids):
            assert when[p] >= gen_end + d[i] - 1e-3, (p, when[p] - gen_end, d[i])
    got = read_replay(replay.address, 12)
    assert sorted((r.prompt_id, r.seq) for r in got) == [(p, p - 1) for p in range(1, 13)]
    assert actor.counters["rollouts_inserted"] == 12
    assert actor.counters["rollouts_generated"] == 12
    assert actor.counters["rollouts_resent"] == 0
    assert actor.counters["reward_sum"] == 12.0
    assert actor.counters["injected_delay_s"] == pytest.approx(sum(map(sum, delays)))
    # Nothing acknowledged: all 12 are still held, each sent once, in loss epoch 0.
    assert spool.completed == 12 and spool.sent_once == 12 and spool.held == 12
    ledger = read_ledger(str(tmp_path / "spool"))
    assert ledger["completed"] == set(range(12)) == ledger["puts"] == ledger["held"]
    assert ledger["sent"] == {seq: 0 for seq in range(12)} and ledger["acked"] == set()


def test_stop_returns_promptly_and_leaves_waiting_rollouts_held_in_the_spool(
        replay, tmp_path, cleanup):
    # Batch 0: two quick rollouts, two that wait 600 s; every later rollout waits 600 s. With
    # at most 8 waiting the actor generates batch 1 (6 waiting) and then waits for room.
    delays = scripted_delays([[0.0, 600.0, 0.0, 600.0], [600.0] * BATCH])
    actor, engine, sink, spool = _actor(replay, tmp_path / "spool", delays, cleanup,
                                        max_waiting=2 * BATCH)
    thread, errors = _start(actor)
    wait_until(lambda: len(sink.inserts) >= 2 and len(engine.calls) >= 2,
               "the two quick rollouts and the second batch")
    time.sleep(0.5)   # time for a third batch, were the bound not kept
    assert len(engine.calls) == 2 and sorted(p for p, _, _ in sink.inserts) == [1, 3]
    t = time.monotonic()
    actor.stop()
    thread.join(timeout=DEADLINE_S)
    # Promptly: far sooner than any waiting rollout's delay.
    assert not thread.is_alive() and time.monotonic() - t < 30.0 and not errors, errors
    assert actor.counters["rollouts_generated"] == 8
    assert actor.counters["rollouts_inserted"] == 2
    assert actor.counters["injected_delay_s"] == 0.0   # no 600 s rollout was delivered
    ledger = read_ledger(str(tmp_path / "spool"))
    assert ledger["completed"] == set(range(8)) == ledger["held"]
    assert ledger["sent"] == {0: 0, 2: 0}              # prompts 1 and 3; the rest held, unsent
    assert spool_files(tmp_path / "spool") == list(range(8))
    assert [seq for seq, _ in spool.to_send(0)] == [1, 3, 4, 5, 6, 7]

    # A restarted actor (no delay this time) sends the 8 held rollouts first: the 6 never sent,
    # and once more the 2 its predecessor sent and nobody acknowledged (they may have been
    # in flight: the writer confirms a batch while it sends the next; the learner skips copies).
    restarted, engine2, sink2, spool2 = _actor(replay, tmp_path / "spool", None, cleanup,
                                               max_rollouts=8)
    assert restarted.counters["rollouts_inserted"] == 2
    assert restarted.counters["rollouts_generated"] == 8
    restarted.run()
    assert engine2.calls == []                          # max_rollouts reached: only re-sends
    assert [(p, seq) for p, seq, _ in sink2.inserts] == [(p, p - 1) for p in range(1, 9)]
    assert restarted.counters["rollouts_inserted"] == 8
    assert restarted.counters["rollouts_resent"] == 2
    ledger = read_ledger(str(tmp_path / "spool"))
    assert ledger["sent"] == {seq: 0 for seq in range(8)} and spool2.to_send(0) == []
    got = read_replay(replay.address, 10)
    assert sorted((r.prompt_id, r.seq) for r in got) == sorted(
        [(p, p - 1) for p in range(1, 9)] + [(1, 0), (3, 2)])


def test_acknowledged_rollouts_are_forgotten_and_a_loss_epoch_resends_the_rest_once(
        replay, tmp_path, cleanup):
    directory = tmp_path / "spool"
    variables = FakeVariables(budget=2 * BATCH)   # two batches, then admission grants nothing
    actor, engine, sink, spool = _actor(replay, directory, None, cleanup, variables=variables,
                                        ack_period_s=0.02)
    thread, errors = _start(actor)
    try:
        wait_until(lambda: actor.counters["rollouts_inserted"] == 8, "8 rollouts sent")
        assert spool.held == 8 and spool_files(directory) == list(range(8))

        # The learner consumed seqs 0, 1, 2 (the watermark) and 5: the actor forgets them.
        calls = variables.ack_calls
        variables.ack = AckInfo(loss_epoch=0, watermark=3, seqs=(5,), version=1,
                                trained_total=4)
        wait_until(lambda: actor.counters["rollouts_acknowledged"] == 4, "4 acknowledged")
        assert spool.held == 4 and spool.acknowledged == 4
        assert spool_files(directory) == [3, 4, 6, 7]
        ledger = read_ledger(str(directory))
        assert ledger["acked"] == {0, 1, 2, 5} and ledger["held"] == {3, 4, 6, 7}
        with open(directory / LEDGER) as f:
            ack_lines = [line.split() for line in f if line.startswith("ack ")]
        assert sorted(int(seq) for _, seq in ack_lines) == [0, 1, 2, 5]
        wait_until(lambda: variables.ack_calls > calls + 3, "more acknowledgement polls")
        assert actor.counters["rollouts_resent"] == 0     # same epoch: nothing sent again

        # The learner restarted (loss epoch 1): every held rollout sent in epoch 0 is sent
        # again, exactly once, however many times the actor polls after that.
        variables.ack = AckInfo(loss_epoch=1, watermark=3, seqs=(5,), version=1,
                                trained_total=4)
        wait_until(lambda: actor.counters["rollouts_resent"] == 4, "4 resent")
        calls = variables.ack_calls
        wait_until(lambda: variables.ack_calls > calls + 3, "more acknowledgement polls")
    finally:
        actor.stop()
        thread.join(timeout=DEADLINE_S)
    assert not thread.is_alive() and not errors, errors
    assert engine.calls and sum(n for _, _, n in engine.calls) == 8
    assert actor.counters["rollouts_resent"] == 4
    assert actor.counters["rollouts_inserted"] == 8   # sent at least once: unchanged
    assert actor.counters["rollouts_acknowledged"] == 4
    assert [seq for _, seq, _ in sink.inserts] == list(range(8)) + [3, 4, 6, 7]
    # Replay got every rollout once, and the held ones a second time: 12 items.
    got = read_replay(replay.address, 12)
    count = collections.Counter(r.seq for r in got)
    assert count == {0: 1, 1: 1, 2: 1, 5: 1, 3: 2, 4: 2, 6: 2, 7: 2}, count
    assert all(r.prompt_id == r.seq + 1 for r in got)
    ledger = read_ledger(str(directory))
    assert ledger["sent"] == {0: 0, 1: 0, 2: 0, 5: 0, 3: 1, 4: 1, 6: 1, 7: 1}
    assert spool.to_send(1) == [] and [seq for seq, _ in spool.to_send(2)] == [3, 4, 6, 7]


def test_max_waiting_below_one_batch_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="max_waiting=3"):
        Actor(0, NumberedTask(), TimedEngine(), FakeVariables(), sink=None, decode=None,
              params=PARAMS, spool=RolloutSpool(str(tmp_path / "spool")), actor_batch=BATCH,
              delay_sampler=lambda n: np.zeros(n), max_waiting=3)
