"""Makes the parts of an SAO program from a config, and wires them into a `Program`.

Each `make_*` function runs inside its node's own process (it is what a node's handle-bearing
arguments are passed to), so it imports what it needs lazily: the variable server never loads
torch models, the learner never imports the engine, nothing but the replay path imports reverb.
"""
from __future__ import annotations

import os
import secrets
from typing import Optional

from sao_actor_learner.config import SAOConfig


def setup_process(config: SAOConfig, offset: int = 0) -> None:
    """Per-process settings: thread count (several processes share few cores) and seeds."""
    import random

    import numpy as np
    import torch

    torch.set_num_threads(config.threads_per_process)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process (threaded launch)
        pass
    random.seed(config.seed + offset)
    np.random.seed((config.seed + offset) % (2 ** 32))
    torch.manual_seed(config.seed + offset)


def sampling_params(config: SAOConfig, greedy: bool = False, eos_id: Optional[int] = None):
    from sao_actor_learner.core import SamplingParams
    stop = (eos_id,) if eos_id is not None else ()
    return SamplingParams(max_new_tokens=config.max_new_tokens,
                          temperature=0.0 if greedy else config.temperature,
                          top_p=1.0 if greedy else config.top_p, stop_token_ids=stop)


# --- the parts --------------------------------------------------------------------------------------
def make_replay_server(config: SAOConfig, port: int = 0):
    from sao_actor_learner.replay import ReplayServer
    return ReplayServer(config.effective_queue_capacity, port=port)


def make_variable_server(config: SAOConfig, publisher_token: str, port: int = 0):
    from sao_actor_learner.variables import VariableServer
    return VariableServer(port=port, batch_size=config.batch_size,
                          max_staleness=config.max_staleness,
                          admission_control=config.admission_control,
                          publisher_token=publisher_token)


def make_task(config: SAOConfig, actor_id: int = 0):
    """The task; actors get disjoint prompt ids (offset = actor id, stride = number of actors)."""
    from sao_actor_learner.tasks import make_task as _make_task
    return _make_task(config.task, seed=config.seed, num_eval=config.eval_size,
                      prompt_id_offset=actor_id, prompt_id_stride=config.num_actors)


def make_engine(config: SAOConfig):
    from sao_actor_learner.engines import TorchEngine
    return TorchEngine.from_checkpoint(config.init_checkpoint)


def make_learner(config: SAOConfig, replay_address: str, variables_address: str,
                 publisher_token: str, run_dir: Optional[str] = None):
    setup_process(config, offset=10_000)
    from sao_actor_learner.learner.sao import SAOLearner
    from sao_actor_learner.models import checkpoint as ckpt
    from sao_actor_learner.models.value import ValueModel
    from sao_actor_learner.observers import MetricsLogger
    from sao_actor_learner.replay import RolloutReader
    from sao_actor_learner.variables import VariablePublisher

    policy, tokenizer = ckpt.load_policy(config.init_checkpoint)
    critic = ValueModel.from_policy(policy)
    critic.freeze(config.critic_frozen_patterns)
    run_dir = run_dir or config.run_dir
    return SAOLearner(
        config, policy, critic,
        reader=RolloutReader(replay_address),
        publisher=VariablePublisher(variables_address, publisher_token),
        serialize=ckpt.state_dict_to_bytes,
        logger=MetricsLogger(run_dir, "learner"),
        checkpoint_fn=lambda learner, step: save_learner_checkpoint(learner, tokenizer, run_dir, step),
        pad_id=tokenizer.pad_id)


def save_learner_checkpoint(learner, tokenizer, run_dir: str, step: int) -> str:
    """Policy as a Hugging Face checkpoint, plus critic and optimiser state, under checkpoints/."""
    import torch

    from sao_actor_learner.models import checkpoint as ckpt

    path = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    ckpt.save_checkpoint(learner.policy, tokenizer, path)
    torch.save({"critic": learner.critic.state_dict(),
                "policy_opt": learner.policy_opt.state_dict(),
                "critic_opt": learner.critic_opt.state_dict(),
                "version": learner.version, "dropped_stale": learner.dropped_stale,
                "rollouts_trained": learner.rollouts_trained},
               os.path.join(path, "learner_state.pt"))
    return path


def make_actor(config: SAOConfig, actor_id: int, replay_address: str, variables_address: str,
               run_dir: Optional[str] = None):
    setup_process(config, offset=actor_id + 1)
    from sao_actor_learner.actors.actor import Actor
    from sao_actor_learner.models import checkpoint as ckpt
    from sao_actor_learner.replay import RolloutWriter
    from sao_actor_learner.variables import VariableClient

    engine = make_engine(config)
    task = make_task(config, actor_id)
    run_dir = run_dir or config.run_dir
    return Actor(
        actor_id, task, engine,
        variables=VariableClient(variables_address, config.variable_update_period_s),
        writer=RolloutWriter(replay_address, max_sequence_length=config.max_sequence_length,
                             vocab_size=engine.tokenizer.vocab_size),
        decode=ckpt.bytes_to_state_dict,
        params=sampling_params(config, eos_id=engine.tokenizer.eos_id),
        actor_batch=config.actor_batch, admission_control=config.admission_control,
        seed=config.seed, max_total_tokens=config.max_sequence_length,
        stats_path=os.path.join(run_dir, f"actor_{actor_id}_stats.json"))


def make_evaluator(config: SAOConfig, variables_address: str, run_dir: Optional[str] = None):
    setup_process(config, offset=20_000)
    from sao_actor_learner.actors.evaluator import Evaluator
    from sao_actor_learner.models import checkpoint as ckpt
    from sao_actor_learner.observers import MetricsLogger
    from sao_actor_learner.variables import VariableClient

    engine = make_engine(config)
    return Evaluator(make_task(config), engine,
                     variables=VariableClient(variables_address, config.variable_update_period_s),
                     decode=ckpt.bytes_to_state_dict,
                     params=sampling_params(config, greedy=True, eos_id=engine.tokenizer.eos_id),
                     eval_every=config.eval_every, max_steps=config.max_steps,
                     logger=MetricsLogger(run_dir or config.run_dir, "evaluator"))


# --- the program ------------------------------------------------------------------------------------
TERMINAL_GROUPS = ("learner", "evaluator")


def make_program(config: SAOConfig, run_dir: Optional[str] = None):
    """The SAO program: replay, variable server, learner, N actors, evaluator.

    Nodes are wired only through handles; the publisher token is made here and given to the
    variable server and the learner alone, so only the learner can publish weights.
    """
    from sao_actor_learner import launch as lp

    run_dir = run_dir or config.run_dir
    token = secrets.token_hex(16)
    program = lp.Program("sao")
    with program.group("replay"):
        replay = program.add_node(lp.ServiceNode(make_replay_server, config))
    with program.group("variables"):
        variables = program.add_node(lp.ServiceNode(make_variable_server, config, token))
    with program.group("learner"):
        program.add_node(lp.PyNode(make_learner, config, replay, variables, token, run_dir))
    with program.group("actor"):
        for i in range(config.num_actors):
            program.add_node(lp.PyNode(make_actor, config, i, replay, variables, run_dir))
    with program.group("evaluator"):
        program.add_node(lp.PyNode(make_evaluator, config, variables, run_dir))
    return program
