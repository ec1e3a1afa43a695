"""The learner's checkpoints: what a resumed learner needs to continue exactly, and writing it.

checkpoints/step_<version>/ holds the policy as a Hugging Face model directory (with its
tokenizer; LoRA: also adapter/ in PEFT's format), learner_state.pt (`learner_state`: optimizers,
critic, estimator and every rank's sampler state, counters, loss epoch, RNG states; tensors and
plain containers only (safe_records.to_plain), read with torch.load(weights_only=True), which
executes nothing a copied or changed checkpoint holds) and
manifest.json (each file's size and sha256), fsynced and renamed into place
(learner/checkpoint_files.py). The rollout source's journal is rotated with it
(core.RolloutSource.checkpoint), so a restarted learner resumes from the newest intact one and
redoes the journalled steps exactly (learner/journal.py). Every rank of a group calls
`save_checkpoint` (it gathers); rank 0 alone writes.
"""
from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from sao_actor_learner import core
from sao_actor_learner.learner import distributed
from sao_actor_learner.learner.checkpoint_files import (LEARNER_STATE_FILE, checkpoint_path,
                                                        prune_checkpoints, write_checkpoint)
from sao_actor_learner.models.checkpoint import save_checkpoint as save_model_directory
from sao_actor_learner.models.lora import save_adapter
from sao_actor_learner.safe_records import UnsafeRecordError, from_plain, to_plain

if TYPE_CHECKING:   # the learner imports this module
    from sao_actor_learner.learner.learner import Learner


def learner_state(learner: Learner) -> dict:
    """Everything but the policy weights that a resumed learner needs to continue exactly
    (a collective: the samplers' states and the group's totals are gathered)."""
    collective, sampler, yardstick = learner.collective, learner.sampler, learner.yardstick
    learner.critic_update.settle()   # a concurrent critic's steps are done before it is read
    return {
        "version": learner.version, "policy": learner.policy_trainer.state_dict(),
        "estimator": learner.estimator.state_dict(),
        # Every rank's sampler (its share's counters, its group assembler): a collective.
        "samplers": collective.gather_objects(sampler.state_dict()),
        "critic_only_steps": learner.critic_only_steps, "warmup_done": learner.warmup_done,
        "loss_epoch": learner.loss_epoch,
        "consumed_without_version": learner.consumed_without_version,
        "rollouts_trained": learner.rollouts_trained, "pretrain_done": learner.pretrain_done,
        "value_pretrain_summary": learner.value_pretrain_summary,
        # This rank's yardstick rollouts (value pretraining's held-out part) and readings.
        "yardstick": (None if yardstick is None else
                      {"rollouts": yardstick.rollouts, "measured": dict(yardstick.measured)}),
        # The group's totals (rank 0's sampler state counts only its own share).
        "group_totals": dict(zip(("dropped", "from_future", "duplicates"), map(int, (
            collective.sum([sampler.dropped, sampler.from_future, sampler.duplicates]))))),
        # For accounting: rollouts taken from replay that no step has used yet.
        "reader_buffered": learner.source.buffered,
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                "python": random.getstate()},
    }


STATE_FORMAT = "sao-learner-state-2"


def write_learner_state(state: dict, path: str) -> None:
    """`state` (learner_state's) as tensors and plain containers (read_learner_state)."""
    torch.save({"format": STATE_FORMAT, "state": to_plain(state, keep=(torch.Tensor,))}, path)


def read_learner_state(path: str) -> dict:
    """The state `write_learner_state` wrote, loaded with torch.load(weights_only=True): a file
    that needs more (an older checkpoint's pickled objects, or a tampered one) is refused,
    naming it, without running anything it holds."""
    import pickle
    try:
        saved = torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as e:
        raise UnsafeLearnerStateError(
            f"{path} is not a learner state this version reads with torch.load("
            f"weights_only=True) ({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
            "it is not loaded, since unpickling a copied or changed file can run code (older "
            "versions wrote pickled objects there). Resume with the version that wrote it, or "
            "start a fresh run (without --resume)") from None
    if not isinstance(saved, dict) or saved.get("format") != STATE_FORMAT:
        raise UnsafeLearnerStateError(
            f"{path} is not a learner state of format {STATE_FORMAT!r}: resume with the "
            "version that wrote it, or start a fresh run (without --resume)")
    try:
        return from_plain(saved["state"])
    except UnsafeRecordError as e:
        raise UnsafeLearnerStateError(f"{path}: {e}; it is not loaded") from None


