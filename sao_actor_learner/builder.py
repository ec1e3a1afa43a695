"""Makes the parts of an SAO program from a config, and wires them into a `Program`.

Each `make_*` function runs inside its node's own process (it is what a node's handle-bearing
arguments are passed to), so it imports what it needs lazily: the variable server never loads
torch models, the learner never imports the engine, nothing but the replay path imports reverb.
"""
from __future__ import annotations

import os
from typing import Optional

from sao_actor_learner import core
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.launch_setup import launch_options, prepare_run_dir  # noqa: F401
from sao_actor_learner.run_dirs import make_owned_dir
from sao_actor_learner.services import (make_replay_server, make_variable_server,  # noqa: F401
                                        publisher_shm, variables_client_security)


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


def sampling_params(config: SAOConfig, greedy: bool = False, stop_ids=()):
    """Training (or greedy evaluation) sampling; `stop_ids` are the tokenizer's."""
    from sao_actor_learner.core import SamplingParams
    stop = tuple(int(t) for t in stop_ids)
    return SamplingParams(max_new_tokens=config.max_new_tokens,
                          temperature=0.0 if greedy else config.temperature,
                          top_p=1.0 if greedy else config.top_p, stop_token_ids=stop)


# --- the parts --------------------------------------------------------------------------------------
def make_task(config: SAOConfig, actor_id: int = 0, tokenizer=None):
    """The task; actors get disjoint prompt ids (offset = actor id, stride = number of actors).
    `tokenizer` is the model's (the dataset task encodes its prompts with it)."""
    from sao_actor_learner.tasks import make_task as _make_task
    if config.task == "dataset":
        return make_dataset_task(config, tokenizer, actor_id)
    extra = {"shift_every": config.shift_every} if config.task == "online_shift" else {}
    if config.task == "calculator_tool":  # tool latency and timeout
        extra = {"tool_latency": config.tool_latency, "tool_timeout_s": config.tool_timeout_s}
    return _make_task(config.task, seed=config.seed, num_eval=config.eval_size,
                      prompt_id_offset=actor_id, prompt_id_stride=config.num_actors, **extra)


def make_dataset_task(config: SAOConfig, tokenizer, actor_id: int = 0):
    """The dataset task of config (tasks/dataset.py) over `tokenizer`, with its reward."""
    from sao_actor_learner.rewards import make_reward
    from sao_actor_learner.tasks.dataset import DatasetTask, PromptRenderer
    renderer = PromptRenderer(tokenizer, config.apply_chat_template, config.template_kwargs,
                              config.system_prompt, config.instruction_suffix)
    reward = make_reward(config.reward, timeout_s=config.reward_timeout_s,
                         workers=config.reward_workers)
    try:
        return DatasetTask(tokenizer, config.train_files, config.eval_files, reward,
                           renderer=renderer, prompt_key=config.prompt_key,
                           answer_key=config.answer_key,
                           max_prompt_length=config.max_prompt_length,
                           num_eval=config.eval_size, seed=config.seed, shuffle=config.shuffle,
                           prompt_id_offset=actor_id, prompt_id_stride=config.num_actors)
    except BaseException:
        reward.close()
        raise


def _follow_engine_version(task, engine) -> None:
    """Tasks whose reward depends on the policy version (online_shift) read the engine's."""
    if hasattr(task, "set_version_source"):
        task.set_version_source(lambda: engine.version)


def make_engine(config: SAOConfig, role: str = "actor", run_dir: Optional[str] = None):
    """The Engine of an actor (role "actor_<i>") or the evaluator (role "evaluator").

    engine="vllm" starts a vLLM server for this node (log: <run_dir>/logs/vllm_<role>.log); the
    evaluator keeps the torch engine unless vllm_evaluator (same weights, greedy). Actors' engines
    take config.weight_sync_mode (off with forced staleness: those weights are old on purpose);
    the evaluator's is off (docs/DESIGN.md "Weight sync modes").
    """
    sync = config.weight_sync_mode if role.startswith("actor") and \
        config.forced_staleness < 0 else "off"
    if config.engine == "vllm" and (role != "evaluator" or config.vllm_evaluator):
        from sao_actor_learner.engines import VLLMEngine
        log_dir = os.path.join(run_dir or config.run_dir, "logs")
        return VLLMEngine.from_checkpoint(
            config.model, weight_sync_mode=sync,
            python=config.vllm_python, log_path=os.path.join(log_dir, f"vllm_{role}.log"),
            start_timeout_s=config.vllm_start_timeout_s, max_restarts=config.vllm_max_restarts,
            kv_cache_gb=config.vllm_kv_cache_gb, threads=config.threads_per_process,
            enforce_eager=config.vllm_enforce_eager, seed=config.seed,
            max_concurrency=max(config.actor_batch * max(config.group_size, 1), 1))
    from sao_actor_learner.engines import TorchEngine
    return TorchEngine.from_checkpoint(config.model, weight_sync_mode=sync)


