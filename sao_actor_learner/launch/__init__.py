"""A small launchpad: programs of labelled node groups wired by handles, and local launchers.

    from sao_actor_learner import launch as lp
    program = lp.Program("sao")
    with program.group("replay"):
        replay = program.add_node(lp.ServiceNode(make_replay_server, 64, client_factory=make_client))
    with program.group("learner"):
        program.add_node(lp.PyNode(make_learner, config, replay))
    with lp.launch(program, run_dir="runs/x", terminal_groups=("learner",),
                   restart={"actor": lp.RestartPolicy(max_restarts=3)}) as launched:
        launched.wait()

Pure standard library (dm-launchpad has no Python 3.11 wheel); launch_type="ray" imports Ray
(an optional extra) only when used.
"""
from sao_actor_learner.launch.local import (LAUNCH_TYPES, Launched, NodeFailedError,
                                            RestartPolicy, launch)
from sao_actor_learner.launch.program import (Handle, Node, Program, PyNode, PyNodeHandle,
                                              ServiceHandle, ServiceNode)

__all__ = ["Program", "PyNode", "ServiceNode", "Handle", "launch", "NodeFailedError", "Launched",
           "Node", "ServiceHandle", "PyNodeHandle", "LAUNCH_TYPES", "RestartPolicy"]
