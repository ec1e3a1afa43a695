"""The critic-only phases before the first policy step (the learner module docstring).

Value pretraining (a budget of the initial policy's rollouts fitted until a held-out plateau,
learner/value_pretraining.py) and critic warm-up (`warmup_steps` critic-only steps on fresh
batches). Neither bumps the version, so the rollouts stay on-policy; the rollouts they consume
are admission credit (`consumed_without_version`), reported after each batch as small progress
messages. A resumed learner whose checkpoint was written after them skips them (`pretrain_done`).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Dict

from sao_actor_learner.types import collate

if TYPE_CHECKING:   # the learner imports this module
    from sao_actor_learner.learner.learner import Learner


def run_critic_phases(learner: Learner, stop: threading.Event) -> None:
    """Value pretraining (when configured), then the warm-up steps still to do; marks them done
    unless `stop` came first."""
    if learner.value_pretraining is not None:
        pretrain_value(learner)
    while learner.warmup_done < learner.warmup_steps and not stop.is_set():
        critic_only_step(learner, "critic_warmup", stop)
    learner.pretrain_done = not stop.is_set()


def critic_only_step(learner: Learner, kind: str, stop: threading.Event) -> Dict[str, float]:
    """One critic-only step (`kind`: the metrics row's kind) on a fresh batch; the version does
    not change. {} when stopped before a batch came."""
    rollouts, _, _ = learner.sampler.sample(learner.batch_size, learner.version, stop)
    if not rollouts:
        return {}
    stats = learner.update(collate(rollouts, learner.pad_id), train_policy=False)
    learner.critic_only_steps += 1
    learner.warmup_done += kind == "critic_warmup"
    learner.consumed_without_version += int(learner.collective.sum([len(rollouts)])[0])
    stats = {f"{kind}_step": learner.critic_only_steps, "policy_version": learner.version,
             **stats}
    learner.log({"kind": kind, **stats})
    learner.report_progress()
    return stats


def pretrain_value(learner: Learner) -> Dict[str, float]:
    """Value pretraining (learner/value_pretraining.py); its held-out part becomes the critic's
    yardstick when there is none. Returns the pretraining summary."""
    out = learner.value_pretraining.run(learner)
    if out:
        learner.value_pretrain_summary = out["summary"]
        if learner.yardstick is None:
            from sao_actor_learner.learner.value_pretraining import CriticYardstick
            learner.yardstick = CriticYardstick(out["heldout"], learner.critic_eval_every,
                                                learner.pad_id)
    return learner.value_pretrain_summary
