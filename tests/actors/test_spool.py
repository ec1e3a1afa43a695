"""The actor's spool (actors/spool.py): sequence numbers, the ledger and its counters, what is
sent again in which loss epoch, the admission slots owed back, and a restart after each crash
point the module docstring names (recovering as it says)."""
import os
import threading

import numpy as np
import pytest

from sao_actor_learner.actors.spool import LEDGER, RolloutSpool, read_ledger, spool_dir
from sao_actor_learner.types import Rollout


def rollout(k: int) -> Rollout:
    """A small rollout told apart by k (prompt_id k, tokens k..k+4)."""
    mask = np.array([0, 0, 1, 1, 1], np.int8)
    return Rollout(tokens=np.arange(k, k + 5), action_mask=mask,
                   rollout_logp=np.where(mask == 1, -0.5, 0.0), versions=np.where(mask, 3, -1),
                   rewards=[0, 0, 0, 0, float(k)], prompt_id=k, actor_id=2)


def files(directory):
    return sorted(os.listdir(directory))


def spooled(seq: int) -> str:
    return f"{seq:012d}.rollout"


def ledger_lines(directory):
    with open(os.path.join(directory, LEDGER)) as f:
        return [line.rstrip("\n") for line in f]


def rewrite_ledger(directory, keep):
    """The ledger as a crash would have left it: only the lines `keep(line)` accepts."""
    lines = [line for line in ledger_lines(directory) if keep(line)]
    with open(os.path.join(directory, LEDGER), "w") as f:
        f.write("".join(line + "\n" for line in lines))


@pytest.fixture()
def directory(tmp_path):
    return str(tmp_path / "spool" / "actor_2")


def test_spool_dir():
    assert spool_dir("/runs/x", 3) == os.path.join("/runs/x", "spool", "actor_3")


def test_put_sent_acknowledge_round_trip(directory):
    spool = RolloutSpool(directory)
    assert (spool.completed, spool.sent_once, spool.acknowledged, spool.held) == (0, 0, 0, 0)
    rollouts = [rollout(k) for k in range(5)]
    assert [spool.put(r) for r in rollouts] == [0, 1, 2, 3, 4]
    assert [r.seq for r in rollouts] == [0, 1, 2, 3, 4]          # put sets rollout.seq
    assert [r.key for r in rollouts] == [(2, s) for s in range(5)]
    assert files(directory) == sorted([LEDGER] + [spooled(s) for s in range(5)])
    assert (spool.completed, spool.sent_once, spool.held) == (5, 0, 5)

    assert spool.sent([0, 1, 2], epoch=0) == 3                   # first time: all three
    assert spool.sent([1, 2, 3], epoch=0) == 1                   # only 3 is new
    assert spool.sent([], epoch=0) == 0
    assert spool.sent_once == 4

    consumed = {0, 2, 9}                                         # 9 was never held
    assert spool.acknowledge(lambda s: s in consumed) == 2
    assert spool.acknowledge(lambda s: s in consumed) == 0       # already forgotten
    assert (spool.completed, spool.sent_once, spool.acknowledged, spool.held) == (5, 4, 2, 3)
    assert files(directory) == sorted([LEDGER] + [spooled(s) for s in (1, 3, 4)])

    loaded = spool.load(3)
    assert loaded.seq == 3 and loaded.prompt_id == 3
    np.testing.assert_array_equal(loaded.tokens, rollouts[3].tokens)
    assert loaded.rewards.dtype == np.float32 and loaded.rewards[-1] == 3.0

    ledger = read_ledger(directory)
    assert ledger["completed"] == {0, 1, 2, 3, 4} == ledger["puts"]
    assert ledger["sent"] == {0: 0, 1: 0, 2: 0, 3: 0}
    assert ledger["acked"] == {0, 2} and ledger["held"] == {1, 3, 4}
    assert ledger["refused"] == {} and ledger["admitted"] == ledger["released"] == 0
    assert ledger_lines(directory) == [
        "put 0", "put 1", "put 2", "put 3", "put 4", "sent 0 0", "sent 1 0", "sent 2 0",
        "sent 1 0", "sent 2 0", "sent 3 0", "ack 0", "ack 2"]
    spool.close()

    # A clean restart finds the same state and goes on numbering after the last seq.
    again = RolloutSpool(directory)
    assert (again.completed, again.sent_once, again.acknowledged, again.held) == (5, 4, 2, 3)
    # 4 was never sent; 1 and 3 were sent by the previous incarnation, not acknowledged.
    assert [s for s, _ in again.to_send(0)] == [1, 3, 4]
    assert again.put(rollout(5)) == 5
    again.close()