def make_critic(config: SAOConfig, policy, collective=None):
    """The critic of config.algorithm=sao on `policy`'s device, prepared for the group:
    critic=separate a ValueModel of its own (from critic_model, else a copy of the policy's
    body) with critic_frozen_patterns frozen; critic=shared_trunk a value head on the policy's
    own body (call this before the policy is prepared for the group: the body is shared).
    None for the other algorithms."""
    from sao_actor_learner.learner import distributed
    from sao_actor_learner.models.value import ValueModel
    if config.algorithm != "sao":
        return None
    collective = collective or distributed.SINGLE
    if config.critic == "shared_trunk":
        critic = ValueModel.sharing_trunk(policy)
        distributed.prepare_module(critic.head, "ddp", collective)   # replicated, broadcast
        return critic
    critic = ValueModel.load(config.critic_model) if config.critic_model else \
        ValueModel.from_policy(policy)
    critic.freeze(config.critic_frozen_patterns)
    critic.to(policy.get_input_embeddings().weight.device)
    distributed.prepare_module(critic, config.learner_strategy, collective,
                               layers=getattr(critic.body, "layers", ()))
    return critic


def assemble_learner(config: SAOConfig, policy, critic=None, source=None, *, publisher=None,
                     serialize=None, logger=None, tokenizer=None, checkpoint_root=None,
                     token_limit=None, pad_id: int = 0, collective=None, evaluation=None):
    """The Learner of `config` from its parts: the policy trainer, the estimator of
    config.algorithm (sao needs `critic`, already frozen; with critic=shared_trunk and no
    `critic`, the value head is made on `policy` here), the sampler over `source`; each part
    gets only its section (LearnerConfig) and the few other fields it needs. `evaluation`:
    the in-process evaluation (evaluator=in_learner), or None."""
    from sao_actor_learner.config.learner import LearnerConfig
    from sao_actor_learner.learner import distributed
    from sao_actor_learner.learner.estimators import make_estimator
    from sao_actor_learner.learner.learner import Learner
    from sao_actor_learner.learner.policy import PolicyTrainer
    from sao_actor_learner.learner.sampling import GroupSampler, RolloutSampler
    from sao_actor_learner.learner.value_pretraining import ValuePretraining

    collective = collective or distributed.SINGLE
    section = config.section(LearnerConfig)
    if critic is None and config.algorithm == "sao" and config.critic == "shared_trunk":
        critic = make_critic(config, policy, collective)
    trainer = PolicyTrainer(policy, section, temperature=config.temperature, top_p=config.top_p,
                            token_limit=token_limit, collective=collective)
    estimator = make_estimator(section, critic, collective, policy_trainer=trainer)
    if config.algorithm == "grpo":
        sampler = GroupSampler(source, config.max_staleness, config.group_size)
    else:
        sampler = RolloutSampler(source, config.max_staleness)
    return Learner(trainer, estimator, sampler, max_steps=config.max_steps,
                   batch_size=config.batch_size // collective.world_size,
                   value_pretraining=ValuePretraining.from_config(config),
                   yardstick=_critic_yardstick(config, collective, pad_id),
                   critic_eval_every=config.critic_eval_every,
                   warmup_steps=config.critic_warmup_steps,
                   checkpoint_every=config.checkpoint_every, publisher=publisher,
                   serialize=serialize, logger=logger, checkpoint_root=checkpoint_root,
                   tokenizer=tokenizer, keep_checkpoints=config.keep_checkpoints, pad_id=pad_id,
                   journal_max_bytes=config.journal_max_mb << 20,
                   collective=collective, evaluation=evaluation)


def _critic_yardstick(config: SAOConfig, collective, pad_id: int):
    """The critic's held-out yardstick from --critic_heldout_file or the critic directory's
    own rollouts (this rank's equal share), or None (learner/value_pretraining.py)."""
    from sao_actor_learner.learner.value_pretraining import CriticYardstick, heldout_file_of
    if config.algorithm != "sao" or config.critic != "separate":
        return None
    path = heldout_file_of(config.critic_model, config.critic_heldout_file)
    if not path:
        return None
    yardstick = CriticYardstick.from_file(path, config.critic_eval_every, pad_id)
    world, rank = collective.world_size, collective.rank
    share = len(yardstick.rollouts) // world
    yardstick.rollouts = yardstick.rollouts[rank * share:(rank + 1) * share]
    return yardstick


