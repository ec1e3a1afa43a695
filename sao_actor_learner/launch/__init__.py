"""A small launchpad: programs of labelled node groups wired by handles, and their launchers.

    from sao_actor_learner import launch as lp
    program = lp.Program("sao")
    with program.group("replay"):
        replay = program.add_node(lp.ServiceNode(make_replay_server, 64, client_factory=make_client))
    with program.group("learner"):
        program.add_node(lp.PyNode(make_learner, config, replay))
    with lp.launch(program, run_dir="runs/x", terminal_groups=("learner",),
                   restart={"actor": lp.RestartPolicy(max_restarts=3)}) as launched:
        launched.wait()

Where things live (each module's docstring states what it guarantees):

  program.py       Program, PyNode, ServiceNode and their handles
  launched.py      Launched: the running program (start and stop sequences, wait, restarts
                   carried out, nodes.json), one class for every launcher
  supervisor.py    RestartPolicy and the restart state machine (single and together-groups)
  nodeset.py       the launch's NodeRecords, their lock, and ending instances (stop sequence)
  runner.py        Runner: the hooks a launcher implements
  local_mt.py      launch_type="local_mt": a thread per node
  local_mp.py      launch_type="local_mp" (the default): a spawned process per node
  ray.py           launch_type="ray": a Ray actor per node (imports Ray; loaded only for it)
  node_runtime.py  what runs inside a node: build the worker, run it, obey stop requests
  liveness.py      heartbeats (local_mp): a node silent for node_timeout_s is killed, restarted
  loopback.py      a bind() interposer keeping wildcard-binding servers (Reverb) on loopback
  addresses.py     free ports, bind-host rules, address resolution
  logs.py          per-node logs, log tails, exit descriptions
  records.py       NodeRecord (one node's state and statuses), NodeFailedError

Pure standard library (dm-launchpad has no Python 3.11 wheel); launch_type="ray" imports Ray
(an optional extra) only when used.
"""
from __future__ import annotations

import os
import tempfile
from typing import Mapping, Optional, Sequence

from sao_actor_learner.launch.launched import Launched
from sao_actor_learner.launch.liveness import check_node_timeout
from sao_actor_learner.launch.local_mp import ProcessRunner
from sao_actor_learner.launch.local_mt import ThreadRunner
from sao_actor_learner.launch.program import (LAUNCH_TYPES, Handle, Node, Program, PyNode,
                                              PyNodeHandle, ServiceHandle, ServiceNode,
                                              find_handles)
from sao_actor_learner.launch.records import NodeFailedError
from sao_actor_learner.launch.runner import Runner
from sao_actor_learner.launch.supervisor import RestartPolicy

__all__ = ["Program", "PyNode", "ServiceNode", "Handle", "launch", "NodeFailedError", "Launched",
           "Node", "ServiceHandle", "PyNodeHandle", "LAUNCH_TYPES", "RestartPolicy", "Runner"]



