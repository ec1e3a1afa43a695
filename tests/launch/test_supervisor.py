"""The restart state machine (launch/supervisor.py) on its own: no thread, process or sleep.

Each test builds NodeRecords from a real Program and feeds the Supervisor exits, as a
launcher's monitor would.
"""
from __future__ import annotations

import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import launch_fixtures as fx  # noqa: E402

from sao_actor_learner import launch as lp  # noqa: E402
from sao_actor_learner.launch.records import NodeRecord  # noqa: E402
from sao_actor_learner.launch.supervisor import Supervisor  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def _records(**groups):
    """label=n -> n PyNodes per group; returns {name: NodeRecord}, all "running"."""
    program = lp.Program("p")
    for label, n in groups.items():
        with program.group(label):
            for _ in range(n):
                program.add_node(lp.PyNode(fx.make_sleeper))
    records = [NodeRecord(node, None) for node in program.nodes]
    for i, r in enumerate(records):
        r.status, r.pid = "running", 100 + i
    return {r.name: r for r in records}


def _supervisor(records, **policies):
    return Supervisor("p", policies, list(records.values()))


def test_restart_policy_together_validation_and_backoff():
    policy = lp.RestartPolicy(max_restarts=3, backoff_s=0.5, max_backoff_s=1.5, together=True)
    assert policy.together and [policy.delay(n) for n in (1, 2, 3)] == [0.5, 1.0, 1.5]
    assert not lp.RestartPolicy().together
    with pytest.raises(TypeError, match="together"):
        lp.RestartPolicy(together="yes")
    records = _records(a=1)
    with pytest.raises(TypeError, match="RestartPolicy"):
        _supervisor(records, a=3)
    assert _supervisor(records, missing=lp.RestartPolicy()).policies == {}   # ignored


def test_single_restarts_count_per_node_then_fail():
    records = _records(actor=2)
    sup = _supervisor(records, actor=lp.RestartPolicy(max_restarts=2, backoff_s=1.0))
    a0 = records["actor_0"]
    plan = sup.on_exit(a0, 3, None, stopping=False)
    assert plan.members == [a0] and plan.to_stop == [] and plan.delay == 1.0
    assert not plan.together and a0.status == "restarting" and a0.restarts == 1
    assert a0.history[-1]["reason"] == "crashed" and "cause" not in a0.history[-1]
    assert records["actor_1"].status == "running"                # the others are left alone
    sup.plan_started(plan)
    a0.status, a0.generation = "running", 1
    plan = sup.on_exit(a0, -signal.SIGKILL, None, stopping=False)
    assert plan.delay == 2.0 and a0.restarts == 2                 # the backoff doubles
    sup.plan_started(plan)
    a0.status, a0.generation = "running", 2
    assert sup.on_exit(a0, 3, None, stopping=False) is None and a0.status == "failed"
    assert sup.failure_headline(a0) == (
        "node actor_0 failed (exit code 3) after 2 restarts (max_restarts of its group)")


def test_together_crash_takes_in_every_node_of_the_group():
    """Running nodes are to be stopped; finished ones restart; one the launch has not started
    yet ("fresh") waits for the group and starts with it, without a restart of its own."""
    records = _records(dp=4, other=1)
    dp0, dp1, dp2, dp3 = (records[f"dp_{i}"] for i in range(4))
    dp2.status, dp2.exitcode = "finished", 0
    dp3.status, dp3.pid = "pending", None                       # the launch has not reached it
    sup = _supervisor(records, dp=lp.RestartPolicy(max_restarts=2, backoff_s=0.5,
                                                   together=True))
    plan = sup.on_exit(dp1, -signal.SIGKILL, None, stopping=False)
    assert plan.together and plan.cause is dp1 and plan.delay == 0.5
    assert plan.members == [dp0, dp1, dp2, dp3] and plan.to_stop == [dp0]
    assert plan.fresh == [dp3] and dp3.history == [] and dp3.plan is plan
    assert (dp0.status, dp1.status, dp2.status, dp3.status) == (
        "running", "restarting", "restarting", "restarting")
    assert [m.restarts for m in (dp0, dp1, dp2, dp3)] == [1, 1, 1, 0]
    assert sup.group_restarts == {"dp": 1}
    assert records["other_0"].status == "running"
    # The stopped peer's exit (whatever its code) is part of the group restart.
    assert sup.on_exit(dp0, 1, "peer gone", stopping=False) is None
    assert dp0.status == "restarting" and sup.group_restarts == {"dp": 1}
    assert dp0.history[-1]["reason"] == "group dp: dp_1 crashed"
    assert dp0.history[-1]["cause"] == "dp_1" and dp0.history[-1]["exitcode"] == 1
    assert dp1.history[-1]["reason"] == "crashed" and dp2.history[-1]["exitcode"] == 0
    [entry] = sup.groups_info()["dp"]["restart_history"]
    assert entry["cause"] == "dp_1" and entry["nodes"] == ["dp_0", "dp_1", "dp_2", "dp_3"]
    sup.plan_started(plan)
    assert all(m.plan is None for m in plan.members)
    for m in plan.members:
        m.status, m.generation = "running", 0 if m is dp3 else 1
    # A new crash is a new group restart, with the group's backoff doubled.
    assert sup.on_exit(dp2, 1, None, stopping=False).delay == 1.0
    assert sup.group_restarts == {"dp": 2}


