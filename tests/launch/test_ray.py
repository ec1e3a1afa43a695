"""launch_type="ray": the same programs as actors on a (local, 2-CPU) Ray instance.

One `ray.init` for the module (~3 s, ~650 MB of Ray daemons); toy nodes import nothing heavy,
the SAO run's nodes import torch and Reverb (~500 MB each).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")   # silences Ray's token warning
ray = pytest.importorskip("ray")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fault_fixtures as ff  # noqa: E402
import launch_fixtures as fx  # noqa: E402

from sao_actor_learner import launch as lp  # noqa: E402
from sao_actor_learner.builder import make_program  # noqa: E402
from sao_actor_learner.config import SAOConfig  # noqa: E402
from sao_actor_learner.observers import read_metrics  # noqa: E402
from sao_actor_learner.run import run_program  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_program_on_ray_handles_resources_restart_and_clean_stop(tmp_path):
    program = lp.Program("toy")
    with program.group("echo"):
        echo = program.add_node(lp.ServiceNode(fx.make_echo_server, "hi",
                                               client_factory=fx.make_echo_client))
    with program.group("asker"):
        program.add_node(lp.PyNode(fx.make_asker, str(tmp_path / "asker.json"),
                                   fx.AskConfig(client=echo), {"again": echo, "raw": "-"}, 0.5))
    with program.group("worker"):
        program.add_node(lp.PyNode(ff.make_counting_node, str(tmp_path / "worker.pids")))
    launched = lp.launch(program, launch_type="ray", run_dir=str(tmp_path),
                         env={"SAO_LAUNCH_TEST": "7"}, terminal_groups=("asker",), notice_s=5,
                         resources={"asker": {"num_cpus": 1}},
                         restart={"worker": lp.RestartPolicy(max_restarts=1, backoff_s=0.1)})
    with launched:
        first = ff.wait_for(lambda: ff.read_pids(str(tmp_path / "worker.pids")))[0]
        nodes = ff.nodes_json(str(tmp_path))
        assert nodes["worker_0"]["pid"] == first and nodes["worker_0"]["ray_actor_id"]
        assert nodes["asker_0"]["resources"] == {"CPU": 1.0}
        assert nodes["echo_0"]["address"] == echo.address == f"127.0.0.1:{echo.address[10:]}"
        os.kill(first, signal.SIGKILL)                        # the worker's Ray actor process
        pids = ff.wait_for(lambda: len(p := ff.read_pids(str(tmp_path / "worker.pids"))) == 2
                           and p, what="worker restarted")
        node = ff.wait_for(lambda: (n := ff.nodes_json(str(tmp_path))["worker_0"])["pid"] ==
                           pids[1] and n, what="nodes.json updated")
        assert node["restarts"] == 1 and node["restart_history"][0]["pid"] == first
        assert node["ray_actor_id"] != nodes["worker_0"]["ray_actor_id"]
        assert launched.wait(timeout=60) is True
    result = json.loads((tmp_path / "asker.json").read_text())
    assert result["replies"] == ["hi:a", "hi:b"] and result["env"] == "7"
    assert result["client_built_in_pid"] == result["pid"] != os.getpid()
    nodes = ff.nodes_json(str(tmp_path))
    assert {n["status"] for n in nodes.values()} == {"finished"}
    assert "asker result" in (tmp_path / "logs" / "asker_0.log").read_text()
    time.sleep(1.0)
    assert not [n["pid"] for n in nodes.values() if fx.pid_alive(n["pid"])]   # every actor is gone


def test_wildcard_bind_resolves_to_the_machine_address_and_services_restart_in_place(tmp_path):
    """bind_host 0.0.0.0: handles resolve to the node's IP (what another machine would dial);
    a service restarted on request comes back on its machine, at the same address."""
    program = lp.Program("wide")
    with program.group("echo"):
        echo = program.add_node(lp.ServiceNode(ff.make_echo_server_on_all_interfaces, "hey",
                                               client_factory=fx.make_echo_client))
    with program.group("worker"):
        program.add_node(lp.PyNode(ff.make_counting_node, str(tmp_path / "w.pids")))
    with lp.launch(program, launch_type="ray", run_dir=str(tmp_path), bind_host="0.0.0.0",
                   notice_s=5) as launched:
        host = ray.util.get_node_ip_address()
        assert echo.address.startswith(f"{host}:") and host != "127.0.0.1"
        client = fx.make_echo_client(echo.address)
        assert client.ask("a") == "hey:a"
        before = ff.nodes_json(str(tmp_path))["echo_0"]
        launched.restart_node("echo_0")
        after = ff.nodes_json(str(tmp_path))["echo_0"]
        assert after["pid"] != before["pid"] and after["address"] == echo.address
        assert after["ray_node_id"] == before["ray_node_id"]
        assert ff.wait_for(lambda: _ask(client, "b")) == "hey:b"
    assert {n["status"] for n in ff.nodes_json(str(tmp_path)).values()} == {"finished"}


def _ask(client, text):
    try:
        return client.ask(text)
    except OSError:
        return None


def test_ray_failures_and_bad_resources(tmp_path):
    program = lp.Program("bad")
    program.add_node(lp.PyNode(fx.make_failing, "boom-ray", 5))
    launched = lp.launch(program, launch_type="ray", run_dir=str(tmp_path / "a"), notice_s=2)
    with pytest.raises(lp.NodeFailedError, match="boom-ray") as info:
        launched.wait(timeout=60)
    assert "failing line 4" in str(info.value)                 # the node's log tail

    program = lp.Program("greedy")
    program.add_node(lp.PyNode(fx.make_sleeper))
    with pytest.raises(ValueError, match="GPU: 1 asked, 0 in the cluster"):
        lp.launch(program, launch_type="ray", run_dir=str(tmp_path / "b"),
                  resources={"sleeper": {"num_gpus": 1}})
    program = lp.Program("typo")
    program.add_node(lp.PyNode(fx.make_sleeper))
    with pytest.raises(ValueError, match="unknown keys"):
        lp.launch(program, launch_type="ray", run_dir=str(tmp_path / "c"),
                  resources={"sleeper": {"cpus": 1}})
    with pytest.raises(ValueError, match="launch_type='ray' only"):
        lp.launch(lp.Program("x"), resources={"a": {}})


def test_together_group_on_ray_restarts_every_actor_when_one_is_killed(tmp_path):
    program = lp.Program("dpray")
    paths = [str(tmp_path / f"dp_{i}.runs") for i in range(2)]
    with program.group("dp"):
        for path in paths:
            program.add_node(lp.PyNode(fx.make_group_member, path))
    restart = {"dp": lp.RestartPolicy(max_restarts=1, backoff_s=0.1, together=True)}
    with lp.launch(program, launch_type="ray", run_dir=str(tmp_path), notice_s=10,
                   restart=restart) as launched:
        first = [ff.wait_for(lambda p=p: fx.group_runs(p), timeout=120, what=f"{p} started")[0]
                 for p in paths]
        actors = {n: v["ray_actor_id"] for n, v in ff.nodes_json(str(tmp_path)).items()}
        os.kill(first[0], signal.SIGKILL)                       # dp_0's actor process
        assert launched.wait(timeout=120) is True
    runs = [fx.group_runs(p) for p in paths]
    assert all(len(r) == 2 and r[0] == first[i] != r[1] for i, r in enumerate(runs)), runs
    assert fx.group_runs(paths[1], "stopped") == [first[1]]     # stopped cooperatively
    data = json.loads((tmp_path / "nodes.json").read_text())
    assert data["groups"]["dp"]["restarts"] == 1
    nodes = {n["name"]: n for n in data["nodes"]}
    assert {n["status"] for n in nodes.values()} == {"finished"}
    assert nodes["dp_1"]["restart_history"][0]["reason"] == "group dp: dp_0 crashed"
    assert all(nodes[n]["ray_actor_id"] != actors[n] for n in actors)


def test_sao_run_on_ray_survives_kill_9_of_an_actor(warm_start, tmp_path):
    config = SAOConfig(init_checkpoint=warm_start, run_dir=str(tmp_path / "run"), launch="ray",
                       ray_resources=("learner:1",), max_steps=8, batch_size=8, num_actors=2,
                       actor_batch=4, max_staleness=2, eval_every=0, eval_size=8,
                       restart_backoff_s=0.2)
    run_dir = config.run_dir
    events = {}

    def inserted(name):
        ledger = os.path.join(run_dir, "spool", name, "ledger.log")
        return os.path.exists(ledger) and "sent " in open(ledger).read()

    def kill_an_actor(launched):
        # The first actor to insert (the other may still be importing torch).
        events["name"] = ff.wait_for(lambda: next((f"actor_{i}" for i in range(2)
                                                   if inserted(f"actor_{i}")), None),
                                     timeout=240, what="an actor inserted", poll=0.01)
        events["pid"] = ff.nodes_json(run_dir)[events["name"]]["pid"]
        os.kill(events["pid"], signal.SIGKILL)
        ff.wait_for(lambda: (n := ff.nodes_json(run_dir)[events["name"]])["pid"] != events["pid"]
                    and n["status"] == "running", timeout=120, what="the actor restarted")

    summary = run_program(config, make_program, progress=False, on_launch=kill_an_actor)
    assert summary["steps"] == 8 and summary["rollouts_trained"] == 8 * 8
    nodes = ff.nodes_json(run_dir)
    assert json.load(open(os.path.join(run_dir, "nodes.json")))["launch_type"] == "ray"
    assert all(n["status"] == "finished" for n in nodes.values()), nodes
    killed = nodes[events["name"]]
    assert killed["restarts"] == 1 and summary["restarts"] == {events["name"]: 1}
    assert killed["restart_history"][0]["pid"] == events["pid"] != killed["pid"]
    assert nodes["learner_0"]["resources"] == {"CPU": 1.0}
    assert all(n["ray_actor_id"] and n["host"] for n in nodes.values())
    assert [r["step"] for r in read_metrics(run_dir, "train")] == list(range(1, 9))
    assert 8 in {r["policy_version"] for r in read_metrics(run_dir, "eval")}


def test_sao_run_on_ray_with_a_two_rank_learner_group(warm_start, tmp_path):
    """--learners=2 on Ray: both ranks are Ray actors that rendezvous through the learner_store
    node, train every version in order within the staleness bound, and rank 0 alone publishes
    (the evaluator sees the last version)."""
    config = SAOConfig(init_checkpoint=warm_start, run_dir=str(tmp_path / "run"), launch="ray",
                       max_steps=6, batch_size=8, num_actors=1, actor_batch=4, max_staleness=2,
                       learners=2, eval_every=0, eval_size=8)
    summary = run_program(config, make_program, progress=False)
    assert summary["steps"] == 6 and summary["rollouts_trained"] == 6 * 8
    nodes = ff.nodes_json(config.run_dir)
    assert {"learner_0", "learner_1", "learner_store_0"} <= set(nodes), sorted(nodes)
    assert nodes["learner_0"]["ray_actor_id"] != nodes["learner_1"]["ray_actor_id"]
    assert all(n["status"] == "finished" for n in nodes.values()), nodes
    train = read_metrics(config.run_dir, "train")
    assert [r["step"] for r in train] == list(range(1, 7))
    for row in train:
        assert row["policy_version"] == row["step"] and row["learners"] == 2
        assert row["staleness_max"] <= config.max_staleness
    assert 6 in {r["policy_version"] for r in read_metrics(config.run_dir, "eval")}
