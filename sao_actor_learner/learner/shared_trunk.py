"""A value head on the policy's trunk (critic=shared_trunk; docs/METHOD.md section 6, the
shared-trunk option, not SAO's critic): `SharedTrunkGAE` and the joint loss it adds to the
policy step (`JointValueLoss`, a policy.JointLoss).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from absl import logging

from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.learner import distributed, losses, minibatches
from sao_actor_learner.learner.critic_gae import CriticGAE, aligned_values, gae_function
from sao_actor_learner.learner.estimator_base import Estimate
from sao_actor_learner.learner.policy import autocast, gather_rows
from sao_actor_learner.models.value import ValueModel
from sao_actor_learner.types import Batch


class SharedTrunkGAE(CriticGAE):
    """Values from a value head on the policy's trunk, trained jointly with the policy
    (config critic=shared_trunk; docs/METHOD.md section 6, the shared-trunk option).

    `estimate`: when the policy step is one optimizer step on one micro-batch (policy_minibatches
    1, the batch within micro_batch_tokens) and the policy trainer is given, ONE forward of the
    policy with gradient gives the log-probs, the hidden state and from it the values; the
    advantages come from those values (detached) and the policy step reuses the forward (its
    loss, its backward), so a learner step runs the trunk once forward and once backward.
    Otherwise CriticGAE's: a forward of the trunk without gradient for the values, then the
    policy step's own forwards. Both give the same numbers. `joint_loss` is what the policy
    step adds to each micro-batch's policy loss: value_loss_coef x the value loss of the head
    on the same hidden state the LM head reads (one forward, one backward), so the trunk's
    gradient is the policy gradient plus value_loss_coef x the value-loss gradient (both losses
    divided by the batch's action tokens; the sum clipped to max_grad_norm with the policy's
    other gradients). The head has its own AdamW (critic_lr), gradients summed over the group
    and clipped to max_grad_norm apart from the policy's, and steps with every policy optimizer
    step. `update` then runs the other K-1 critic steps (critic_updates K; the joint step is the
    first): steps of the head alone on the hidden states the policy step computed (detached,
    so the trunk does not move and no forward of the trunk is run again).

    Args:
      critic: ValueModel.sharing_trunk(policy) (its body is the policy's).
      config: the learner section.
      collective: the learner group.
      policy_trainer: the PolicyTrainer of the same policy, for the one-pass estimate; None:
        always the two-pass one.
    """

    def __init__(self, critic: ValueModel, config: LearnerConfig,
                 collective: distributed.Collective = distributed.SINGLE,
                 policy_trainer=None):
        if not critic.shares_trunk:
            raise ValueError("SharedTrunkGAE needs ValueModel.sharing_trunk(policy): a head on "
                             "the policy's own body")
        self.critic = critic
        self.config = config
        self.collective = collective
        self.params = list(critic.head.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=config.critic_lr, betas=(0.9, 0.999),
                                           weight_decay=0.0)
        self.nonfinite_skipped = 0
        self._gae = gae_function(config)
        self._trainer = policy_trainer
        # The trunk's gradient checkpointing is the policy trainer's (the same module).

    def one_pass(self, batch: Batch) -> bool:
        """Whether the policy step will run one forward over the whole batch (see above)."""
        return (self._trainer is not None and self.config.policy_minibatches == 1 and
                len(minibatches.micro_batch_groups(batch.lengths.tolist(),
                                                   self.config.micro_batch_tokens,
                                                   self.config.micro_batch_layout)) == 1)

    def estimate(self, batch: Batch) -> Estimate:
        if not self.one_pass(batch):
            return super().estimate(batch)
        self._trainer.policy.train()               # as the policy step's own forward would be
        # With gradient: the policy step's forward (and its token entropies, for the metrics).
        logp, hidden, entropy = self._trainer.forward_and_entropy(batch)
        with torch.no_grad():
            raw = self.head_values(hidden)
        estimate = self._estimate_from(batch, *aligned_values(raw, batch))
        estimate.forward_cache = (logp, hidden, entropy)
        return estimate

    def _keeps_forward(self, batch: Batch) -> bool:
        """Never CriticGAE's kept critic forward: the trunk's one-pass forward (`estimate`)
        is this estimator's reuse, and its forward_cache holds that."""
        return False

    def head_values(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, w] float32 raw values of the head on the trunk's hidden state [b, w, H]."""
        with autocast(self.config.dtype, hidden.device):
            return self.critic.head(hidden).squeeze(-1).float()

    def joint_loss(self, batch: Batch, estimate: Estimate) -> "JointValueLoss":
        return JointValueLoss(self, batch, estimate)

    def update(self, batch: Batch, estimate: Estimate) -> Dict[str, float]:
        """The K-1 head-only steps after the joint one (see the class docstring); statistics."""
        joint = estimate.joint
        if joint is None or not joint.steps:
            raise ValueError("critic=shared_trunk trains its value head inside the policy step; "
                             "a critic-only step (value pretraining, warm-up) needs "
                             "critic=separate")
        for _ in range(self.config.critic_updates - 1):
            self._head_step(batch, estimate, joint)
        t = gather_rows(self.collective, {"values": estimate.values, "returns": estimate.returns,
                                          "last": joint.recomputed, "mask":
                                          batch.action_mask.float()})
        _, first = losses.value_loss(t["values"], t["returns"], t["mask"])
        _, last = losses.value_loss(t["last"], t["returns"], t["mask"])
        finite = [n for n in joint.norms if n == n and n != float("inf")]
        return {"value_loss": first["value_loss"],
                "explained_variance": first["explained_variance"],
                "value_loss_last": last["value_loss"],
                "critic_grad_norm": sum(finite) / len(finite) if finite else float("nan"),
                "critic_nonfinite_skipped": self.nonfinite_skipped}

    def _head_step(self, batch: Batch, estimate: Estimate, joint: "JointValueLoss") -> None:
        """One optimizer step of the head alone on the policy step's hidden states."""
        self.optimizer.zero_grad(set_to_none=True)
        n_actions = self.collective.sum([float(batch.action_mask.sum())])[0]
        loss_total = 0.0
        for rows, hidden, mask in joint.features:
            loss, values = self.micro_value_loss(self.head_values(hidden), rows, mask, estimate,
                                                 n_actions)
            loss.backward()
            loss_total += float(loss.detach())
            joint.recomputed[rows, :values.shape[1]] = values.detach()
        joint.norms.append(self.reduce_and_step(loss_total, "value-head"))

    def state_dict(self) -> dict:
        # The trunk is the policy's (saved with it); only the head and its optimizer are ours.
        return {"value_head": {k: v.detach().cpu() for k, v in
                               self.critic.head.state_dict().items()},
                "value_head_opt": self.optimizer.state_dict(),
                "nonfinite_skipped": self.nonfinite_skipped}

    def load_state_dict(self, state: dict) -> None:
        if state.get("value_head") is None:
            raise ValueError("the checkpoint has no shared-trunk value head (its critic is "
                             "separate, or it is of another algorithm); resume with the same "
                             "--critic and --algorithm")
        self.critic.head.load_state_dict(state["value_head"])
        self.optimizer.load_state_dict(state["value_head_opt"])
        self.nonfinite_skipped = int(state.get("nonfinite_skipped", 0))


class JointValueLoss:
    """SharedTrunkGAE's policy.JointLoss for one batch: the value loss of the head on the
    trunk's hidden state, against the targets and old values of `estimate`; records the values
    it computed (the last minibatch's for each row) and the head's gradient norms."""

    def __init__(self, owner: SharedTrunkGAE, batch: Batch, estimate: Estimate):
        self.owner = owner
        self.estimate = estimate
        self._cache = estimate.forward_cache   # used once, by the whole-batch micro-batch
        estimate.forward_cache = None
        self.recomputed = torch.zeros(batch.tokens.shape, dtype=torch.float32,
                                      device=batch.tokens.device)
        self.norms: list = []
        self.steps = 0
        self._loss_total = 0.0
        # (rows, hidden detached, action mask) of every micro-batch, for the head-only steps.
        self.features: list = []
        self._keep_features = owner.config.critic_updates > 1
        estimate.joint = self

    def zero_grad(self) -> None:
        self.owner.optimizer.zero_grad(set_to_none=True)
        self._loss_total = 0.0

    def cached_forward(self, rows: torch.Tensor, micro: Batch) -> Optional[tuple]:
        """The estimate's (log-probs, hidden, entropy) when `micro` is the whole batch it came
        from."""
        cache, self._cache = self._cache, None
        if cache is None or cache[0].shape != micro.tokens.shape or not torch.equal(
                rows.cpu(), torch.arange(cache[0].shape[0])):
            return None
        return cache

    def loss(self, rows: torch.Tensor, micro: Batch, hidden: torch.Tensor,
             normalizer: float) -> torch.Tensor:
        loss, values = self.owner.micro_value_loss(self.owner.head_values(hidden), rows,
                                                   micro.action_mask, self.estimate, normalizer)
        self._loss_total += float(loss.detach())
        self.recomputed[rows, :values.shape[1]] = values.detach()
        if self._keep_features:
            self.features.append((rows, hidden.detach(), micro.action_mask))
        return self.owner.config.value_loss_coef * loss

    def reduce_and_clip(self) -> list:
        owner = self.owner
        distributed.all_reduce_gradients(owner.params, owner.collective)
        norm = distributed.clip_grad_norm(owner.params, owner.config.max_grad_norm,
                                          owner.collective)
        self.norms.append(norm)
        return [owner.collective.sum([self._loss_total])[0], norm]

    def step(self) -> None:
        self.owner.optimizer.step()
        self.steps += 1

    def skip(self) -> None:
        self.owner.optimizer.zero_grad(set_to_none=True)
        self.owner.nonfinite_skipped += 1
        self.steps += 1
        logging.warning("value-head step skipped with the policy step (non-finite)")
