"""Surviving faults: restarts with backoff, nodes.json on restart, replay checkpoints, actor
spools, learner resume from checkpoint + journal, and a whole SAO run that loses an actor and its
learner to `kill -9`. Real processes, real Reverb, real gRPC, the real (tiny) warm-start model.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_fixtures as ff  # noqa: E402
import launch_fixtures as fx  # noqa: E402

from sao_actor_learner import core  # noqa: E402
from sao_actor_learner import launch as lp  # noqa: E402
from sao_actor_learner.actors.spool import RolloutSpool, read_ledger  # noqa: E402
from sao_actor_learner.builder import (assemble_learner, make_program,  # noqa: E402
                                      make_replay_server, setup_process)
from sao_actor_learner.config import SAOConfig  # noqa: E402
from sao_actor_learner.learner.journal import ResumePoint  # noqa: E402
from sao_actor_learner.models import checkpoint as ckpt  # noqa: E402
from sao_actor_learner.models.value import ValueModel  # noqa: E402
from sao_actor_learner.observers import read_metrics  # noqa: E402
from sao_actor_learner.run import run_program  # noqa: E402
from sao_actor_learner.types import Rollout  # noqa: E402
from sao_actor_learner.variables import VariablePublisher, VariableServer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------------ restart policies
def test_restart_policy_backoff_and_validation():
    policy = lp.RestartPolicy(max_restarts=5, backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="max_restarts=-1"):
        lp.RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="max_backoff_s"):
        lp.RestartPolicy(backoff_s=2.0, max_backoff_s=1.0)
    program = lp.Program("p")
    program.add_node(lp.PyNode(fx.make_sleeper))
    with pytest.raises(TypeError, match="RestartPolicy"):
        lp.launch(program, launch_type="local_mt", restart={"sleeper": 3})


def test_local_mp_kill_9_is_restarted_with_backoff_and_nodes_json_follows(tmp_path):
    """A node killed with SIGKILL comes back (new pid in nodes.json, restart history); a node
    that keeps crashing fails the program once its restarts are used up."""
    pids_path = str(tmp_path / "worker.pids")
    program = lp.Program("restarts")
    with program.group("worker"):
        program.add_node(lp.PyNode(ff.make_counting_node, pids_path))
    with program.group("crasher"):
        program.add_node(lp.PyNode(ff.make_counting_node, str(tmp_path / "crasher.pids"),
                                   crashes=2, crash_after_s=0.1, finish_after_s=0.5))
    restart = {"worker": lp.RestartPolicy(max_restarts=2, backoff_s=0.3),
               "crasher": lp.RestartPolicy(max_restarts=2, backoff_s=0.1)}
    with lp.launch(program, run_dir=str(tmp_path), restart=restart, notice_s=5,
                   terminal_groups=("crasher",)) as launched:
        first = ff.wait_for(lambda: ff.read_pids(pids_path), what="worker started")[0]
        assert ff.nodes_json(str(tmp_path))["worker_0"]["pid"] == first
        t_kill = time.monotonic()
        os.kill(first, signal.SIGKILL)
        pids = ff.wait_for(lambda: len(ff.read_pids(pids_path)) == 2 and ff.read_pids(pids_path),
                           what="worker restarted")
        assert time.monotonic() - t_kill >= 0.3                      # the backoff was waited
        node = ff.wait_for(lambda: (n := ff.nodes_json(str(tmp_path))["worker_0"])["pid"] ==
                           pids[1] and n, what="nodes.json updated")
        assert node["status"] == "running" and node["restarts"] == 1
        [entry] = node["restart_history"]
        assert entry["pid"] == first and entry["exitcode"] == -signal.SIGKILL
        assert entry["reason"] == "crashed" and entry["backoff_s"] == 0.3
        assert not fx.pid_alive(first) and fx.pid_alive(pids[1])
        # The crasher crashed twice, was restarted twice, then ran to completion.
        assert launched.wait(timeout=60) is True
    nodes = ff.nodes_json(str(tmp_path))
    assert nodes["crasher_0"]["status"] == "finished" and nodes["crasher_0"]["restarts"] == 2
    assert [h["exitcode"] for h in nodes["crasher_0"]["restart_history"]] == [3, 3]
    assert len(set(ff.read_pids(str(tmp_path / "crasher.pids")))) == 3
    assert launched.restarts == {"worker_0": 1, "crasher_0": 2}

    # Out of restarts: the third crash fails the program, naming the restarts.
    program = lp.Program("exhausted")
    with program.group("crasher"):
        program.add_node(lp.PyNode(ff.make_counting_node, str(tmp_path / "x.pids"), crashes=9,
                                   crash_after_s=0.05))
    launched = lp.launch(program, run_dir=str(tmp_path / "x"), notice_s=2,
                         restart={"crasher": lp.RestartPolicy(max_restarts=2, backoff_s=0.05)})
    with pytest.raises(lp.NodeFailedError, match="after 2 restarts"):
        launched.wait(timeout=60)
    assert len(ff.read_pids(str(tmp_path / "x.pids"))) == 3
    assert ff.nodes_json(str(tmp_path / "x"))["crasher_0"]["status"] == "failed"


def test_local_mt_restarts_a_raising_thread_then_fails():
    program = lp.Program("mt")
    with program.group("raiser"):
        program.add_node(lp.PyNode(ff.make_raising_node))
    launched = lp.launch(program, launch_type="local_mt", notice_s=2,
                         restart={"raiser": lp.RestartPolicy(max_restarts=2, backoff_s=0.01)})
    with pytest.raises(lp.NodeFailedError, match="after 2 restarts") as info:
        launched.wait(timeout=30)
    assert "raising on purpose" in str(info.value)
    assert launched.restarts == {"raiser_0": 2}


def test_restarted_service_keeps_its_address_and_restart_node(tmp_path):
    program = lp.Program("svc")
    with program.group("echo"):
        echo = program.add_node(lp.ServiceNode(fx.make_echo_server, "hi",
                                               client_factory=fx.make_echo_client))
    with program.group("forever"):
        program.add_node(lp.PyNode(fx.make_forever, str(tmp_path / "forever.json")))
    with lp.launch(program, run_dir=str(tmp_path), notice_s=5,
                   restart={"echo": lp.RestartPolicy(max_restarts=1, backoff_s=0.1)}) as launched:
        address = launched.addresses["echo"][0]
        client = fx.make_echo_client(address)
        assert client.ask("a") == "hi:a"
        old = ff.nodes_json(str(tmp_path))["echo_0"]["pid"]
        os.kill(old, signal.SIGKILL)
        ff.wait_for(lambda: ff.nodes_json(str(tmp_path))["echo_0"]["pid"] != old,
                    what="echo restarted")
        assert echo.address == address == ff.nodes_json(str(tmp_path))["echo_0"]["address"]
        assert ff.wait_for(lambda: _try_ask(client, "b")) == "hi:b"     # same address

        # An operator's restart: cooperative stop, then a fresh start at once; not counted
        # against max_restarts (1, already used).
        fx.wait_for_json(str(tmp_path / "forever.json"))
        old_forever = ff.nodes_json(str(tmp_path))["forever_0"]["pid"]
        launched.restart_node("forever_0")
        node = ff.nodes_json(str(tmp_path))["forever_0"]
        assert node["pid"] != old_forever and node["status"] == "running"
        assert node["restart_history"][0]["reason"] == "requested"
        assert node["restart_history"][0]["exitcode"] == 0 and node["restarts"] == 0
        assert json.loads((tmp_path / "forever.json").read_text())["stopped"]   # cooperative
        launched.restart_node("echo_0")
        assert ff.wait_for(lambda: _try_ask(client, "c")) == "hi:c"
        with pytest.raises(KeyError, match="nope"):
            launched.restart_node("nope")
    assert ff.nodes_json(str(tmp_path))["echo_0"]["restarts"] == 1
    assert len(ff.nodes_json(str(tmp_path))["echo_0"]["restart_history"]) == 2


def _try_ask(client, text):
    try:
        return client.ask(text)
    except OSError:
        return None


# ------------------------------------------------------------------------------ replay node
def _rollout(i: int, vocab: int = 16, version: int = 0, actor: int = 0,
             seq: int = -1) -> Rollout:
    rng = np.random.default_rng(i)
    length = 6 + i % 5
    mask = np.zeros(length, np.int8)
    mask[3:] = 1
    return Rollout(tokens=rng.integers(1, vocab, length), action_mask=mask,
                   rollout_logp=np.where(mask == 1, -rng.random(length), 0.0),
                   versions=np.where(mask == 1, version, -1),
                   rewards=np.where(np.arange(length) == length - 1, float(i % 2), 0.0),
                   prompt_id=i, actor_id=actor, seq=seq)


def test_replay_node_restart_restores_its_items(tmp_path):
    """The replay node of the SAO program (builder.make_replay_server, checkpointing under
    run_dir): restarted on request it checkpoints on the way out and restores; killed with
    SIGKILL it restores the last periodic checkpoint. The address never changes. (What such a
    restart loses, the actors still hold and re-send: the whole-run tests below.)"""
    from sao_actor_learner.replay import RolloutReader, RolloutWriter
    config = SAOConfig(run_dir=str(tmp_path), batch_size=4, queue_capacity=16, actor_batch=4,
                       replay_checkpoint_every_s=0.5)
    program = lp.Program("replay")
    with program.group("replay"):
        program.add_node(lp.ServiceNode(make_replay_server, config, run_dir=str(tmp_path)))
    launched = lp.launch(program, run_dir=str(tmp_path), notice_s=10, terminal_groups=None,
                         restart={"replay": lp.RestartPolicy(max_restarts=1, backoff_s=0.1)})
    with launched:
        address = launched.addresses["replay"][0]
        sent = [_rollout(i) for i in range(6)]
        with RolloutWriter(address, max_sequence_length=32, vocab_size=16) as writer:
            assert all(writer.write(r, timeout_s=5.0) for r in sent)
        launched.restart_node("replay_0")                          # graceful: checkpoint on stop
        with RolloutReader(address) as reader:
            assert ff.wait_for(lambda: _queue(reader) == 6, what="6 items restored")
            got = reader.sample(2, timeout_s=5.0, min_items=2)
        assert [r.prompt_id for r in got] == [0, 1]                 # FIFO order kept
        np.testing.assert_array_equal(got[1].tokens, sent[1].tokens)

        # kill -9: what the last periodic checkpoint held comes back (4 items: 6 - 2 sampled).
        time.sleep(1.5)                                             # > replay_checkpoint_every_s
        old = ff.nodes_json(str(tmp_path))["replay_0"]["pid"]
        os.kill(old, signal.SIGKILL)
        ff.wait_for(lambda: ff.nodes_json(str(tmp_path))["replay_0"]["pid"] != old,
                    what="replay restarted")
        with RolloutReader(address) as reader:
            assert ff.wait_for(lambda: _queue(reader) == 4, timeout=60, what="4 items restored")
            assert [r.prompt_id for r in reader.sample(4, 5.0, min_items=4)] == [2, 3, 4, 5]
    node = ff.nodes_json(str(tmp_path))["replay_0"]
    assert [h["reason"] for h in node["restart_history"]] == ["requested", "crashed"]
    assert os.listdir(tmp_path / "checkpoints" / "replay")


def _queue(reader):
    try:
        return reader.queue_size()
    except Exception:  # noqa: BLE001 - restarting
        return None


def test_an_unconfirmed_insert_lands_exactly_once():
    """Two writers see the same free slot: the loser's item waits in replay's rate limiter and its
    `write` returns True unconfirmed; it lands, once, when the learner samples the first."""
    from sao_actor_learner.replay import ReplayServer, RolloutReader, RolloutWriter
    server = ReplayServer(1).start()
    try:
        with RolloutWriter(server.address, max_sequence_length=32, vocab_size=16) as writer:
            assert writer.write_many([_rollout(0)], timeout_s=5.0)[0].confirmed
            writer._wait_for_free_slot = lambda deadline: 1      # it saw the slot 0 took
            result = writer.write_many([_rollout(1)], timeout_s=0.3)[0]
            assert result.inserted and not result.confirmed and writer.unconfirmed == 1
            reader = RolloutReader(server.address)
            assert [r.prompt_id for r in reader.sample(1, timeout_s=5.0)] == [0]
            assert [r.prompt_id for r in reader.sample(1, timeout_s=10.0)] == [1]
            assert reader.sample(1, timeout_s=0.5) == []          # once, not twice
            reader.close()
    finally:
        server._shutdown()


class _ListSource(core.RolloutSource):
    """A replay stand-in for the learner: hands out queued rollouts; `interruptions` can be
    raised by the test as if the stream from replay had broken."""
    interruptions = 0     # a plain attribute here, in place of the interface's property

    def __init__(self):
        self.items, self.interruptions = [], 0

    def sample(self, n, timeout_s):
        got, self.items = self.items[:n], self.items[n:]
        return got

    def queue_size(self):
        return len(self.items)


class _Recorder:
    def __init__(self):
        self.published, self.reports = [], []

    def publish(self, version, payload, dropped_total=0):
        self.published.append(version)

    def report_progress(self, version, dropped_total, trained_total, loss_epoch=0, acks=None):
        from sao_actor_learner.variables.publisher import ProgressResult
        self.reports.append({"version": version, "loss_epoch": loss_epoch, "acks": acks})
        return ProgressResult(0, 0, False, loss_epoch, version)


def test_the_learner_trains_each_key_once_and_reports_loss_epochs(warm_start, tmp_path):
    """At-least-once delivery, exactly-once training: copies of consumed keys are skipped and
    counted; every consumed key is acknowledged per actor; the learner starts a loss epoch when
    it starts and when the stream from replay broke."""
    config = SAOConfig(init_checkpoint=warm_start, batch_size=4, actor_batch=4, max_steps=3,
                       max_staleness=4)
    policy, tokenizer = ckpt.load_policy(warm_start)
    critic = ValueModel.from_policy(policy)
    critic.freeze(config.critic_frozen_patterns)
    source, recorder = _ListSource(), _Recorder()
    resume = ResumePoint(str(tmp_path / "checkpoints"))
    learner = assemble_learner(config, policy, critic, resume.reader(source), publisher=recorder,
                               serialize=lambda sd: b"", pad_id=tokenizer.pad_id)
    vocab = tokenizer.vocab_size
    stream = [_rollout(i, vocab, version=0, actor=i % 2, seq=i // 2) for i in range(12)]
    source.items = stream[:6] + stream[2:4] + stream[6:8] + stream[:2] + stream[8:]
    learner.start_loss_epoch()
    assert recorder.reports[-1]["loss_epoch"] == 1
    for _ in range(3):
        learner.step()
    assert learner.sampler.duplicates == 4 and learner.rollouts_trained == 12
    assert sorted(r.key for r in stream) == sorted(
        (a, s) for a in (0, 1) for s in range(6) if learner.sampler.consumed.contains((a, s)))
    assert recorder.reports[-1]["acks"] == {0: (6, []), 1: (6, [])}
    source.interruptions += 1                                   # replay restarted
    source.items = [_rollout(99, vocab, version=3, actor=0, seq=6)] * 4 + \
        [_rollout(98 - i, vocab, version=3, actor=1, seq=6 + i) for i in range(4)]
    learner.max_steps = 4
    learner.step()
    assert recorder.reports[-1]["loss_epoch"] == 2 and learner.sampler.duplicates == 7
    # Four of batch 4: actor 0's seq 6 (its 3 copies skipped), actor 1's seqs 6-8; 9 waits.
    assert recorder.reports[-1]["acks"] == {0: (7, []), 1: (9, [])}
    assert [r.key for r in source.items] == [(1, 9)]


# ------------------------------------------------------------------------------ actor spool
def test_admission_slots_of_rollouts_that_never_arrive_are_returned(tmp_path):
    """Rollouts admitted but refused by the writer, or lost in generation with a crashed actor,
    would hold their admission slots for ever (enough of them and the run stalls): the actor
    returns them with its next Admit, a restarted one from its spool's ledger."""
    import grpc

    from sao_actor_learner.protos_gen import variables_pb2
    from sao_actor_learner.variables import VariableClient
    spool = RolloutSpool(str(tmp_path))
    spool.asking(4)
    spool.admitted(4)                          # 4 admitted: 1 sent, 1 refused, 1 held,
    seqs = [spool.put(_rollout(i)) for i in range(2)]   # 1 lost in generation
    spool.sent(seqs[:1], 0)
    spool.refuse("nonfinite_logp")
    spool.asking(4)                            # asked again, then killed before the answer
    spool.close()
    again = RolloutSpool(str(tmp_path))
    assert again.owed_releases() == (4 + 4) - 1 - 1    # the unanswered ask counts as granted
    again.released(6)
    assert RolloutSpool(str(tmp_path)).owed_releases() == 0

    with VariableServer(batch_size=2, max_staleness=0) as server:       # capacity 2
        client = VariableClient(server.address)
        assert client.admit("a", 2) == 2 and client.admit("a", 1) == 0
        assert client.admit_details("a", 1, released=1).granted == 1     # one slot came back
        assert client.admit_details("a", 1, released=99).started_total == 1   # clamped
        assert server.stats()["released"] == 3
        with pytest.raises(ValueError, match="released=-1"):
            client.admit_details("a", 1, released=-1)
        with pytest.raises(grpc.RpcError) as e:                 # a raw request is refused too
            client._get_stub().Admit(variables_pb2.AdmitRequest(actor_id="a", count=1,
                                                                 released=-1), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "released=-1" in e.value.details()
        client.close()


# ------------------------------------------------------------------------------ learner resume
class _StreamReader(core.RolloutSource):
    """A replay stand-in: hands out a fixed stream in order, in pieces of varying size."""

    def __init__(self, stream, position=0):
        self.stream, self.position, self.calls = stream, position, 0

    def sample(self, n, timeout_s):
        piece = (3, 1, 4, 2)[self.calls % 4]
        self.calls += 1
        got = self.stream[self.position:self.position + min(n, piece)]
        self.position += len(got)
        return got

    def queue_size(self):
        return len(self.stream) - self.position


def _learner(config, run_dir, reader, publisher):
    """builder.make_learner's resume path with a stand-in reader."""
    setup_process(config, offset=10_000)
    resume = ResumePoint(os.path.join(run_dir, "checkpoints"))
    policy, tokenizer = ckpt.load_policy(resume.checkpoint or config.init_checkpoint)
    critic = ValueModel.from_policy(policy)
    critic.freeze(config.critic_frozen_patterns)
    learner = assemble_learner(config, policy, critic, resume.reader(reader),
                               publisher=publisher, serialize=ckpt.state_dict_to_bytes,
                               tokenizer=tokenizer,
                               checkpoint_root=os.path.join(run_dir, "checkpoints"),
                               pad_id=tokenizer.pad_id)
    resume.restore(learner)
    return learner


def test_learner_resume_redoes_lost_steps_exactly(warm_start, tmp_path):
    """Kill the learner after a checkpoint: the resumed learner restores policy, critic,
    optimisers, version, counters and RNG, redoes the journalled steps and ends with the very
    weights of an uninterrupted run; version numbers are never reused for other weights."""
    config = SAOConfig(init_checkpoint=warm_start, batch_size=4, max_steps=5, max_staleness=1,
                       checkpoint_every=2, critic_updates=2)
    vocab = ckpt.load_policy(warm_start)[1].vocab_size
    # Most rollouts sampled by the version before; every 5th by version 0 (dropped once stale).
    stream = [_rollout(i, vocab, version=0 if i % 5 == 4 else max(0, i // 5 - 1))
              for i in range(60)]
    # Behaviour log-probs of the warm start, so the DIS band keeps tokens and the policy trains.
    from sao_actor_learner.types import collate
    policy0 = ckpt.load_policy(warm_start)[0]
    with torch.no_grad():
        logp = assemble_learner(config, policy0, ValueModel.from_policy(policy0)
                                ).policy_trainer.logprobs(collate(stream))
    for i, r in enumerate(stream):
        r.rollout_logp = (logp[i, :r.length].numpy() * r.action_mask).astype(np.float32)

    with VariableServer(publisher_token="t") as server:                # uninterrupted
        a = _learner(config, str(tmp_path / "a"), _StreamReader(stream),
                     VariablePublisher(server.address, "t"))
        a.run()
        sha_a = server.latest().sha256
    assert a.version == 5 and a.dropped_stale > 0

    with VariableServer(publisher_token="t") as server:
        publisher = VariablePublisher(server.address, "t")
        reader_b = _StreamReader(stream)
        b = _learner(config, str(tmp_path / "b"), reader_b, publisher)
        b.publish()
        for _ in range(3):
            b.step()                               # checkpoint at 2; 3 published; then "crash"
        b.source.sample(2, 1.0)                    # sampled, never trained: in the journal only
        torch.manual_seed(1234)                    # the crash scrambles the RNG; restore fixes it
        assert server.latest().version == 3
        del b

        c = _learner(config, str(tmp_path / "b"), _StreamReader(stream, reader_b.position),
                     publisher)
        assert (c.version, c.resumed_from, c.source.replaying) == (2, 2, True)
        c.run()
        # Redoing step 3 republished version 3, which the server accepts only byte-identical.
        assert c.version == 5 and c.resume_publish_conflicts == 0
        assert server.stats()["republished"] >= 1
        assert server.latest().sha256 == sha_a and server.latest().version == 5
    initial = ckpt.load_policy(warm_start)[0].state_dict()
    assert any(not torch.equal(t, initial[k]) for k, t in a.policy.state_dict().items())
    for name, tensor in a.policy.state_dict().items():
        assert torch.equal(tensor, c.policy.state_dict()[name]), name
    for name, tensor in a.estimator.critic.state_dict().items():
        assert torch.equal(tensor, c.estimator.critic.state_dict()[name]), name
    assert (c.dropped_stale, c.rollouts_trained) == (a.dropped_stale, a.rollouts_trained)
    # The journal now holds nothing past the final checkpoint.
    assert ResumePoint(str(tmp_path / "b" / "checkpoints")).step == 5
    assert not ResumePoint(str(tmp_path / "b" / "checkpoints")).replay



# ------------------------------------------------------------------------------ a whole run
def test_sao_run_survives_kill_9_of_an_actor_and_of_the_learner(warm_start, tmp_path):
    """local_mp, the whole SAO program: kill -9 an actor once it has inserted, then the learner
    just after a step past its last checkpoint. The actor is restarted and sends what it had
    spooled and not sent; the learner resumes from its checkpoint, redoes the journalled steps
    with byte-identical weights (the variable server accepts the republished version), starts a
    loss epoch (the actors re-send what it never acknowledged; it skips the copies) and the run
    finishes with versions 1..16 intact; every completed rollout is consumed once or still held.
    (Replay is killed in the soak test.)"""
    from sao_actor_learner.accounting import rollout_accounting
    config = SAOConfig(init_checkpoint=warm_start, run_dir=str(tmp_path / "run"), max_steps=16,
                       batch_size=8, num_actors=2, actor_batch=4, max_staleness=2,
                       eval_every=0, eval_size=8, checkpoint_every=4,
                       restart_groups=("actor", "evaluator", "learner"), restart_backoff_s=0.2)
    run_dir = config.run_dir
    events = {}

    def step():
        train = read_metrics(run_dir, "train")
        return train[-1]["step"] if train else 0

    def inject_faults(launched):
        ledger = os.path.join(run_dir, "spool", "actor_0", "ledger.log")
        ff.wait_for(lambda: os.path.exists(ledger) and "sent " in open(ledger).read(),
                    timeout=240, what="actor_0 sent", poll=0.01)
        events["actor"] = ff.nodes_json(run_dir)["actor_0"]["pid"]
        os.kill(events["actor"], signal.SIGKILL)
        ff.wait_for(lambda: (s := step()) > 4 and s % 4 and s < 16, timeout=120,
                    what="a step past a checkpoint", poll=0.005)
        events["learner"] = ff.nodes_json(run_dir)["learner_0"]["pid"]
        os.kill(events["learner"], signal.SIGKILL)
        events["killed_at"] = step()

    summary = run_program(config, make_program, progress=False, on_launch=inject_faults)

    nodes = ff.nodes_json(run_dir)
    assert all(n["status"] == "finished" for n in nodes.values()), nodes
    assert nodes["actor_0"]["restarts"] == 1 and nodes["learner_0"]["restarts"] == 1
    assert nodes["actor_0"]["restart_history"][0]["pid"] == events["actor"]
    assert nodes["learner_0"]["restart_history"][0]["exitcode"] == -signal.SIGKILL
    assert nodes["learner_0"]["pid"] != events["learner"]
    assert summary["restarts"] == {"actor_0": 1, "learner_0": 1}

    train = read_metrics(run_dir, "train")
    for row in train:
        assert row["policy_version"] == row["step"]
        assert row["staleness_max"] <= config.max_staleness
    assert sorted({r["step"] for r in train}) == list(range(1, 17))
    resumed = [r for r in train if "resumed_from" in r]
    checkpoint = resumed[0]["resumed_from"]
    assert checkpoint % 4 == 0 and checkpoint < events["killed_at"] <= checkpoint + 4
    assert [r["step"] for r in resumed if r["replayed"]][0] == checkpoint + 1
    assert resumed[-1]["resume_publish_conflicts"] == 0
    assert 16 in {r["policy_version"] for r in read_metrics(run_dir, "eval")}

    acc = rollout_accounting(run_dir)
    assert acc["learner_version"] == 16
    assert acc["trained"] == 16 * config.batch_size == summary["rollouts_trained"]
    assert acc["lost"] == 0 and acc["consumed_twice"] == 0 and acc["forgot_early"] == 0, acc
    assert acc["consumed"] == acc["trained"] + acc["dropped_stale"]
    assert acc["consumed"] + acc["held"] >= acc["completed"]
    assert acc["resent"] > 0                       # the learner's restart started a loss epoch


def test_resume_refuses_a_changed_queue_capacity(tmp_path):
    """Reverb restores the replay checkpoint's own rate limiter: resuming with another queue
    capacity would silently keep the old one, so it fails before launch."""
    from sao_actor_learner.builder import prepare_run_dir
    from sao_actor_learner.config import ConfigError
    from sao_actor_learner.run_dirs import make_recorded_dir
    config = SAOConfig(run_dir=str(tmp_path), batch_size=8)
    with pytest.raises(ConfigError, match="nothing to resume"):
        prepare_run_dir(config.replace(resume=True))
    (tmp_path / "config.json").write_text(config.to_json())
    make_recorded_dir(str(tmp_path / "checkpoints" / "replay"), str(tmp_path))   # as replay does
    with pytest.raises(ConfigError, match="resume with queue_capacity=16"):
        prepare_run_dir(config.replace(resume=True, queue_capacity=32))
    prepare_run_dir(config.replace(resume=True, max_steps=500))      # kept as it is
    assert (tmp_path / "checkpoints" / "replay").exists()
    prepare_run_dir(config)                                          # a fresh run clears it
    assert not (tmp_path / "checkpoints" / "replay").exists()


def test_soak_program_kills_hangs_drains_resumes_and_accounts_for_every_rollout(warm_start,
                                                                              tmp_path):
    """programs/soak.py end to end on a short schedule: real processes SIGKILLed and SIGSTOPped
    (the liveness check must end the hang), a stranger draining replay, and the whole program
    stopped and launched again with --resume half way; it exits 0 only if every step was done,
    no hang went unnoticed and no rollout was lost or trained twice, and its report adds up."""
    import subprocess
    run_dir = tmp_path / "soak"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "programs", "soak.py"),
         f"--init_checkpoint={warm_start}", f"--run_dir={run_dir}", "--max_steps=40",
         "--num_actors=2", "--batch_size=8", "--actor_batch=4", "--eval_every=0",
         "--eval_size=16", "--checkpoint_every=4", "--kill_every_s=5", "--max_faults=3",
         "--faults=sigkill,sigstop", "--node_timeout_s=6", "--drain_every_s=8",
         "--max_drains=1", "--resume_at_step=20", "--soak_seed=3",
         "--kill_targets=actor,learner,replay", "--replay_checkpoint_every_s=2",
         "--progress=false"],
        capture_output=True, text=True, timeout=400, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((run_dir / "soak_report.json").read_text())
    assert report["steps"] == report["max_steps"] == 40
    assert report["launches"] == 2 and report["resumed_at_step"] == 20
    node_faults = sum(n for kind, n in report["faults_by_kind"].items() if kind != "drain")
    assert node_faults <= 3 and report["hangs_undetected"] == 0, report
    assert report["restarts_total"] <= node_faults
    assert len(report["drains"]) == report["faults_by_kind"].get("drain", 0) <= 1
    r = report["rollouts"]
    assert r["lost"] == 0 and r["consumed_twice"] == 0 and r["forgot_early"] == 0, r
    assert r["trained"] == 40 * 8
    assert r["consumed_keys"] == r["trained"] + r["dropped"][
        "stale (learner: staler than max_staleness)"]
    assert r["consumed_keys"] + r["held_in_actor_spools_at_end"] >= r["completed"]


class _NoTask:
    def sample_prompt(self, rng):
        raise AssertionError("no prompts expected")


def test_actor_asks_admission_again_when_the_variable_server_is_away(tmp_path):
    """A variable server killed mid-call (UNAVAILABLE) makes the actor back off and ask again,
    not crash; any other error still propagates."""
    import grpc
    from sao_actor_learner.actors.actor import Actor
    from sao_actor_learner.variables.client import AdmitResult, VariableClientError

    class FlakyVariables:
        calls = 0
        code = grpc.StatusCode.UNAVAILABLE

        def admit_details(self, actor_id, count, released=0):
            self.calls += 1
            if self.calls <= 2:
                raise VariableClientError("Admit failed: UNAVAILABLE: Stream removed", self.code)
            return AdmitResult(count, 0, count, 8)

    class Engine:
        version = 0
        weight_sync_mode = "off"

    variables = FlakyVariables()
    actor = Actor(0, task=_NoTask(), engine=Engine(), variables=variables, sink=None,
                  decode=None, params=None, spool=RolloutSpool(str(tmp_path)), actor_batch=4)
    assert actor._admitted() == 0 and actor._admitted() == 0   # backed off, no crash
    assert actor._admitted() == 4 and variables.calls == 3
    variables.calls, variables.code = 0, grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(VariableClientError, match="UNAVAILABLE"):
        actor._admitted()
