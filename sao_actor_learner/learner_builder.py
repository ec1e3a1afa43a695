"""Makes the learner side's parts from a config: the critic, the Learner from its parts, the
learner node (one process, or one rank of a learner group) and the group's rendezvous store
(builder.py wires them).

Each `make_*` function runs inside its node's own process and imports what it needs lazily: the
learner never imports the engine.
"""
from __future__ import annotations

import os
from typing import Optional

from sao_actor_learner import core
from sao_actor_learner.actor_builder import make_in_learner_evaluation, setup_process
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.services import publisher_shm, variables_client_security


def make_critic(config: SAOConfig, policy, collective=None):
    """The critic of an algorithm that needs one (sao; learner/registry.py) on `policy`'s
    device, prepared for the group: critic=separate a ValueModel of its own (from critic_model,
    else a copy of the policy's body) with critic_frozen_patterns frozen; critic=shared_trunk a
    value head on the policy's own body (call this before the policy is prepared for the group:
    the body is shared). None for the other algorithms."""
    from sao_actor_learner.learner import distributed, registry
    from sao_actor_learner.models.value import ValueModel
    if not registry.algorithm(config.algorithm).needs_critic:
        return None
    collective = collective or distributed.SINGLE
    if config.critic == "shared_trunk":
        critic = ValueModel.sharing_trunk(policy)
        distributed.prepare_module(critic.head, "ddp", collective)   # replicated, broadcast
        return critic
    critic = ValueModel.load(config.critic_model) if config.critic_model else \
        ValueModel.from_policy(policy)
    critic.freeze(config.critic_frozen_patterns)
    critic.to(critic_device(config, policy.get_input_embeddings().weight.device))
    distributed.prepare_module(critic, config.learner_strategy, collective,
                               layers=getattr(critic.body, "layers", ()))
    return critic


def critic_device(config: SAOConfig, policy_device):
    """The critic's device: --placement's critic:gpuN (its index in the learner's process) with
    critic_concurrent, else the policy's."""
    import torch

    from sao_actor_learner.config.sections import PROGRAM_GROUPS
    from sao_actor_learner.launch.placement import critic_placement
    _, gpu = critic_placement(config.placement, PROGRAM_GROUPS)
    return torch.device("cuda", gpu) if gpu is not None and config.critic_concurrent \
        else policy_device


def make_critic_update(config: SAOConfig, estimator, policy):
    """The learner's critic_worker.CriticUpdate: in sequence, or with critic_concurrent in a
    thread of its own on --placement's critic cores. A concurrent critic refuses networks with
    dropout (their draws from torch's generator would interleave differently run to run)."""
    from sao_actor_learner.config.sections import PROGRAM_GROUPS
    from sao_actor_learner.launch.placement import critic_placement
    from sao_actor_learner.learner.critic_worker import CriticUpdate, dropout_settings
    if not config.critic_concurrent:
        return CriticUpdate(estimator)
    dropout = dropout_settings(policy, estimator.critic.body)
    if dropout:
        raise ValueError(f"critic_concurrent=True with dropout in the networks "
                         f"({', '.join(dropout[:4])}): the policy's and the critic's threads "
                         "would draw from torch's generator in a varying order; use models "
                         "without dropout or drop --critic_concurrent")
    cores, _ = critic_placement(config.placement, PROGRAM_GROUPS)
    return CriticUpdate(estimator, concurrent=True, cores=cores)


def assemble_learner(config: SAOConfig, policy, critic=None, source=None, *, publisher=None,
                     serialize=None, logger=None, tokenizer=None, checkpoint_root=None,
                     token_limit=None, pad_id: int = 0, collective=None, evaluation=None):
    """The Learner of `config` from its parts: the policy trainer, the estimator of
    config.algorithm as its registry entry makes it (one that needs a critic needs `critic`,
    already frozen; with critic=shared_trunk and no `critic`, the value head is made on `policy`
    here), the sampler over `source` (whole groups for a group algorithm); each part
    gets only its section (LearnerConfig) and the few other fields it needs. `evaluation`:
    the in-process evaluation (evaluator=in_learner), or None."""
    from sao_actor_learner.config.learner import LearnerConfig
    from sao_actor_learner.learner import distributed, registry
    from sao_actor_learner.learner.estimators import make_estimator
    from sao_actor_learner.learner.learner import Learner
    from sao_actor_learner.learner.policy import PolicyTrainer
    from sao_actor_learner.learner.sampling import GroupSampler, RolloutSampler
    from sao_actor_learner.learner.value_pretraining import ValuePretraining

    collective = collective or distributed.SINGLE
    section = config.section(LearnerConfig)
    algorithm = registry.algorithm(config.algorithm)
    if critic is None and algorithm.needs_critic and config.critic == "shared_trunk":
        critic = make_critic(config, policy, collective)
    trainer = PolicyTrainer(policy, section, temperature=config.temperature, top_p=config.top_p,
                            token_limit=token_limit, collective=collective)
    estimator = make_estimator(section, critic, collective, policy_trainer=trainer)
    if algorithm.groups:
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
                   collective=collective, evaluation=evaluation,
                   critic_update=make_critic_update(config, estimator, policy))


