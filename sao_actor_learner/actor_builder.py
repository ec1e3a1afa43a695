"""Makes the actor side's parts from a config: the node process's setup, tasks, engines, sampling
parameters, the actor node, the evaluator and the version recorder (builder.py wires them).

Each `make_*` function runs inside its node's own process, so it imports what it needs lazily:
the variable server never loads torch models, nothing but the replay path imports reverb.
"""
from __future__ import annotations

import os
from typing import Optional

from sao_actor_learner.config import SAOConfig
from sao_actor_learner.run_dirs import make_owned_dir
from sao_actor_learner.services import variables_client_security


def setup_process(config: SAOConfig, offset: int = 0) -> None:
    """Per-process settings: thread count (several processes share few cores) and seeds."""
    import random

    import numpy as np
    import torch

    from sao_actor_learner.launch.placement import node_threads
    torch.set_num_threads(node_threads(config.threads_per_process))   # a placed node: its cores
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process (threaded launch)
        pass
    random.seed(config.seed + offset)
    np.random.seed((config.seed + offset) % (2 ** 32))
    torch.manual_seed(config.seed + offset)


def sampling_params(config: SAOConfig, greedy: bool = False, stop_ids=(),
                    actor: bool = False):
    """Training (or greedy evaluation) sampling; `stop_ids` are the tokenizer's. `actor`: the
    actors' training rollouts, which sample with --drift_actor_temperature / --drift_actor_top_p
    in a sampling-mismatch experiment (config/drift.py)."""
    from sao_actor_learner.config.drift import actor_sampling
    from sao_actor_learner.core import SamplingParams
    stop = tuple(int(t) for t in stop_ids)
    temperature, top_p = actor_sampling(config) if actor else (config.temperature, config.top_p)
    return SamplingParams(max_new_tokens=config.max_new_tokens,
                          temperature=0.0 if greedy else temperature,
                          top_p=1.0 if greedy else top_p, stop_token_ids=stop)


def make_lag_sampler(config: SAOConfig, actor_id: int):
    """Actor `actor_id`'s forced staleness lag sampler (actors/lags.py), seeded by (seed, actor
    id); None without forced staleness or with the constant lag."""
    if config.forced_staleness < 0 or config.forced_staleness_distribution == "constant":
        return None
    from sao_actor_learner.actors.lags import LagSampler
    return LagSampler(config.forced_staleness_distribution, config.forced_staleness,
                      config.forced_staleness_tail_alpha, config.max_staleness,
                      seed=(config.seed, actor_id, "lags"))


# --- the parts --------------------------------------------------------------------------------------
def make_task(config: SAOConfig, actor_id: int = 0, tokenizer=None):
    """The task of config.task, built by its registry entry (tasks/registry.py); actors get
    disjoint prompt ids (offset = actor id, stride = number of actors). `tokenizer` is the
    model's (the dataset task encodes its prompts with it)."""
    from sao_actor_learner.tasks.registry import task_spec
    return task_spec(config.task).build(config, actor_id, tokenizer)


def make_dataset_task(config: SAOConfig, tokenizer, actor_id: int = 0):
    """The dataset task of config (tasks/dataset.py) over `tokenizer`, with its reward."""
    from sao_actor_learner.tasks.registry import task_spec
    return task_spec("dataset").build(config, actor_id, tokenizer)


def _follow_engine_version(task, engine) -> None:
    """Tasks whose reward depends on the policy version (online_shift) read the engine's."""
    task.set_version_source(lambda: engine.version)


def make_engine(config: SAOConfig, role: str = "actor", run_dir: Optional[str] = None):
    """The Engine of an actor (role "actor_<i>") or the evaluator (role "evaluator").

    Built by config.engine's registry entry (engines/registry.py); engine="vllm" starts a vLLM
    server for this node (log: <run_dir>/logs/vllm_<role>.log). The evaluator keeps the torch
    engine unless vllm_evaluator (same weights, greedy). Actors' engines
    take config.weight_sync_mode (off with forced staleness: those weights are old on purpose);
    the evaluator's is off (docs/DESIGN.md "Weight sync modes").
    """
    from sao_actor_learner.engines.registry import engine_spec
    sync = config.weight_sync_mode if role.startswith("actor") and \
        config.forced_staleness < 0 else "off"
    engine = config.engine if role != "evaluator" or config.vllm_evaluator else "torch"
    return engine_spec(engine).build(config, role, run_dir, sync)