def test_to_send_lists_never_sent_and_sent_in_an_earlier_epoch(directory):
    spool = RolloutSpool(directory)
    for k in range(5):
        spool.put(rollout(10 + k))
    spool.sent([0, 1], epoch=0)
    spool.sent([2], epoch=1)
    spool.sent([4], epoch=3)
    assert [s for s, _ in spool.to_send(0)] == [3]                  # never sent
    assert [s for s, _ in spool.to_send(1)] == [0, 1, 3]            # + sent in epoch 0
    assert [s for s, _ in spool.to_send(2)] == [0, 1, 2, 3]
    assert [s for s, _ in spool.to_send(4)] == [0, 1, 2, 3, 4]
    got = dict(spool.to_send(4))
    assert all(r.seq == s and r.prompt_id == 10 + s for s, r in got.items())
    # Sent again in epoch 4: nothing is left to send in it, and it counted no first sends.
    assert spool.sent([0, 1, 2, 3, 4], epoch=4) == 1 and spool.sent_once == 5
    assert spool.to_send(4) == []
    spool.acknowledge(lambda s: s in (0, 1))
    assert [s for s, _ in spool.to_send(5)] == [2, 3, 4]            # acknowledged: never again
    # An unreadable file is logged and skipped, not sent, and kept.
    with open(os.path.join(directory, spooled(3)), "wb") as f:
        f.write(b"not a pickle")
    assert [s for s, _ in spool.to_send(5)] == [2, 4] and spool.held == 3
    assert spooled(3) in files(directory)
    spool.close()


def test_restart_after_crash_before_the_rename_drops_the_temporary_file(directory):
    spool = RolloutSpool(directory)
    spool.put(rollout(0))
    spool.put(rollout(1))
    spool.close()
    with open(os.path.join(directory, spooled(2) + ".tmp"), "wb") as f:   # died while writing 2
        f.write(b"half a pickle")
    assert read_ledger(directory)["completed"] == {0, 1}
    spool = RolloutSpool(directory)
    assert files(directory) == sorted([LEDGER, spooled(0), spooled(1)])      # the tmp file is gone
    assert spool.completed == 2 and spool.held == 2
    assert [s for s, _ in spool.to_send(0)] == [0, 1]
    assert spool.put(rollout(2)) == 2                                # 2 was never completed
    spool.close()


def test_restart_after_the_put_line_was_lost_adds_it(directory):
    spool = RolloutSpool(directory)
    for k in range(3):
        spool.put(rollout(k))
    spool.close()
    rewrite_ledger(directory, lambda line: line != "put 2")  # died between rename and "put"
    state = read_ledger(directory)
    assert state["puts"] == {0, 1} and state["completed"] == {0, 1, 2}
    spool = RolloutSpool(directory)
    assert [line for line in ledger_lines(directory) if line.startswith("put")] == [
        "put 0", "put 1", "put 2"]          # the restart's compaction added it
    assert spool.completed == 3 and spool.held == 3
    assert [s for s, _ in spool.to_send(0)] == [0, 1, 2]            # never sent: sent now
    assert spool.put(rollout(3)) == 3
    spool.close()
    assert read_ledger(directory)["puts"] == {0, 1, 2, 3}


def test_restart_after_the_sent_line_was_lost_sends_again(directory):
    spool = RolloutSpool(directory)
    for k in range(4):
        spool.put(rollout(k))
    spool.sent([0, 1], epoch=0)
    spool.sent([2, 3], epoch=0)
    spool.close()
    # Died after handing 2 and 3 to replay, before their "sent" lines (one write) were kept.
    rewrite_ledger(directory, lambda line: line not in ("sent 2 0", "sent 3 0"))
    spool = RolloutSpool(directory)
    assert spool.sent_once == 2 and spool.held == 4
    # 2 and 3 were never recorded as sent; 0 and 1 were, by the previous incarnation, and are
    # not acknowledged: all go (again; the learner skips copies that did arrive).
    assert [s for s, _ in spool.to_send(0)] == [0, 1, 2, 3]
    assert spool.sent([0, 1, 2, 3], epoch=0) == 2 and spool.sent_once == 4
    assert spool.to_send(0) == []
    spool.close()


def test_restart_sends_again_what_the_dead_incarnation_sent_and_nobody_acknowledged(directory):
    """The writer confirms a batch while it sends the next (replay/writer.py), so the last batch
    a killed actor sent may never have reached replay: its successor sends every held rollout
    its predecessors sent, once, but never an acknowledged one."""
    spool = RolloutSpool(directory)
    for k in range(5):
        spool.put(rollout(k))
    spool.sent([0, 1, 2], epoch=1)
    spool.sent([3], epoch=2)
    spool.acknowledge(lambda s: s == 1)
    assert [s for s, _ in spool.to_send(2)] == [0, 2, 4]    # 0, 2 sent in epoch 1; 4 never
    spool.close()                                     # SIGKILL: nothing more was written
    spool = RolloutSpool(directory)
    assert [s for s, _ in spool.to_send(0)] == [0, 2, 3, 4]   # 4 was never sent; 1 was acked
    assert spool.sent([0, 2, 3, 4], epoch=2) == 1 and spool.sent_once == 5
    assert spool.to_send(2) == []                     # once: not again in the same epoch
    assert [s for s, _ in spool.to_send(3)] == [0, 2, 3, 4]   # a new loss epoch: all again
    spool.close()
    spool = RolloutSpool(directory)                   # and again after the next restart
    assert [s for s, _ in spool.to_send(0)] == [0, 2, 3, 4]
    spool.close()


