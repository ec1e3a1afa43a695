"""Hung nodes (issue 26, finding 2): heartbeats, node_timeout_s, kill and restart; and the whole
SAO program surviving a SIGSTOPped actor and a stranger draining replay (finding 3).

launch/liveness.py's bookkeeping on its own, the supervisor's account of a hung node, then real
local_mp processes: a SIGSTOPped node is killed and restarted (or fails the program, naming the
hang, when its group does not restart), while a node whose work loop waits far longer than the
timeout is left alone (its heartbeat comes from a thread).
"""
from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fault_fixtures as ff  # noqa: E402
import launch_fixtures as fx  # noqa: E402

from sao_actor_learner import launch as lp  # noqa: E402
from sao_actor_learner.config import ConfigError, SAOConfig  # noqa: E402
from sao_actor_learner.launch.liveness import (HUNG_PREFIX, HeartbeatWatch,  # noqa: E402
                                               hang_message, heartbeat_interval)
from sao_actor_learner.launch.records import NodeRecord  # noqa: E402
from sao_actor_learner.launch.supervisor import Supervisor  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_heartbeat_watch_counts_silence_from_the_first_beat_and_bounds_the_start():
    watch = HeartbeatWatch(spawned=100.0, start_allowance_s=60.0)
    assert watch.silent_for(0, 100.0) == 0.0 and watch.silent_for(0, 160.0) == 0.0  # starting
    assert watch.silent_for(0, 175.0) == 15.0      # no beat 75 s after the spawn: 15 s silent
    watch = HeartbeatWatch(spawned=100.0, start_allowance_s=600.0)
    assert watch.silent_for(0, 500.0) == 0.0
    assert watch.silent_for(1, 501.0) == 0.0
    assert watch.silent_for(1, 503.5) == 2.5
    assert watch.silent_for(7, 504.0) == 0.0        # beats skipped while unobserved still count
    assert watch.silent_for(7, 510.0) == 6.0
    assert heartbeat_interval(60.0) == 1.0 and heartbeat_interval(2.0) == 0.4


def test_node_timeout_is_checked_before_launch():
    with pytest.raises(ConfigError, match="node_timeout_s=-1"):
        SAOConfig(node_timeout_s=-1)
    program = lp.Program("p")
    program.add_node(lp.PyNode(fx.make_sleeper))
    with pytest.raises(ValueError, match="node_timeout_s=5 applies to launch_type='local_mp'"):
        lp.launch(program, launch_type="local_mt", node_timeout_s=5)


def test_the_supervisor_restarts_a_hung_node_and_names_the_hang_when_it_fails():
    program = lp.Program("p")
    with program.group("actor"):
        program.add_node(lp.PyNode(fx.make_sleeper))
    with program.group("learner"):
        program.add_node(lp.PyNode(fx.make_sleeper))
    records = {r.name: r for r in (NodeRecord(n, None) for n in program.nodes)}
    for r in records.values():
        r.status = "running"
    sup = Supervisor("p", {"actor": lp.RestartPolicy(max_restarts=1)}, list(records.values()))
    hung = hang_message("actor_0", 6.2, 5.0)
    assert hung.startswith(HUNG_PREFIX)
    plan = sup.on_exit(records["actor_0"], -signal.SIGKILL, hung, stopping=False)
    assert plan is not None and records["actor_0"].history[-1]["reason"] == "hung"
    assert sup.on_exit(records["learner_0"], -signal.SIGKILL, hang_message("learner_0", 7, 5),
                       stopping=False) is None
    assert records["learner_0"].status == "failed"
    headline = sup.failure_headline(records["learner_0"])
    assert "learner_0 failed (exit code -9" in headline and "no heartbeat" in headline
    assert "node_timeout_s=5" in headline


def test_a_sigstopped_node_is_killed_and_restarted_and_a_slow_one_is_not(tmp_path):
    """local_mp, node_timeout_s=3: `worker` is SIGSTOPped: its heartbeat stops, the launcher
    kills it and its restart policy starts it again; `slow`, whose run() waits 3 timeouts
    before it returns (a long checkpoint, a long generation), finishes untouched."""
    worker_pids, slow_pids = str(tmp_path / "worker.pids"), str(tmp_path / "slow.pids")
    timeout = 3.0
    program = lp.Program("liveness")
    with program.group("worker"):
        program.add_node(lp.PyNode(ff.make_counting_node, worker_pids))
    with program.group("slow"):
        program.add_node(lp.PyNode(ff.make_counting_node, slow_pids,
                                   finish_after_s=3 * timeout))
    restart = {"worker": lp.RestartPolicy(max_restarts=1, backoff_s=0.1)}
    with lp.launch(program, run_dir=str(tmp_path), restart=restart, notice_s=5,
                   terminal_groups=("slow",), node_timeout_s=timeout) as launched:
        first = ff.wait_for(lambda: ff.read_pids(worker_pids), what="worker started")[0]
        os.kill(first, signal.SIGSTOP)
        pids = ff.wait_for(lambda: len(ff.read_pids(worker_pids)) == 2 and
                           ff.read_pids(worker_pids), timeout=60, what="worker restarted")
        node = ff.wait_for(lambda: (n := ff.nodes_json(str(tmp_path))["worker_0"])["pid"] ==
                           pids[1] and n, what="nodes.json updated")
        [entry] = node["restart_history"]
        assert entry["pid"] == first and entry["exitcode"] == -signal.SIGKILL
        assert entry["reason"] == "hung" and entry["error"].startswith(HUNG_PREFIX)
        assert not fx.pid_alive(first) and fx.pid_alive(pids[1])
        assert launched.wait(timeout=120)                    # `slow` returned by itself
    nodes = ff.nodes_json(str(tmp_path))
    assert nodes["slow_0"]["status"] == "finished" and nodes["slow_0"]["restarts"] == 0
    assert len(ff.read_pids(slow_pids)) == 1
    with open(launched.log_path("worker")) as f:
        assert "[launch] hung: no heartbeat from node worker_0" in f.read()


