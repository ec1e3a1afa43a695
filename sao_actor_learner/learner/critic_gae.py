"""SAO's critic and GAE (algorithm=sao, critic=separate; docs/METHOD.md sections 6-7).

`CriticGAE`: a critic's values, skip-observation (or standard) GAE with length-adaptive lambda
for the policy and lambda_critic for the critic's targets, optional bootstrap of truncated
episodes; `update` runs K critic optimizer steps on the same batch, values recomputed each
time, attention frozen; micro-batched and summed over the learner group like the policy step.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Dict

import numpy as np
import torch
from absl import logging

from sao_actor_learner import kernels
from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.learner import advantages as adv_lib
from sao_actor_learner.learner import distributed, losses, minibatches, packing
from sao_actor_learner.learner.estimator_base import AdvantageEstimator, Estimate, whiten
from sao_actor_learner.learner.policy import autocast, gather_rows
from sao_actor_learner.models.value import ValueModel
from sao_actor_learner.types import Batch


def aligned_values(raw: torch.Tensor, batch: Batch) -> tuple:
    """(values aligned to token positions [B, T]: V(t) = raw[t-1], V(0) = 0; the value after
    each row's last token [B]) from the value model's raw outputs [B, T]."""
    aligned = torch.cat([torch.zeros_like(raw[:, :1]), raw[:, :-1]], dim=1)
    last = raw.gather(1, (batch.lengths - 1).clamp(min=0)[:, None])[:, 0]
    return aligned, last


def gae_function(config: LearnerConfig):
    """config.gae's advantage function (the Triton/torch dispatcher for skip_observation)."""
    if config.gae == "skip_observation":
        return functools.partial(kernels.skip_observation_gae, backend=config.kernel_backend)
    return adv_lib.token_level_gae


class CriticGAE(AdvantageEstimator):
    """SAO's critic and GAE (see the module docstring).

    Args:
      critic: a ValueModel, already frozen as configured and prepared for the group.
      config: the learner section.
      collective: the learner group.
    """
    has_critic = True

    def __init__(self, critic: ValueModel, config: LearnerConfig,
                 collective: distributed.Collective = distributed.SINGLE):
        self.critic = critic
        self.config = config
        self.collective = collective
        self.params = [p for p in critic.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.critic_lr, betas=(0.9, 0.999),
                                           weight_decay=0.0)
        self.nonfinite_skipped = 0
        self._gae = gae_function(config)
        if config.gradient_checkpointing:
            critic.body.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        if config.micro_batch_layout == "packed":
            packing.prepare_packed_attention(critic.body, "the critic")

    @property
    def device(self) -> torch.device:
        return self.critic.head.weight.device

    def _raw_values(self, batch: Batch) -> torch.Tensor:
        """[B, T] critic outputs (value of the state after reading x_0..x_t); a packed
        micro-batch runs as one row (learner/packing.py) and comes back as [B, T]."""
        packed = packing.maybe_pack(batch, self.config.micro_batch_layout)
        with autocast(self.config.dtype, self.device):
            if packed is None:
                return self.critic(batch.tokens, batch.attention_mask).float()
            hidden = packing.packed_hidden(self.critic.body, packed)
            return packed.unpack(self.critic.head(hidden).squeeze(-1).float())

    def values(self, batch: Batch) -> tuple:
        """(values aligned to token positions [B, T], value after each row's last token [B]),
        without gradient, micro-batch by micro-batch."""
        raw = minibatches.per_token_no_grad(batch, self.config.micro_batch_tokens,
                                            self.config.micro_batch_layout, self._raw_values)
        return aligned_values(raw, batch)

    def on_device(self):
        """The critic's CUDA device as the current one (its Triton kernels launch there), or
        nothing on CPU."""
        device = self.device
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    def estimate(self, batch: Batch) -> Estimate:
        """The advantages (on `batch`'s device; the targets and values on the critic's, which
        may be a GPU of its own: --placement critic:gpuN)."""
        home = batch.tokens.device
        with self.on_device():
            estimate = self._estimate_on_device(batch.to(self.device))
        estimate.advantages = estimate.advantages.to(home)
        return estimate

    def _estimate_on_device(self, batch: Batch) -> Estimate:
        """The advantages from the critic's values. When the first critic step can reuse it
        (`_keeps_forward`), the forward runs with gradient and is kept in the estimate's
        forward_cache (config critic_reuse_estimate_forward); the values are the same."""
        if not self._keeps_forward(batch):
            return self._estimate_from(batch, *self.values(batch))
        first = self._slices(batch)[0]   # the first critic step's rows
        micro = minibatches.select_rows(batch, first, trim=True)
        raw = self._raw_values(micro)
        full = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=raw.device)
        index = torch.as_tensor(first, device=raw.device)
        full[index, :raw.shape[1]] = raw.detach()
        rest = np.arange(len(first), batch.size)   # the later slices: no gradient (the critic
        if len(rest):                              # will have changed when they are trained)
            index = torch.as_tensor(rest, device=raw.device)
            full[index] = minibatches.per_token_no_grad(
                minibatches.select_rows(batch, rest), self.config.micro_batch_tokens,
                self.config.micro_batch_layout, self._raw_values)
        estimate = self._estimate_from(batch, *aligned_values(full, batch))
        estimate.forward_cache = (raw, first)
        return estimate

    def _slices(self, batch: Batch) -> list:
        """The rows of each of an epoch's critic optimizer steps."""
        return minibatches.row_splits(batch.size, min(self.config.critic_minibatches,
                                                      batch.size))

    def _keeps_forward(self, batch: Batch) -> bool:
        """Whether the estimate's forward of the first slice of rows is the first critic
        step's own: each step's rows are one forward (micro_batch_tokens=0), with gradient, in
        training mode (as update runs it). Only the first step's: the critic has not changed
        before it; later steps see the critic the steps before them changed."""
        cfg = self.config
        return (cfg.critic_reuse_estimate_forward and cfg.micro_batch_tokens == 0 and
                torch.is_grad_enabled() and self.critic.training and batch.size > 0)

    def _estimate_from(self, batch: Batch, values: torch.Tensor, last: torch.Tensor
                       ) -> Estimate:
        """Advantages and targets from the values [B, T] (aligned) and last values [B]."""
        cfg = self.config
        mask = batch.action_mask
        boot = None
        if cfg.bootstrap_truncated:
            boot = torch.where(batch.truncated, last, torch.zeros_like(last))
        n_actions = mask.sum(1)
        lam_policy = adv_lib.length_adaptive_lambda(n_actions, cfg.lambda_alpha) \
            if cfg.adaptive_lambda else torch.full_like(n_actions, cfg.lambda_policy)
        advantages, _ = self._gae(batch.rewards, values, mask, cfg.gamma, lam_policy, boot)
        _, returns = self._gae(batch.rewards, values, mask, cfg.gamma, cfg.lambda_critic, boot)
        if cfg.normalize_advantages:
            advantages = whiten(advantages, mask, self.collective)
        n, lam_sum = self.collective.sum([lam_policy.numel(), float(lam_policy.sum())])
        stats = {"lambda_policy_mean": lam_sum / max(n, 1),
                 "bootstrapped_rollouts": self.collective.sum(
                     [float(batch.truncated.sum()) if boot is not None else 0.0])[0]}
        return Estimate(advantages, stats, returns=returns, values=values)

    def update(self, batch: Batch, estimate: Estimate) -> Dict[str, float]:
        """K critic epochs over the batch (config.critic_updates), each of critic_minibatches
        optimizer steps on consecutive slices of the rows, values recomputed each time;
        statistics of the values the advantages came from (value_loss, explained_variance) and
        of the last values computed (value_loss_last, critic_grad_norm of the last step)."""
        with self.on_device():
            return self._update_on_device(batch.to(self.device), estimate)

    def _update_on_device(self, batch: Batch, estimate: Estimate) -> Dict[str, float]:
        cfg = self.config
        self.critic.train()
        mask = batch.action_mask
        last_values = torch.zeros(batch.tokens.shape, dtype=torch.float32,
                                  device=batch.tokens.device)
        norm = 0.0
        slices = self._slices(batch)
        kept, estimate.forward_cache = estimate.forward_cache, None   # used once
        for _ in range(cfg.critic_updates):
            for rows in slices:
                norm = self.optimizer_step(batch, estimate, rows, last_values, kept)
                kept = None
        t = gather_rows(self.collective, {"values": estimate.values, "returns": estimate.returns,
                                          "last": last_values, "mask": mask.float()})
        _, first = losses.value_loss(t["values"], t["returns"], t["mask"])
        _, last = losses.value_loss(t["last"], t["returns"], t["mask"])
        return {"value_loss": first["value_loss"],
                "explained_variance": first["explained_variance"],
                "value_loss_last": last["value_loss"], "critic_grad_norm": norm,
                "critic_nonfinite_skipped": self.nonfinite_skipped,
                "critic_optimizer_steps": cfg.critic_updates * len(slices)}

    def optimizer_step(self, batch: Batch, estimate: Estimate, rows, recomputed: torch.Tensor,
                       kept: tuple = None) -> float:
        """One critic optimizer step on the batch rows `rows` (every rank its own rows; the
        loss divided by the group's action tokens in them), micro-batched by token budget;
        writes the values it computed into `recomputed` [B, T]; returns the gradient norm.
        `kept`: (raw values with gradient, their rows) of the estimate's forward (`estimate`),
        used instead of running it again; its rows must be `rows`, in one micro-batch."""
        rows = np.asarray(rows, dtype=np.int64)
        n_actions = self.collective.sum([float(batch.action_mask[torch.as_tensor(rows)].sum())])[0]
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        lengths = batch.lengths[torch.as_tensor(rows)].tolist()
        groups = minibatches.micro_batch_groups(lengths, self.config.micro_batch_tokens,
                                                self.config.micro_batch_layout)
        kept_raw = None
        if kept is not None:
            kept_raw, kept_rows = kept
            if len(groups) != 1 or not np.array_equal(rows, kept_rows):
                raise ValueError(f"a kept critic forward of {len(kept_rows)} rows must be this "
                                 f"step's rows in one micro-batch; this step has {len(groups)} "
                                 f"micro-batches of {len(rows)} rows")
        for group in groups:
            micro = minibatches.select_rows(batch, rows[group], trim=True)
            width = micro.tokens.shape[1]
            r = torch.as_tensor(rows[group], device=batch.tokens.device)
            raw = self._raw_values(micro) if kept_raw is None else kept_raw
            loss, values = self.micro_value_loss(raw, r, micro.action_mask, estimate, n_actions)
            loss.backward()
            loss_total += float(loss.detach())
            recomputed[r, :width] = values.detach()
        return self.reduce_and_step(loss_total, "critic")

    def micro_value_loss(self, raw: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor,
                         estimate: Estimate, n_actions: float) -> tuple:
        """(value loss, values aligned to token positions) of the value model's raw outputs
        [b, w] for the batch rows `rows`, against `estimate`'s targets and old values."""
        width = raw.shape[1]
        values = torch.cat([torch.zeros_like(raw[:, :1]), raw[:, :-1]], dim=1)
        loss, _ = losses.value_loss(values, estimate.returns[rows, :width], mask,
                                    estimate.values[rows, :width], self.config.value_clip,
                                    normalizer=n_actions)
        return loss, values

    def reduce_and_step(self, loss_total: float, what: str) -> float:
        """Sums the gradients over the group, clips them, steps the optimizer unless the loss
        or the norm is non-finite (then skips and counts); returns the norm."""
        distributed.all_reduce_gradients(self.params, self.collective)
        norm = distributed.clip_grad_norm(self.params, self.config.max_grad_norm,
                                          self.collective)
        loss_total = self.collective.sum([loss_total])[0]
        if not all(x == x and abs(x) != float("inf") for x in (norm, loss_total)):
            self.nonfinite_skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
            logging.warning("%s step skipped: non-finite loss %s or gradient norm %s", what,
                            loss_total, norm)
        else:
            self.optimizer.step()
        return norm

    def state_dict(self) -> dict:
        return {"critic": distributed.full_state_dict(self.critic),
                "critic_opt": distributed.optimizer_state(self.critic, self.optimizer),
                "nonfinite_skipped": self.nonfinite_skipped}

    def load_state_dict(self, state: dict) -> None:
        if state.get("critic") is None:
            if state.get("value_head") is not None:
                raise ValueError("the checkpoint's value head is on the policy's trunk "
                                 "(critic=shared_trunk); resume with --critic=shared_trunk")
            raise ValueError("the checkpoint has no critic (a checkpoint of another "
                             "algorithm?); resume with the same --algorithm")
        self.critic.load_state_dict(state["critic"])
        distributed.load_optimizer_state(self.critic, self.optimizer, state["critic_opt"])
        self.nonfinite_skipped = int(state.get("nonfinite_skipped", 0))