def test_together_out_of_restarts_fails_the_crashed_node():
    records = _records(dp=2)
    sup = _supervisor(records, dp=lp.RestartPolicy(max_restarts=0, together=True))
    assert sup.on_exit(records["dp_1"], 1, "boom", stopping=False) is None
    assert records["dp_1"].status == "failed" and records["dp_0"].status == "running"
    assert sup.failure_headline(records["dp_1"]) == "node dp_1 failed (exit code 1)"


def test_together_normal_finish_restarts_nobody():
    records = _records(dp=2)
    sup = _supervisor(records, dp=lp.RestartPolicy(together=True))
    assert sup.on_exit(records["dp_0"], 0, None, stopping=False) is None
    assert records["dp_0"].status == "finished" and records["dp_1"].status == "running"
    assert sup.group_restarts == {"dp": 0} and records["dp_0"].history == []


def test_requested_restart_is_immediate_and_uncounted():
    records = _records(dp=2)
    sup = _supervisor(records, dp=lp.RestartPolicy(max_restarts=0, together=True))
    records["dp_0"].restart_requested = True
    plan = sup.on_exit(records["dp_0"], 0, None, stopping=False)
    assert plan.requested and plan.delay == 0.0 and plan.to_stop == [records["dp_1"]]
    assert sup.group_restarts == {"dp": 0}
    assert [r.requested_restarts for r in records.values()] == [1, 1]
    assert [r.restarts for r in records.values()] == [0, 0]
    assert records["dp_0"].history[-1]["reason"] == "requested"
    assert not records["dp_0"].restart_requested                  # consumed


def test_exits_while_stopping_are_settled_never_restarted():
    records = _records(dp=3)
    sup = _supervisor(records, dp=lp.RestartPolicy(together=True))
    dp0, dp1, dp2 = records.values()
    dp1.killed = True
    assert sup.on_exit(dp0, 0, None, stopping=True) is None and dp0.status == "finished"
    assert sup.on_exit(dp1, -signal.SIGTERM, None, stopping=True) is None
    assert dp1.status == "killed"
    assert sup.on_exit(dp2, 1, None, stopping=True) is None and dp2.status == "failed"
    assert sup.group_restarts == {"dp": 0}


def test_a_failed_group_restart_names_the_group_and_the_node():
    records = _records(dp=2)
    sup = _supervisor(records, dp=lp.RestartPolicy(together=True))
    plan = sup.on_exit(records["dp_1"], 1, None, stopping=False)
    sup.plan_failed(plan, records["dp_0"], "ignored the stop request")
    assert records["dp_0"].status == "failed" and records["dp_0"].plan is None
    assert sup.failure_headline(records["dp_0"]) == (
        "group 'dp' (after dp_1 crashed) could not be restarted: node dp_0 ignored the stop "
        "request")


def test_backoff_starts_over_after_an_instance_that_ran_long_enough(monkeypatch):
    """Crashes in a row double the backoff; a crash of an instance that ran reset_after_s or
    longer is not a crash loop: its restart waits backoff_s again (also for a together-group)."""
    from sao_actor_learner.launch import supervisor as supervisor_lib
    now = [1000.0]
    monkeypatch.setattr(supervisor_lib.time, "monotonic", lambda: now[0])
    with pytest.raises(ValueError, match="reset_after_s"):
        lp.RestartPolicy(reset_after_s=-1)
    for together in (False, True):
        records = _records(actor=1)
        sup = _supervisor(records, actor=lp.RestartPolicy(
            max_restarts=10, backoff_s=1.0, max_backoff_s=8.0, reset_after_s=60.0,
            together=together))
        a0 = records["actor_0"]
        delays = []
        for ran_s in (5, 5, 5, 5, 61, 5, 120):     # how long each instance ran before crashing
            now[0] += ran_s
            plan = sup.on_exit(a0, -signal.SIGKILL, None, stopping=False)
            delays.append(plan.delay)
            now[0] += plan.delay                     # the new instance starts when due
            sup.plan_started(plan)
            a0.status, a0.generation = "running", a0.generation + 1
        assert delays == [1.0, 2.0, 4.0, 8.0, 1.0, 2.0, 1.0], together
        assert a0.restarts == 7                    # max_restarts still counts every crash