def make_learner(config: SAOConfig, replay_address: str, variables_address: str,
                 publisher_token: str, run_dir: Optional[str] = None, auth_token: str = "",
                 rank: int = 0, group_address: str = "", rollout_secret: str = ""):
    """A learner node (rank `rank` of config.learners; `group_address` is the learner group's
    rendezvous node). It resumes when run_dir holds a learner checkpoint or journal (a restart
    after a crash, or --resume): weights, critic, optimisers, version, counters and RNG state
    from the newest checkpoint, then the rollouts sampled after it from its journal
    (learner/journal.py), so the steps lost in the crash are redone exactly."""
    setup_process(config, offset=10_000 + rank)
    if config.learners == 1:
        return _build_learner(config, replay_address, variables_address, publisher_token,
                              run_dir, auth_token, rollout_secret)
    return LearnerRank(config, replay_address, variables_address, publisher_token, run_dir,
                       auth_token, rollout_secret, rank, group_address)


def _build_learner(config: SAOConfig, replay_address: str, variables_address: str,
                   publisher_token: str, run_dir: Optional[str], auth_token: str,
                   rollout_secret: str, collective=None):
    import torch

    from sao_actor_learner.learner import distributed
    from sao_actor_learner.learner import journal as journal_lib
    from sao_actor_learner.models import checkpoint as ckpt
    from sao_actor_learner.models import lora
    from sao_actor_learner.observers.trackers import make_metrics_logger
    from sao_actor_learner.variables import VariablePublisher

    collective = collective or distributed.SINGLE
    run_dir = run_dir or config.run_dir
    root = os.path.join(run_dir, "checkpoints")
    resume = journal_lib.ResumePoint(root, rank=collective.rank)
    lora_spec = lora.LoraSpec.from_config(config)
    # With LoRA the base weights always come from --model, the adapters from the checkpoint.
    policy, tokenizer = ckpt.load_policy(config.model if lora_spec else
                                         resume.checkpoint or config.model)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    policy.to(device)
    # A resumed learner's critic weights come from its checkpoint (resume.restore).
    critic = make_critic(config, policy, collective)
    lora.prepare_learner_policy(policy, lora_spec, resume.checkpoint, config.model)
    from sao_actor_learner.models.value import base_model_of
    distributed.prepare_module(policy, config.learner_strategy, collective,
                               layers=getattr(base_model_of(policy), "layers", ()))
    learner = assemble_learner(
        config, policy, critic,
        source=resume.reader(lambda on_fetched: _learner_reader(
            config, replay_address, on_fetched, rollout_secret, tokenizer.vocab_size)),
        publisher=VariablePublisher(variables_address, publisher_token,
                                    **variables_client_security(config, auth_token),
                                    **publisher_shm(config, run_dir))
        if collective.is_main else None,
        serialize=ckpt.state_dict_to_buffers,   # streamed without a joined copy
        logger=make_metrics_logger(config, run_dir, "learner") if collective.is_main else None,
        tokenizer=tokenizer, checkpoint_root=root,
        token_limit=ckpt.token_limit(policy, tokenizer), pad_id=tokenizer.pad_id,
        collective=collective,
        evaluation=make_in_learner_evaluation(config, run_dir)
        if config.evaluator == "in_learner" and collective.is_main else None)
    resume.restore(learner)
    return learner


def _learner_reader(config: SAOConfig, replay_address: str, on_fetched, rollout_secret: str,
                    vocab_size: int):
    """The learner's replay reader: it checks every item (columns, ranges, the run's
    signature), drops and counts bad ones, and hands each good rollout to the journal
    (`on_fetched`) as soon as it has it."""
    from sao_actor_learner.replay import RolloutReader
    from sao_actor_learner.replay.validation import RolloutSigner, RolloutVerifier
    from sao_actor_learner.replay.loss import loss_detector
    verifier = RolloutVerifier(RolloutSigner(rollout_secret), vocab_size,
                               config.max_sequence_length)
    return RolloutReader(replay_address, on_fetched=on_fetched, verifier=verifier,
                         loss_detector=loss_detector(config.replay_loss_timeout_s, config.learners))