def test_a_sigstopped_node_without_restarts_fails_the_run_naming_the_hang(tmp_path):
    pids = str(tmp_path / "pids")
    program = lp.Program("liveness")
    with program.group("learner"):
        program.add_node(lp.PyNode(ff.make_counting_node, pids))
    with lp.launch(program, run_dir=str(tmp_path), notice_s=5, node_timeout_s=2.0) as launched:
        pid = ff.wait_for(lambda: ff.read_pids(pids), what="node started")[0]
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(lp.NodeFailedError, match="learner_0 failed .*no heartbeat") as e:
            launched.wait(timeout=120)
    assert e.value.exitcode == -signal.SIGKILL and not fx.pid_alive(pid)
    assert ff.nodes_json(str(tmp_path))["learner_0"]["status"] == "failed"


# -------------------------------------------------- the SAO program: a hang and a drain
def _steal(address: str, count: int, stolen: list, done: threading.Event) -> None:
    """A stranger with a plain Reverb client: samples `count` items away as they arrive."""
    import reverb

    from sao_actor_learner.replay.client import connect
    status, client = connect(address), reverb.Client(address)
    while len(stolen) < count and not done.is_set():
        try:
            size = min(status.table_status("rollouts").current_size, count - len(stolen))
            if size > 0:   # all there is (blocks for more if the learner took some first)
                stolen.extend(s[0].info.key for s in client.sample("rollouts", num_samples=size))
            else:
                done.wait(0.002)
        except Exception:   # noqa: BLE001 - replay stopped at the end of the run
            return


def test_sao_run_survives_a_sigstopped_actor_and_a_drained_replay(warm_start, tmp_path):
    """local_mp, the whole SAO program. actor_0 is SIGSTOPped once it has sent: the launcher
    kills it after node_timeout_s and restarts it. From the start a stranger samples items away
    as they arrive, up to 40, at least (max_staleness + 1) x batch_size = 24 of them before the
    learner has its 64: without loss detection the actors would then wait for admission and the
    learner for data, forever. The learner notices the missing items, starts a
    loss epoch, the actors re-send from their spools, and the run finishes with every completed
    rollout consumed once or still held, none trained twice."""
    from sao_actor_learner.accounting import rollout_accounting
    from sao_actor_learner.builder import make_program
    from sao_actor_learner.observers import read_metrics
    from sao_actor_learner.run import run_program

    config = SAOConfig(init_checkpoint=warm_start, run_dir=str(tmp_path / "run"), max_steps=8,
                       batch_size=8, num_actors=2, actor_batch=4, max_staleness=2,
                       eval_every=0, eval_size=8, evaluator="off", restart_backoff_s=0.2,
                       node_timeout_s=10.0, replay_loss_timeout_s=2.0)
    run_dir = config.run_dir
    stolen, done, events = [], threading.Event(), {}

    def inject_faults(launched):
        threading.Thread(target=_steal, args=(launched.addresses["replay"][0], 40, stolen, done),
                         daemon=True).start()
        ledger = os.path.join(run_dir, "spool", "actor_0", "ledger.log")
        ff.wait_for(lambda: os.path.exists(ledger) and "sent " in open(ledger).read(),
                    timeout=240, what="actor_0 sent", poll=0.01)
        events["actor"] = ff.nodes_json(run_dir)["actor_0"]["pid"]
        os.kill(events["actor"], signal.SIGSTOP)
        # The program is stopped only after this returns: the hang is handled even if the
        # learner gets its batches from actor_1 alone before node_timeout_s has passed.
        ff.wait_for(lambda: (n := ff.nodes_json(run_dir)["actor_0"])["status"] == "running" and
                    n["pid"] != events["actor"], timeout=120, what="actor_0 killed and restarted",
                    poll=0.1)

    try:
        summary = run_program(config, make_program, progress=False, on_launch=inject_faults)
    finally:
        done.set()

    assert len(stolen) >= 3 * config.batch_size      # (max_staleness + 1) x batch_size
    nodes = ff.nodes_json(run_dir)
    assert nodes["learner_0"]["status"] == "finished"
    # Nothing failed; the restarted actor_0 may still have been starting when the run ended
    # (then the stop sequence terminated it: "killed").
    assert all(n["status"] == "finished" or n["name"] == "actor_0" and n["status"] == "killed"
               for n in nodes.values()), {k: n["status"] for k, n in nodes.items()}
    [entry] = nodes["actor_0"]["restart_history"]
    assert entry["pid"] == events["actor"] and entry["reason"] == "hung"
    assert summary["steps"] == 8
    with open(os.path.join(run_dir, "logs", "learner_0.log")) as f:
        log = f.read()
    assert "items left the table that this reader never fetched" in log
    train = read_metrics(run_dir, "train")
    assert train[-1]["loss_epoch"] >= 2          # the start's epoch, and at least one more
    acc = rollout_accounting(run_dir)
    assert acc["learner_version"] == 8 and acc["trained"] == 8 * config.batch_size
    assert acc["lost"] == 0 and acc["consumed_twice"] == 0 and acc["forgot_early"] == 0, acc
    assert acc["consumed"] + acc["held"] >= acc["completed"]
    assert acc["resent"] > 0                     # the stolen rollouts came back from the spools