class UnsafeLearnerStateError(RuntimeError):
    """A learner_state.pt that cannot be read without running what it holds; names it."""


def restore_learner_state(learner: Learner, state: dict) -> None:
    """Loads `learner_state()` output into `learner` (the policy weights are loaded separately)
    and marks it resumed."""
    learner.estimator.load_state_dict(state["estimator"])
    learner.policy_trainer.load_state_dict(state["policy"])
    samplers, rank = state["samplers"], learner.collective.rank
    learner.sampler.load_state_dict(samplers[rank] if rank < len(samplers) else samplers[0])
    learner.version = int(state["version"])
    learner.critic_only_steps = int(state.get("critic_only_steps", 0))
    learner.warmup_done = int(state.get("warmup_done", 0))
    learner.loss_epoch = int(state.get("loss_epoch", 0))
    learner.consumed_without_version = int(state.get("consumed_without_version", 0))
    learner.rollouts_trained = int(state["rollouts_trained"])
    learner.pretrain_done = bool(state.get("pretrain_done", learner.version > 0))
    learner.value_pretrain_summary = dict(state.get("value_pretrain_summary") or {})
    yard = state.get("yardstick")
    if yard is not None and learner.yardstick is None and yard["rollouts"]:
        from sao_actor_learner.learner.value_pretraining import CriticYardstick
        learner.yardstick = CriticYardstick(yard["rollouts"], learner.critic_eval_every,
                                            learner.pad_id)
    if yard is not None and learner.yardstick is not None:
        learner.yardstick.measured.update(yard["measured"])
    if learner.collective.world_size > 1:   # the group's store counts anew: add this rank's
        learner.collective.counter_total("dropped", learner.sampler.dropped)
    rng = state.get("rng")
    if rng:
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
    learner.resumed_from = learner.version


def save_checkpoint(learner: Learner, root: str, tokenizer: Optional[core.Tokenizer],
                    keep: int) -> Optional[str]:
    """Writes `root`/step_<version>/ (the module docstring) with the journal rotated and prunes
    to the newest `keep` (0: all); every rank must call it. Returns the path (rank 0) or None.
    Sets `learner.checkpointed_version`; a second call for the same version writes nothing."""
    collective, step = learner.collective, learner.version
    path = checkpoint_path(root, step)
    if learner.checkpointed_version == step:
        return path
    weights = distributed.full_state_dict(learner.policy)   # a collective under fsdp2
    state = learner_state(learner)

    def commit() -> Optional[str]:
        collective.barrier()          # every rank's new journal segment is on disk
        if collective.is_main:
            def write(tmp: str) -> None:   # into step_<N>.tmp-<pid>, marked (run_dirs.py)
                save_model_directory(_WithStateDict(learner.policy, weights), tokenizer, tmp)
                save_adapter(learner.policy, tmp)   # LoRA: adapter/ in PEFT's format
                write_learner_state(state, os.path.join(tmp, LEARNER_STATE_FILE))
            # then manifest, fsync, rename; CheckpointWriteError naming it when the disk is
            # full (checkpoint_files.py)
            write_checkpoint(path, write)
        collective.barrier()          # the checkpoint is complete before old segments go
        return path

    result = learner.source.checkpoint(step, commit)
    learner.checkpointed_version = step
    if collective.is_main:
        prune_checkpoints(root, keep)
    return result if collective.is_main else None


class _WithStateDict:
    """`model` for save_pretrained, with `weights` (gathered on rank 0) as its state dict."""

    def __init__(self, model: torch.nn.Module, weights: dict):
        self._model, self._weights = model, weights

    def get_input_embeddings(self):
        return self._model.get_input_embeddings()

    def save_pretrained(self, path: str, **kwargs) -> None:
        self._model.save_pretrained(path, state_dict=self._weights, **kwargs)
