"""The learner's critic-only phase and its held-out yardstick (docs/METHOD.md, value
pretraining and "Measuring the critic").

`ValuePretraining.run(learner)`: before the first policy step, the learner draws a budget of the
initial policy's rollouts from replay (`Learner.draw_critic_only`: they count as admission
credit and are acknowledged like any other; the version does not move), splits off a held-out
part by prompt (no prompt text on both sides, on any rank: critic/fit.split_heldout) and fits
the critic on the rest with critic/fit.py (epochs of minibatches at `value_pretrain_lr`,
stopping on a held-out plateau or `value_pretrain_min_ev`, the best parameters kept). Every
evaluation is a metrics row of kind "value_pretrain".

`CriticYardstick`: a fixed set of held-out rollouts (the pretraining's held-out part, or the
rollouts a value-pretrained critic directory keeps beside it) on which the critic's explained
variance is measured at version 0, every `critic_eval_every` versions and at the end: metrics
rows of kind "critic_eval", beside the in-batch EV of every step. The set was sampled by the
initial policy, so later measurements are of a drifting policy's critic on old data: a fixed
yardstick, not the EV of the rollouts being trained on.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Dict, List, Optional, Sequence

from absl import logging

from sao_actor_learner.critic import fit as fit_lib
from sao_actor_learner.critic.rollout_set import load_rollouts
from sao_actor_learner.types import Rollout

# A value-pretrained critic directory (programs/pretrain_critic.py) keeps its held-out
# rollouts under this name.
HELDOUT_ROLLOUTS_FILE = "heldout_rollouts.npz"


@dataclasses.dataclass(frozen=True)
class ValuePretraining:
    """Value pretraining's budget and fit (the value_pretrain_* options)."""
    rollouts: int
    lr: float
    heldout: float = 0.2
    settings: fit_lib.FitSettings = fit_lib.FitSettings()

    @classmethod
    def from_config(cls, config) -> Optional["ValuePretraining"]:
        if not config.value_pretrain_rollouts:
            return None
        return cls(rollouts=config.value_pretrain_rollouts, lr=config.value_pretrain_lr,
                   heldout=config.value_pretrain_heldout,
                   settings=fit_lib.FitSettings(
                       max_epochs=config.value_pretrain_epochs,
                       minibatch_size=config.value_pretrain_minibatch,
                       patience=config.value_pretrain_patience,
                       target_ev=config.value_pretrain_min_ev, seed=config.seed))

    def run(self, learner) -> Dict[str, float]:
        """Draws the budget, fits the critic, returns the fit's summary ({} when stopped
        before the budget was drawn)."""
        world = learner.collective.world_size
        rollouts = learner.draw_critic_only(int(math.ceil(self.rollouts / world)))
        if learner.stopped:
            return {}
        train, held = fit_lib.split_heldout(rollouts, self.heldout, self.settings.seed,
                                            gather=learner.collective.gather_objects)
        estimator = learner.estimator
        lrs = [g["lr"] for g in estimator.optimizer.param_groups]
        for g in estimator.optimizer.param_groups:
            g["lr"] = self.lr
        try:
            result = fit_lib.fit(estimator, train, held, self.settings, learner.pad_id,
                                 log=lambda row: learner.log({"kind": "value_pretrain",
                                                              **row}),
                                 should_stop=lambda: learner.stopped)
        finally:
            for g, lr in zip(estimator.optimizer.param_groups, lrs):
                g["lr"] = lr
        summary = {**result.summary(), "rollouts": len(rollouts) * world}
        learner.log({"kind": "value_pretrain_done", **summary})
        logging.info("value pretraining: %s", summary)
        return {"summary": summary, "heldout": held}


class CriticYardstick:
    """The critic's explained variance on a fixed held-out rollout set (module docstring)."""

    def __init__(self, rollouts: Sequence[Rollout], every: int, pad_id: int):
        self.rollouts: List[Rollout] = list(rollouts)
        self.every = every
        self.pad_id = pad_id
        self.measured: Dict[int, float] = {}

    @classmethod
    def from_file(cls, path: str, every: int, pad_id: int) -> "CriticYardstick":
        rollouts, _ = load_rollouts(path)
        return cls(rollouts, every, pad_id)

    def due(self, version: int, final: bool = False) -> bool:
        return bool(self.rollouts) and version not in self.measured and (
            final or version == 0 or (self.every > 0 and version % self.every == 0))

    def measure(self, estimator, version: int) -> Dict[str, float]:
        out = fit_lib.heldout_metrics(estimator, self.rollouts, self.pad_id)
        self.measured[version] = out["heldout_ev"]
        return {"critic_heldout_ev": out["heldout_ev"],
                "critic_heldout_value_loss": out["heldout_value_loss"],
                "critic_heldout_rollouts": len(self.rollouts)}


def heldout_file_of(critic_model: str, explicit: str = "") -> str:
    """The held-out rollout file the learner measures its critic on: `explicit`, else the
    critic directory's own, else "" (then the value pretraining's held-out part, if any)."""
    if explicit:
        return explicit
    if critic_model and os.path.exists(os.path.join(critic_model, HELDOUT_ROLLOUTS_FILE)):
        return os.path.join(critic_model, HELDOUT_ROLLOUTS_FILE)
    return ""