def test_restart_after_an_acknowledged_file_outlived_the_crash_deletes_it(directory):
    spool = RolloutSpool(directory)
    for k in range(3):
        spool.put(rollout(k))
    spool.sent([0, 1, 2], epoch=0)
    with open(os.path.join(directory, spooled(1)), "rb") as f:
        kept = f.read()
    assert spool.acknowledge(lambda s: s == 1) == 1
    spool.close()
    with open(os.path.join(directory, spooled(1)), "wb") as f:   # died between "ack" and the delete
        f.write(kept)
    assert read_ledger(directory)["held"] == {0, 2}          # the ledger already says acked
    spool = RolloutSpool(directory)
    assert files(directory) == sorted([LEDGER, spooled(0), spooled(2)])
    assert spool.held == 2 and spool.acknowledged == 1 and spool.completed == 3
    assert [s for s, _ in spool.to_send(1)] == [0, 2]        # never 1 again, in any epoch
    spool.close()


def test_restart_numbers_after_acknowledged_seqs_and_ignores_a_torn_line(directory):
    spool = RolloutSpool(directory)
    for k in range(3):
        spool.put(rollout(k))
    spool.sent([0, 1, 2], epoch=2)
    spool.acknowledge(lambda s: True)
    spool.close()
    assert files(directory) == [LEDGER]
    with open(os.path.join(directory, LEDGER), "a") as f:
        f.write("sen")                                       # a torn last line
    spool = RolloutSpool(directory)
    assert (spool.completed, spool.sent_once, spool.acknowledged, spool.held) == (3, 3, 3, 0)
    assert spool.put(rollout(3)) == 3                        # seqs are never reused
    spool.close()


def test_owed_releases(directory):
    spool = RolloutSpool(directory)
    spool.asking(10)
    spool.admitted(10)
    for k in range(6):
        spool.put(rollout(k))
    spool.refuse("too_long")
    spool.released(2)
    spool.released(0)                                        # nothing returned: no line
    # 10 admitted - 6 spooled - 2 returned: the refused one and 3 never generated, minus 2.
    assert spool.owed_releases() == 2
    assert spool.refused == {"too_long": 1}
    spool.close()
    state = read_ledger(directory)
    assert state["admitted"] == 10 and state["released"] == 2
    assert state["refused"] == {"too_long": 1}
    assert [line for line in ledger_lines(directory) if not line.startswith("put")] == [
        "ask 10", "adm 10", "rej 0 too_long", "rel 2"]

    spool = RolloutSpool(directory)                          # a restart owes the same
    assert spool.owed_releases() == 2 and spool.refused == {"too_long": 1}
    spool.asking(4)                                          # then dies before the answer:
    spool.close()
    spool = RolloutSpool(directory)                          # the ask counts as granted
    assert spool.owed_releases() == 6
    spool.admitted(0)                                        # (had the answer been kept: 0)
    spool.released(6)
    assert spool.owed_releases() == 0
    spool.close()
    state = read_ledger(directory)
    assert state["admitted"] == 10 and state["released"] == 8     # the answered ask: 0
    spool = RolloutSpool(directory)
    assert spool.owed_releases() == 0
    spool.close()


def test_concurrent_puts_get_unique_seqs(directory):
    spool = RolloutSpool(directory)
    per_thread, seqs, errors = 50, [], []
    lock = threading.Lock()
    start = threading.Barrier(4)

    def put_many(t):
        try:
            start.wait(timeout=60)
            mine = [spool.put(rollout(1000 * t + k)) for k in range(per_thread)]
            with lock:
                seqs.extend(mine)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=put_many, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and not any(thread.is_alive() for thread in threads), errors
    n = 4 * per_thread
    assert sorted(seqs) == list(range(n))
    assert spool.completed == n and spool.held == n
    state = read_ledger(directory)
    assert state["puts"] == set(range(n)) == state["held"]
    assert sum(1 for line in ledger_lines(directory) if line.startswith("put ")) == n
    # Every file holds the rollout its seq names (no two threads wrote one file).
    prompt_of = {}
    for seq in range(n):
        r = spool.load(seq)
        assert r.seq == seq
        prompt_of[seq] = r.prompt_id
    assert len(set(prompt_of.values())) == n
    spool.close()