def launch(program: Program, launch_type: str = "local_mp", run_dir: Optional[str] = None,
           terminal_groups: Optional[Sequence[str]] = None,
           env: Optional[Mapping[str, str]] = None, notice_s: float = 10.0,
           service_timeout_s: float = 120.0,
           restart: Optional[Mapping[str, RestartPolicy]] = None,
           bind_host: str = "127.0.0.1",
           ray_address: Optional[str] = None,
           resources: Optional[Mapping[str, Mapping[str, float]]] = None,
           group_env: Optional[Mapping[str, Mapping[str, str]]] = None,
           node_timeout_s: float = 0.0) -> Launched:
    """Starts every node of `program` and returns the running program.

    launch_type: "local_mp" (a process per node, the default), "local_mt" (a thread per node)
      or "ray" (a Ray actor per node; needs `pip install .[ray]`).
    run_dir: where nodes.json and logs/ go (a new temporary folder when None).
    terminal_groups: the groups whose PyNodes `wait()` waits for (all PyNodes when None);
      groups the program lacks are skipped (an evaluator that is switched off) but at least one
      must exist.
    env: environment variables for the nodes, in place before their interpreter starts (local_mp;
      under local_mt they are set in this process).
    notice_s: how long stop() gives nodes to return from run() before terminating them.
    service_timeout_s: how long a service node may take to accept TCP connections.
    restart: group label -> RestartPolicy: crashed nodes of those groups are started again,
      alone or with their whole group (see supervisor.py); groups the program lacks are ignored.
    bind_host: the interface the program's service factories bind (they are told separately,
      e.g. by SAOConfig.bind_host); it decides the addresses handles resolve to: 127.0.0.1 for
      loopback or wildcard binds on one machine, the node's IP for wildcard binds under Ray.
    ray_address: launch_type="ray" only: the cluster to join ("auto", "ray://host:10001", ...);
      None starts a local Ray instance unless this process already called ray.init().
    resources: launch_type="ray" only: group label -> Ray resources of each of its nodes, e.g.
      {"learner": {"num_cpus": 1, "num_gpus": 1}} (unlisted groups reserve nothing).
    group_env: launch_type="local_mp" only: group label -> extra environment variables of its
      nodes' processes, over `env` (placement.placement_env: CPU sets, CUDA_VISIBLE_DEVICES).
    node_timeout_s: launch_type="local_mp" only: a node process whose heartbeat thread has been
      silent for longer than this is killed (SIGKILL) and treated as crashed: restarted by its
      group's policy, else it fails the program (liveness.py); 0: no liveness checks.

    If starting fails, whatever started is stopped before the error propagates.
    """
    if launch_type not in LAUNCH_TYPES:
        raise ValueError(f"launch_type={launch_type!r}: must be one of {LAUNCH_TYPES}")
    if launch_type != "ray" and (ray_address is not None or resources):
        raise ValueError(f"ray_address / resources apply to launch_type='ray' only, not "
                         f"{launch_type!r}")
    if group_env and launch_type != "local_mp":
        raise ValueError(f"group_env (placement) applies to launch_type='local_mp' only, not "
                         f"{launch_type!r}: threads share one process's environment, and Ray "
                         "places nodes by resources")
    check_node_timeout(node_timeout_s)
    if node_timeout_s and launch_type != "local_mp":
        raise ValueError(f"node_timeout_s={node_timeout_s} applies to launch_type='local_mp' "
                         f"only, not {launch_type!r} (a thread cannot be killed; Ray actors are "
                         "not watched): pass node_timeout_s=0")
    if not isinstance(program, Program):
        raise TypeError(f"launch({program!r}): expected a Program")
    if not program.nodes:
        raise ValueError(f"program {program.name!r} has no nodes")
    if notice_s < 0:
        raise ValueError(f"notice_s={notice_s}: must be >= 0 (seconds stop() waits before "
                         "terminating a node)")
    if service_timeout_s <= 0:
        raise ValueError(f"service_timeout_s={service_timeout_s}: must be > 0")
    if program.launched:
        raise RuntimeError(f"program {program.name!r} was already launched; build a new Program "
                           "to launch again")
    own = {id(n.handle) for n in program.nodes}
    for n in program.nodes:
        for h in find_handles((n.args, n.kwargs)):
            if id(h) not in own:
                raise ValueError(f"node {n.name} gets handle {h.name!r} of another program")
    if launch_type == "ray":
        from sao_actor_learner.launch.ray import RayRunner   # imports ray (optional extra)
        runner: Runner = RayRunner(ray_address=ray_address, resources=resources or {})
    elif launch_type == "local_mt":
        runner = ThreadRunner()
    else:
        runner = ProcessRunner(node_timeout_s=node_timeout_s)
    if run_dir is None:
        run_dir = tempfile.mkdtemp(prefix=f"{program.name}-")
    os.makedirs(run_dir, exist_ok=True)
    launched = Launched(program, runner, run_dir, terminal_groups, env or {}, notice_s,
                        service_timeout_s, restart=restart, bind_host=bind_host,
                        group_env=group_env)
    program.mark_launched()
    try:
        launched.start()
    except BaseException:
        launched.stop()
        raise
    return launched
