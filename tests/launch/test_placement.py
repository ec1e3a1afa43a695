"""--placement: node groups pinned to CPU sets and GPUs (launch/placement.py).

The process test is real: local_mp spawns each node, and the node reports the CPU affinity the
kernel gives it (os.sched_getaffinity) and the CUDA_VISIBLE_DEVICES it was started with. GPUs
cannot exist here, so the GPU group's check is the environment its process receives.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import launch_fixtures as fx  # noqa: E402

from sao_actor_learner import launch as lp  # noqa: E402
from sao_actor_learner.config import SAOConfig  # noqa: E402
from sao_actor_learner.config.sections import PROGRAM_GROUPS  # noqa: E402
from sao_actor_learner.launch.placement import (CPU_SET_ENV, GroupPlacement,  # noqa: E402
                                                check_placement, node_threads,
                                                parse_placement, placement_env)

pytestmark = pytest.mark.timeout(120)
CORES = sorted(os.sched_getaffinity(0))


def test_parse_placement_reads_cpu_and_gpu_ranges():
    got = parse_placement(["actor:cpu0", "learner:cpu1-2", "learner:gpu4-7", "evaluator:gpu0"],
                          PROGRAM_GROUPS)
    assert got == {"actor": GroupPlacement(cpus=(0,)),
                   "learner": GroupPlacement(cpus=(1, 2), gpus=(4, 5, 6, 7)),
                   "evaluator": GroupPlacement(gpus=(0,))}
    assert parse_placement([], PROGRAM_GROUPS) == {}


@pytest.mark.parametrize("entry, says", [
    ("actors:cpu0", "GROUP one of"),            # unknown group
    ("actor", "GROUP one of"),                  # no kind
    ("actor:tpu0", "cpu or gpu"),
    ("actor:cpu", "must be N or N-M"),
    ("actor:cpu3-1", "0 <= N <= M"),
    ("actor:cpux", "must be N or N-M"),
])
def test_parse_placement_rejects_bad_entries(entry, says):
    with pytest.raises(ValueError, match=says):
        parse_placement([entry], PROGRAM_GROUPS)


def test_a_group_named_twice_for_the_same_kind_is_an_error():
    with pytest.raises(ValueError, match="twice"):
        parse_placement(["actor:cpu0", "actor:cpu1"], PROGRAM_GROUPS)


def test_check_placement_against_the_machine():
    check_placement({"actor": GroupPlacement(cpus=(CORES[0],))})          # exists: fine
    with pytest.raises(ValueError, match=r"core\(s\) \[64\] are not available"):
        check_placement({"actor": GroupPlacement(cpus=(64,))})
    with pytest.raises(ValueError, match=r"GPU\(s\) \[2, 3\] do not exist here \(2 visible\)"):
        check_placement({"learner": GroupPlacement(gpus=(0, 1, 2, 3))}, gpu_count=2)
    check_placement({"learner": GroupPlacement(gpus=(0, 1))}, gpu_count=2)


def test_a_core_or_gpu_that_does_not_exist_is_a_config_error():
    base = dict(task="arithmetic", run_dir="/tmp/unused")
    with pytest.raises(ValueError, match="placement actor:cpu99: core"):
        SAOConfig(placement=("actor:cpu99",), **base).validate()
    with pytest.raises(ValueError, match="needs launch=local_mp"):
        SAOConfig(placement=(f"actor:cpu{CORES[0]}",), launch="local_mt", **base).validate()
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None and not os.path.exists("/dev/nvidia0"):
        with pytest.raises(ValueError, match="do not exist here"):
            SAOConfig(placement=("learner:gpu0",), **base).validate()
    SAOConfig(placement=(f"actor:cpu{CORES[0]}",), **base).validate()


def test_placement_env_and_thread_count(monkeypatch):
    env = placement_env({"actor": GroupPlacement(cpus=(0,)),
                         "learner": GroupPlacement(cpus=(1, 2), gpus=(4, 5))})
    assert env == {"actor": {CPU_SET_ENV: "0", "OMP_NUM_THREADS": "1"},
                   "learner": {CPU_SET_ENV: "1,2", "OMP_NUM_THREADS": "2",
                               "CUDA_VISIBLE_DEVICES": "4,5"}}
    monkeypatch.delenv(CPU_SET_ENV, raising=False)
    assert node_threads(3) == 3
    monkeypatch.setenv(CPU_SET_ENV, "1,2")
    assert node_threads(3) == 2


@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores to place two groups apart")
def test_local_mp_nodes_run_on_their_cpu_set_and_get_their_gpus(tmp_path):
    first, second = CORES[0], CORES[1]
    program = lp.Program("placed")
    outs = {}
    for group in ("actor", "learner", "free"):
        outs[group] = str(tmp_path / f"{group}.json")
        with program.group(group):
            program.add_node(lp.PyNode(fx.make_placement_reporter, outs[group]))
    group_env = placement_env(parse_placement(
        [f"actor:cpu{first}", f"learner:cpu{second}", "learner:gpu4-7"],
        PROGRAM_GROUPS + ("free",)))
    with lp.launch(program, run_dir=str(tmp_path / "run"), group_env=group_env,
                   env={"OMP_NUM_THREADS": "9"}) as launched:
        assert launched.wait(timeout=60)
    actor, learner, free = (fx.wait_for_json(outs[g]) for g in ("actor", "learner", "free"))
    assert actor["cores"] == [first] and learner["cores"] == [second]
    assert free["cores"] == CORES                      # not placed: anywhere
    assert learner["cuda_visible_devices"] == "4,5,6,7"
    assert actor["cuda_visible_devices"] == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert (actor["omp_num_threads"], actor["node_threads"]) == ("1", 1)
    assert (free["omp_num_threads"], free["node_threads"]) == ("9", 7)   # launch env, default
    assert os.sched_getaffinity(0) == set(CORES)       # the launcher itself is not pinned


def test_group_env_is_refused_outside_local_mp(tmp_path):
    program = lp.Program("placed")
    with program.group("actor"):
        program.add_node(lp.PyNode(fx.make_sleeper, 0.01))
    with pytest.raises(ValueError, match="local_mp' only"):
        lp.launch(program, launch_type="local_mt", run_dir=str(tmp_path),
                  group_env={"actor": {CPU_SET_ENV: "0"}})