def make_actor(config: SAOConfig, actor_id: int, replay_address: str, variables_address: str,
               run_dir: Optional[str] = None, auth_token: str = "", rollout_key: str = "",
               run_id: str = "", wrap_engine=None):
    """An actor node. Its spool (run_dir/spool/actor_<id>, or a temporary folder without
    config.actor_spool) keeps every rollout until the learner acknowledges it; its writer signs
    every item with its own `rollout_key` (hex; RolloutSigner.actor_key: derived from the run's
    rollout secret, `run_id` and this actor id) and tags it with `run_id`. `wrap_engine(engine) -> engine` puts something
    around the engine (a log, a fault injector)."""
    setup_process(config, offset=actor_id + 1)
    import tempfile

    import numpy as np

    from sao_actor_learner.actors.actor import Actor
    from sao_actor_learner.actors.delays import make_delay_sampler
    from sao_actor_learner.actors.spool import RolloutSpool, spool_dir
    from sao_actor_learner.models import checkpoint as ckpt
    from sao_actor_learner.replay import RolloutWriter
    from sao_actor_learner.replay.validation import ActorSigner
    from sao_actor_learner.variables import VariableClient

    engine = make_engine(config, role=f"actor_{actor_id}", run_dir=run_dir)
    task = make_task(config, actor_id, tokenizer=engine.tokenizer)
    if wrap_engine is not None:
        engine = wrap_engine(engine)
    _follow_engine_version(task, engine)
    run_dir = run_dir or config.run_dir
    delay_rng = np.random.default_rng([config.seed, actor_id, 2])
    if config.actor_spool:
        make_owned_dir(os.path.dirname(spool_dir(run_dir, actor_id)))   # run_dir/spool, marked
    directory = spool_dir(run_dir, actor_id) if config.actor_spool else \
        tempfile.mkdtemp(prefix=f"sao_spool_actor_{actor_id}_")
    signer = ActorSigner(rollout_key, run_id) if rollout_key else None
    return Actor(
        actor_id, task, engine,
        variables=VariableClient(variables_address, config.variable_update_period_s,
                                 weight_transport=config.weight_transport,
                                 **variables_client_security(config, auth_token)),
        sink=RolloutWriter(replay_address, max_sequence_length=config.max_sequence_length,
                           vocab_size=engine.tokenizer.vocab_size, signer=signer),
        decode=ckpt.bytes_to_state_dict_views,  # engines copy them into the model
        params=sampling_params(config, stop_ids=engine.tokenizer.stop_ids, actor=True),
        spool=RolloutSpool(directory),
        actor_batch=config.actor_batch, admission_control=config.admission_control,
        seed=config.seed, max_total_tokens=config.max_sequence_length,
        max_turns=config.max_turns, env_threads=config.env_threads,
        stats_path=os.path.join(run_dir, f"actor_{actor_id}_stats.json"),
        group_size=config.group_size, forced_staleness=config.forced_staleness,
        weight_poll_s=config.variable_update_period_s, lags=make_lag_sampler(config, actor_id),
        delay_sampler=make_delay_sampler(config.actor_delay, config.actor_delay_mean_s,
                                         config.actor_delay_max_s, config.actor_delay_tail,
                                         delay_rng))


def make_evaluator(config: SAOConfig, variables_address: str, run_dir: Optional[str] = None,
                   auth_token: str = ""):
    """The evaluator node (evaluator=node): it fetches versions from the variable server."""
    setup_process(config, offset=20_000)
    from sao_actor_learner.models import checkpoint as ckpt
    from sao_actor_learner.variables import VariableClient

    return _evaluator(config, run_dir,
                      variables=VariableClient(variables_address,
                                               config.variable_update_period_s,
                                               weight_transport=config.weight_transport,
                                               **variables_client_security(config, auth_token)),
                      decode=ckpt.bytes_to_state_dict_views)  # no copy


def make_version_recorder(config: SAOConfig, variables_address: str,
                          run_dir: Optional[str] = None, auth_token: str = ""):
    """The recorder node (evaluator=record): due versions written for evaluation later."""
    setup_process(config, offset=20_000)
    from sao_actor_learner.actors.version_recorder import VersionRecorder
    from sao_actor_learner.variables import VariableClient
    client = VariableClient(variables_address, config.variable_update_period_s,
                            weight_transport=config.weight_transport,
                            **variables_client_security(config, auth_token))   # no decode
    return VersionRecorder(client, run_dir or config.run_dir, config.eval_every,
                           config.max_steps)


def make_in_learner_evaluation(config: SAOConfig, run_dir: Optional[str] = None):
    """The evaluation the learner runs in its own process (evaluator=in_learner): the
    evaluator's engine (the torch engine, its own copy of the model) and task, offered each
    version the learner publishes (actors/evaluator.InLearnerEvaluation)."""
    from sao_actor_learner.actors.evaluator import InLearnerEvaluation
    return InLearnerEvaluation(_evaluator(config.replace(engine="torch"), run_dir,
                                          variables=None, decode=None))


def _evaluator(config: SAOConfig, run_dir: Optional[str], variables, decode):
    from sao_actor_learner.actors.evaluator import Evaluator
    from sao_actor_learner.observers.trackers import make_metrics_logger

    engine = make_engine(config, role="evaluator", run_dir=run_dir)
    task = make_task(config, tokenizer=engine.tokenizer)
    _follow_engine_version(task, engine)
    return Evaluator(task, engine, variables=variables, decode=decode,
                     params=sampling_params(config, greedy=True,
                                            stop_ids=engine.tokenizer.stop_ids),
                     pass_k=config.eval_pass_k,
                     sample_params=sampling_params(config, stop_ids=engine.tokenizer.stop_ids),
                     eval_every=config.eval_every, max_steps=config.max_steps,
                     logger=make_metrics_logger(config, run_dir, "evaluator"),
                     max_turns=config.max_turns, max_total_tokens=config.max_sequence_length,
                     env_threads=config.env_threads)