class LearnerRank(core.Worker):
    """A rank of a learner group (a core.Worker): joins the group, then builds and runs its
    learner. The group forms in run() because every rank must be up before any returns."""

    def __init__(self, config: SAOConfig, replay_address: str, variables_address: str,
                 publisher_token: str, run_dir: Optional[str], auth_token: str,
                 rollout_secret: str, rank: int, group_address: str):
        if not group_address:
            raise ValueError("a learner group rank needs the group's rendezvous address")
        self._args = (config, replay_address, variables_address, publisher_token, run_dir,
                      auth_token, rollout_secret)
        self.rank, self.group_address = rank, group_address
        self.learner = None
        self._stopped = False

    def run(self) -> None:
        from sao_actor_learner.learner import distributed
        config = self._args[0]
        collective = distributed.init_process_group(self.rank, config.learners,
                                                    self.group_address,
                                                    timeout_s=config.collective_timeout_s)
        self.learner = _build_learner(*self._args, collective=collective)
        if self._stopped:
            return
        self.learner.run()

    def stop(self) -> None:
        self._stopped = True
        if self.learner is not None:
            self.learner.stop()


def make_learner_group_store(config: SAOConfig, port: int = 0):
    """The learner group's rendezvous node (config.learners > 1)."""
    return LearnerGroupStore(config, port)


class LearnerGroupStore(core.Worker):
    """The learner group's rendezvous node (a core.Worker): a TCP store on its port."""

    def __init__(self, config: SAOConfig, port: int = 0, host: str = "127.0.0.1"):
        import threading

        from sao_actor_learner.learner import distributed
        self._store = distributed.serve_store(host, port, config.collective_timeout_s)
        self._stop = threading.Event()

    def run(self) -> None:
        self._stop.wait()

    def stop(self) -> None:
        self._stop.set()


def make_actor(config: SAOConfig, actor_id: int, replay_address: str, variables_address: str,
               run_dir: Optional[str] = None, auth_token: str = "", rollout_secret: str = "",
               wrap_engine=None):
    """An actor node. Its spool (run_dir/spool/actor_<id>, or a temporary folder without
    config.actor_spool) keeps every rollout until the learner acknowledges it; its writer signs
    every item with the run's `rollout_secret`. `wrap_engine(engine) -> engine` puts something
    around the engine (a log, a fault injector)."""
    setup_process(config, offset=actor_id + 1)
    import tempfile

    import numpy as np

    from sao_actor_learner.actors.actor import Actor
    from sao_actor_learner.actors.delays import make_delay_sampler
    from sao_actor_learner.actors.spool import RolloutSpool, spool_dir
    from sao_actor_learner.models import checkpoint as ckpt
    from sao_actor_learner.replay import RolloutWriter
    from sao_actor_learner.replay.validation import RolloutSigner
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
    signer = RolloutSigner(rollout_secret) if rollout_secret else None
    return Actor(
        actor_id, task, engine,
        variables=VariableClient(variables_address, config.variable_update_period_s,
                                 weight_transport=config.weight_transport,
                                 **variables_client_security(config, auth_token)),
        sink=RolloutWriter(replay_address, max_sequence_length=config.max_sequence_length,
                           vocab_size=engine.tokenizer.vocab_size, signer=signer),
        decode=ckpt.bytes_to_state_dict_views,  # engines copy them into the model
        params=sampling_params(config, stop_ids=engine.tokenizer.stop_ids),
        spool=RolloutSpool(directory),
        actor_batch=config.actor_batch, admission_control=config.admission_control,
        seed=config.seed, max_total_tokens=config.max_sequence_length,
        max_turns=config.max_turns, env_threads=config.env_threads,
        stats_path=os.path.join(run_dir, f"actor_{actor_id}_stats.json"),
        group_size=config.group_size, forced_staleness=config.forced_staleness,
        weight_poll_s=config.variable_update_period_s,
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


# --- the program ------------------------------------------------------------------------------------
TERMINAL_GROUPS = ("learner", "evaluator")


def make_program(config: SAOConfig, run_dir: Optional[str] = None, actor_factory=None,
                 auth_token: Optional[str] = None):
    """The SAO program: replay, variable server, learner, N actors, evaluator (a node only with
    config.evaluator="node").

    Nodes are wired only through handles. Secrets (credentials.py): the learner token (the
    variable server and the learner alone: only the learner publishes or reports progress) and
    the rollout secret (the actors and the learner alone: the learner trains on nothing
    unsigned); neither is written to config.json or logs. With config.groups only those groups
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
    token, signed = credentials.learner_token, {"rollout_secret": credentials.rollout_secret}
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
                                       run_dir, **secure, **signed))
    if config.evaluator in ("node", "record") and part.runs("evaluator"):   # else: learner, none
        with program.group("evaluator"):
            program.add_node(lp.PyNode(make_evaluator if config.evaluator == "node"
                                       else make_version_recorder, config, variables, run_dir,
                                       **secure))
    return program
