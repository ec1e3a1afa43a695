"""Wires an SAO program: each node of the `Program` and the parts it is made of.

The parts are made by actor_builder.py (node setup, tasks, engines, actors, evaluators) and
learner_builder.py (critic, learner, learner groups); services.py makes the replay and variable
servers. Their names are importable from here too.
"""
from __future__ import annotations

from typing import Optional

from sao_actor_learner.actor_builder import (  # noqa: F401 - re-exported
    make_actor, make_dataset_task, make_engine, make_evaluator, make_in_learner_evaluation,
    make_task, make_version_recorder, sampling_params, setup_process)
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.launch_setup import launch_options, prepare_run_dir  # noqa: F401
from sao_actor_learner.learner_builder import (  # noqa: F401 - re-exported
    LearnerGroupStore, LearnerRank, assemble_learner, make_critic, make_learner,
    make_learner_group_store)
from sao_actor_learner.services import (make_replay_server, make_variable_server,  # noqa: F401
                                        publisher_shm, variables_client_security)


# --- the program ------------------------------------------------------------------------------------
TERMINAL_GROUPS = ("learner", "evaluator")


def make_program(config: SAOConfig, run_dir: Optional[str] = None, actor_factory=None,
                 auth_token: Optional[str] = None):
    """The SAO program: replay, variable server, learner, N actors, evaluator (a node only with
    config.evaluator="node").

    Nodes are wired only through handles. Secrets (credentials.py): the learner token (the
    variable server and the learner alone: only the learner publishes or reports progress) and
    the rollout secret (the learner alone; each actor gets its own key derived from it and the
    run id, replay/validation.py: the learner trains on nothing unsigned); neither is written
    to config.json or logs. With config.groups only those groups
    run here, and the services run elsewhere are reached at config.service_addresses.
    actor_factory: replaces `make_actor` (same arguments), e.g. to wrap the engine.
    auth_token: the shared secret every variable-server call must carry (None: $SAO_AUTH_TOKEN,
      "" for none); required when config.bind_host is not a loopback address (ConfigError).
    """
    from sao_actor_learner import launch as lp
    from sao_actor_learner.credentials import launch_credentials
    from sao_actor_learner.split_launch import LaunchPart

    run_dir = run_dir or config.run_dir
    credentials = launch_credentials(config, auth_token)
    secure = {"auth_token": credentials.auth_token} if credentials.auth_token else {}
    from sao_actor_learner.replay.validation import RolloutSigner
    from sao_actor_learner.run_identity import node_run_id
    run_id = node_run_id(config, run_dir)   # binds the signed items to this run
    token, signed = credentials.learner_token, {"rollout_secret": credentials.rollout_secret,
                                                "run_id": run_id}
    keys = RolloutSigner(credentials.rollout_secret, run_id)   # each actor gets its own key
    part = LaunchPart(config)   # a service run elsewhere is its address: nodes take either
    replay, variables, store = part.remote("replay"), part.remote("variables"), None
    program = lp.Program("sao")
    if part.runs("replay"):
        with program.group("replay"):
            replay = program.add_node(lp.ServiceNode(make_replay_server, config, run_dir=run_dir))
    if part.runs("variables"):
        with program.group("variables"):
            variables = program.add_node(lp.ServiceNode(make_variable_server, config, token,
                                                        run_dir=run_dir, **secure))
    if config.learners > 1 and part.runs("learner_store"):   # the group's rendezvous
        with program.group("learner_store"):
            store = program.add_node(lp.ServiceNode(make_learner_group_store, config))
    with program.group("learner"):
        if config.learners == 1 and part.runs("learner"):
            program.add_node(lp.PyNode(make_learner, config, replay, variables, token, run_dir,
                                       **secure, **signed))
        elif part.runs("learner"):   # one node per rank
            for rank in range(config.learners):
                program.add_node(lp.PyNode(make_learner, config, replay, variables, token,
                                           run_dir, rank=rank, group_address=store, **secure,
                                           **signed))
    with program.group("actor"):
        for i in part.actor_ids:
            program.add_node(lp.PyNode(actor_factory or make_actor, config, i, replay, variables,
                                       run_dir, **secure, rollout_key=keys.actor_key(i).hex(),
                                       run_id=run_id))
    if config.evaluator in ("node", "record") and part.runs("evaluator"):   # else: learner, none
        with program.group("evaluator"):
            program.add_node(lp.PyNode(make_evaluator if config.evaluator == "node"
                                       else make_version_recorder, config, variables, run_dir,
                                       **secure))
    return program