def _critic_yardstick(config: SAOConfig, collective, pad_id: int):
    """The critic's held-out yardstick from --critic_heldout_file or the critic directory's
    own rollouts (this rank's equal share), or None (learner/value_pretraining.py)."""
    from sao_actor_learner.learner import registry
    from sao_actor_learner.learner.value_pretraining import CriticYardstick, heldout_file_of
    if not registry.algorithm(config.algorithm).needs_critic or config.critic != "separate":
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
                 rank: int = 0, group_address: str = "", rollout_secret: str = "",
                 run_id: str = ""):
    """A learner node (rank `rank` of config.learners; `group_address` is the learner group's
    rendezvous node). It resumes when run_dir holds a learner checkpoint or journal (a restart
    after a crash, or --resume): weights, critic, optimisers, version, counters and RNG state
    from the newest checkpoint, then the rollouts sampled after it from its journal
    (learner/journal.py), so the steps lost in the crash are redone exactly. `run_id`
    (run_identity.py): it resumes only from what this run wrote, and verifies items under
    this run's keys."""
    setup_process(config, offset=10_000 + rank)
    if config.learners == 1:
        return _build_learner(config, replay_address, variables_address, publisher_token,
                              run_dir, auth_token, rollout_secret, run_id)
    return LearnerRank(config, replay_address, variables_address, publisher_token, run_dir,
                       auth_token, rollout_secret, rank, group_address, run_id)


def _build_learner(config: SAOConfig, replay_address: str, variables_address: str,
                   publisher_token: str, run_dir: Optional[str], auth_token: str,
                   rollout_secret: str, run_id: str = "", collective=None):
    import torch

    from sao_actor_learner.learner import distributed
    from sao_actor_learner.learner import journal as journal_lib
    from sao_actor_learner.models import checkpoint as ckpt
    from sao_actor_learner.models import lora
    from sao_actor_learner.observers.drift_labels import label_learner_metrics
    from sao_actor_learner.observers.trackers import make_metrics_logger
    from sao_actor_learner.variables import VariablePublisher

    collective = collective or distributed.SINGLE
    run_dir = run_dir or config.run_dir
    root = os.path.join(run_dir, "checkpoints")
    resume = journal_lib.ResumePoint(root, rank=collective.rank, run_id=run_id)
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
        source=resume.reader_at_fetch(lambda on_fetched: _learner_reader(
            config, replay_address, on_fetched, rollout_secret, run_id, tokenizer.vocab_size,
            collective)),
        publisher=VariablePublisher(variables_address, publisher_token,
                                    **variables_client_security(config, auth_token),
                                    **publisher_shm(config, run_dir))
        if collective.is_main else None,
        serialize=ckpt.state_dict_to_buffers,   # streamed without a joined copy
        logger=label_learner_metrics(config, make_metrics_logger(config, run_dir, "learner"))
        if collective.is_main else None,   # with the drift knobs (observers/drift_labels.py)
        tokenizer=tokenizer, checkpoint_root=root,
        token_limit=ckpt.token_limit(policy, tokenizer), pad_id=tokenizer.pad_id,
        collective=collective,
        evaluation=make_in_learner_evaluation(config, run_dir)
        if config.evaluator == "in_learner" and collective.is_main else None)
    resume.restore(learner)
    return learner


def _learner_reader(config: SAOConfig, replay_address: str, on_fetched, rollout_secret: str,
                    run_id: str, vocab_size: int, collective):
    """The learner's replay reader: it checks every item (columns, ranges, the run's
    signature), drops and counts bad ones, and hands each good rollout to the journal
    (`on_fetched`) as soon as it has it. In a learner group the ranks count their fetches in
    one group-wide counter and rank 0 watches the table for items nobody fetched
    (replay/loss.py)."""
    from sao_actor_learner.replay import RolloutReader
    from sao_actor_learner.replay.validation import RolloutSigner, RolloutVerifier
    from sao_actor_learner.replay.loss import loss_detector
    verifier = RolloutVerifier(RolloutSigner(rollout_secret, run_id), vocab_size,
                               config.max_sequence_length)
    group = collective.world_size > 1
    return RolloutReader(
        replay_address, on_fetched=on_fetched, verifier=verifier,
        loss_detector=loss_detector(config.replay_loss_timeout_s, judge=collective.is_main),
        fetch_counter=(lambda n: collective.counter_total("replay_fetched", n)) if group else None)


class LearnerRank(core.Worker):
    """A rank of a learner group (a core.Worker): joins the group, then builds and runs its
    learner. The group forms in run() because every rank must be up before any returns."""

    def __init__(self, config: SAOConfig, replay_address: str, variables_address: str,
                 publisher_token: str, run_dir: Optional[str], auth_token: str,
                 rollout_secret: str, rank: int, group_address: str, run_id: str = ""):
        if not group_address:
            raise ValueError("a learner group rank needs the group's rendezvous address")
        self._args = (config, replay_address, variables_address, publisher_token, run_dir,
                      auth_token, rollout_secret, run_id)
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
