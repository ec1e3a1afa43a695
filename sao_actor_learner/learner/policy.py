"""The policy side of a learner step: log-probs of the sampling distribution and the policy
optimizer step, over minibatches and token-budget micro-batches, on one rank or a group.

One call of `PolicyTrainer.step(batch, advantages)`:
  for each of `policy_minibatches` slices of the batch's rows (one optimizer step each):
    the slice's loss denominator is summed over the learner group first (all its action tokens,
    the loss normalisation of docs/METHOD.md), then for each micro-batch of at most
    `micro_batch_tokens` tokens (micro_batch_layout: padded rows, or one packed row,
    learner/packing.py): log-probs (with gradient), the loss divided by that
    global denominator, backward (gradients accumulate);
    the gradients are summed over the group, clipped to `max_grad_norm`, and the optimizer
    steps, unless the loss or the gradient norm is not finite: then the gradients are dropped,
    the step is skipped and counted (`nonfinite_skipped`), and the weights stay as they were.
  With loss_normalization="kept_tokens" the gradients are rescaled once the kept count is known
  (action tokens / kept tokens), which equals dividing by the kept count from the start.
So a micro-batched (or 2-rank) step gives the parameters of the whole-batch step.

Statistics are exact batch statistics: the per-token log-probs of every micro-batch (and every
rank) are put back together and the loss function's statistics are computed once on the whole
batch (`whole_batch_stats`), with the drift metrics of `drift.py` (chi-squared, perplexity ratio,
the policy's token entropy, advantage statistics); a step whose ess, kl_rollout or chi2_token
crosses its threshold logs a warning and is counted (`drift_alarm_<name>`, config drift_alarms).

Log-probs: log pi_theta(x_t | x_<t) under the rollouts' sampling distribution (temperature and
top_p, `distributions.py`), over the first `token_limit` rows of the LM head. With
`fused_logprobs` and top_p = 1 the LM head runs inside `kernels.fused_logprobs` on the hidden
states (never an [N, V] tensor); with top_p < 1 the nucleus needs every logit of a row, computed
for a few rows at a time. dtype="bfloat16" runs the forward and backward under autocast: bf16
activations and matmuls, fp32 master weights, gradients and optimizer state. Every pass sees the
policy without dropout (models/modes.py), as the actors do.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Protocol, Sequence

import torch
from absl import logging

from sao_actor_learner import kernels
from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.distributions import sampling_logprobs
from sao_actor_learner.learner import (distributed, drift, losses, minibatches, packing,
                                       registry)
from sao_actor_learner.learner.schedules import lr_factor
from sao_actor_learner.models import modes
from sao_actor_learner.models.value import base_model_of
from sao_actor_learner.types import Batch

_NUCLEUS_ROWS = 4096   # rows of logits held at once on the top_p < 1 path
# A token outside the learner's current nucleus has log-prob -inf; it is floored here (its
# gradient is 0 either way) so every ratio stays a number: 0 against the rollout's log-prob,
# and e^0 = 1 against an old policy that also left it out.
LOGP_FLOOR = -1e4


def autocast(dtype: str, device: torch.device):
    """The autocast context of `dtype` ("bfloat16": bf16 compute; "float32": none)."""
    if dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def gather_rows(collective: distributed.Collective, tensors: Dict[str, torch.Tensor]
                ) -> Dict[str, torch.Tensor]:
    """[B, T] tensors of every rank stacked into [sum B, max T] (zero-padded on the right)."""
    if collective.world_size == 1:
        return tensors
    parts = collective.gather_objects({k: v.detach().cpu() for k, v in tensors.items()})
    width = max(p[k].shape[1] for p in parts for k in p)
    out = {}
    for key in tensors:
        padded = [torch.nn.functional.pad(p[key], (0, width - p[key].shape[1])) for p in parts]
        out[key] = torch.cat(padded, dim=0)
    return out


class JointLoss(Protocol):
    """A loss trained together with the policy loss on the policy's trunk (the shared-trunk
    value head, learner/estimators.SharedTrunkGAE). Per policy optimizer step: `zero_grad`;
    per micro-batch `loss(rows, micro, hidden, normalizer)` (rows: the micro-batch's rows in
    the whole batch; hidden: the trunk's last hidden state, with gradient), added to the policy
    loss before the one backward; then `reduce_and_clip()` sums its own parameters' gradients
    over the group, clips them and returns [its loss total, its gradient norm] for the
    finiteness check; then `step()`, or `skip()` when the step is skipped. `cached_forward(rows,
    micro)` may hand back the (log-probs, hidden[, entropy]) of a forward already run on exactly
    `micro` (with gradient; `forward_and_entropy`), which the step then uses instead of its own."""

    def zero_grad(self) -> None: ...

    def cached_forward(self, rows: torch.Tensor, micro: Batch) -> Optional[tuple]: ...

    def loss(self, rows: torch.Tensor, micro: Batch, hidden: torch.Tensor,
             normalizer: float) -> torch.Tensor: ...

    def reduce_and_clip(self) -> List[float]: ...

    def step(self) -> None: ...

    def skip(self) -> None: ...


class PolicyTrainer:
    """The policy, its AdamW optimizer and how a policy step runs (see the module docstring).

    Args:
      policy: a Hugging Face causal LM (prepared for the group's strategy).
      config: the learner section (loss, lr, minibatches, micro_batch_tokens, dtype, kernels).
      temperature, top_p: the rollouts' sampling distribution.
      token_limit: log-probs are over the first token_limit rows of the LM head; None: all.
      collective: the learner group (distributed.SINGLE for one process).
    """

    def __init__(self, policy: torch.nn.Module, config: LearnerConfig, temperature: float = 1.0,
                 top_p: float = 1.0, token_limit: Optional[int] = None,
                 collective: distributed.Collective = distributed.SINGLE):
        self.policy = policy
        self.config = config
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.token_limit = token_limit
        self.collective = collective
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.policy_lr, betas=(0.9, 0.999),
                                           weight_decay=0.0)
        self.nonfinite_skipped = 0
        self.alarms = drift.DriftAlarms(config.alarm_min_ess, config.alarm_max_kl,
                                        config.alarm_max_chi2) if config.drift_alarms else None
        self._entropy_complete = True   # every micro-batch of the step gave its entropies
        if config.gradient_checkpointing:
            policy.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        if config.micro_batch_layout == "packed":
            packing.prepare_packed_attention(base_model_of(policy), "the policy")
        self._checkpointed = modes.checkpointed_layers(policy)
        modes.train_without_dropout(policy, self._checkpointed)

    def set_learning_rate(self, version: int, total_steps: int) -> float:
        """Sets the optimizer's learning rate for the step taken at policy `version` from the
        schedule (learner/schedules.py); returns it."""
        lr = self.config.policy_lr * lr_factor(version, self.config.lr_schedule,
                                               self.config.lr_warmup_steps, total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    @property
    def device(self) -> torch.device:
        return self.policy.get_input_embeddings().weight.device

    # Log-probs -----------------------------------------------------------------------------
    def logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] float32 log pi_theta(x_t | x_<t) (position 0: 0), differentiable unless called
        under no_grad; one forward over the whole `batch`."""
        return self._forward(batch, entropy=False, with_hidden=False)[0]

    def forward(self, batch: Batch):
        """(log-probs [B, T] as `logprobs`, the trunk's last hidden state [B, T, H]): one
        forward of the policy's body, the hidden state as the LM head (and a shared value
        head) read it."""
        return self._forward(batch, entropy=False)[:2]

    def forward_and_entropy(self, batch: Batch, with_hidden: bool = True,
                            actions_only: bool = False):
        """`forward`'s (log-probs, hidden) and the entropy [B, T] (float32, no gradient, 0 at
        position 0) of the sampling distribution at each position, computed with the log-probs
        (fused: inside the kernel; top_p < 1: from the rows of logits held anyway); None when
        config.token_entropy is off. `with_hidden=False` may return None for the hidden state
        (packed micro-batches then skip putting it back into the padded layout).
        `actions_only`: log-probs and entropies at action tokens only, 0 elsewhere (the LM
        head reads only the hidden states that predict them; config logprob_positions)."""
        return self._forward(batch, entropy=self.config.token_entropy, with_hidden=with_hidden,
                             actions_only=actions_only)

    def _forward(self, batch: Batch, entropy: bool, with_hidden: bool = True,
                 actions_only: bool = False):
        cfg = self.config
        packed = packing.maybe_pack(batch, cfg.micro_batch_layout)   # None: padded rows
        with autocast(cfg.dtype, self.device):
            head = self.policy.get_output_embeddings()
            weight = head.weight if self.token_limit is None else head.weight[:self.token_limit]
            body = base_model_of(self.policy)
            if packed is None:
                tokens = batch.tokens
                hidden = body(input_ids=tokens,
                              attention_mask=batch.attention_mask).last_hidden_state
            else:
                tokens = packed.tokens
                hidden = packing.packed_hidden(body, packed)
            at = batch.action_mask[:, 1:].bool().nonzero(as_tuple=True) if actions_only \
                else None
            if at is not None and at[0].numel():   # (rows, positions - 1) of the actions
                if packed is not None:
                    hidden, packed = packed.unpack(hidden), None
                h, targets = hidden[:, :-1][at][None], batch.tokens[:, 1:][at][None]
            else:
                at, h, targets = None, hidden[:, :-1], tokens[:, 1:]
            if cfg.fused_logprobs and getattr(head, "bias", None) is None and self.top_p >= 1.0:
                w = weight.to(h.dtype) if cfg.kernel_backend != "torch" else weight
                out = kernels.fused_logprobs(h, w, targets, temperature=self.temperature,
                                             return_entropy=entropy, backend=cfg.kernel_backend)
                picked, ent = out if entropy else (out, None)
                picked = picked.float()
            else:
                picked, ent = self._nucleus_logprobs(h, head, weight, targets, entropy)
        if at is not None:   # back to [b, w - 1], 0 off the actions
            b, w = batch.tokens.shape
            picked = picked.new_zeros(b, w - 1).index_put(at, picked[0])
            ent = None if ent is None else ent.new_zeros(b, w - 1).index_put(at, ent[0])
        logp = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
        if ent is not None:
            ent = ent.detach().float()
            ent = torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)
        if packed is not None:   # back to [b, w]; first tokens were predicted across rollouts
            logp = packed.unpack(logp, zero_starts=True)
            ent = None if ent is None else packed.unpack(ent, zero_starts=True)
            hidden = packed.unpack(hidden) if with_hidden else None
        return logp, hidden, ent

    def _nucleus_logprobs(self, hidden: torch.Tensor, head: torch.nn.Module,
                          weight: torch.Tensor, targets: torch.Tensor, entropy: bool = False):
        """(log-probs of `targets` under sampling_logprobs, their distributions' entropies or
        None), a few rows of logits at a time."""
        B, T, H = hidden.shape
        flat_h, flat_t = hidden.reshape(-1, H), targets.reshape(-1)
        bias = getattr(head, "bias", None)
        out, ents = [], []
        for start in range(0, flat_h.shape[0], _NUCLEUS_ROWS):
            h = flat_h[start:start + _NUCLEUS_ROWS]
            logits = torch.nn.functional.linear(
                h, weight, None if bias is None else bias[:weight.shape[0]])
            logp = sampling_logprobs(logits, self.temperature, self.top_p)
            out.append(logp.gather(-1, flat_t[start:start + _NUCLEUS_ROWS, None])[:, 0])
            if entropy:   # -sum p log p over the nucleus (tokens outside it have p = 0)
                with torch.no_grad():
                    lp = logp.detach().float()
                    ents.append(-torch.where(torch.isfinite(lp), lp.exp() * lp,
                                             torch.zeros_like(lp)).sum(-1))
        picked = torch.cat(out).reshape(B, T).clamp(min=LOGP_FLOOR)
        return picked, torch.cat(ents).reshape(B, T) if entropy else None

    def logprobs_no_grad(self, batch: Batch) -> torch.Tensor:
        """[B, T] log-probs of the whole batch without gradient, micro-batch by micro-batch."""
        return minibatches.per_token_no_grad(batch, self.config.micro_batch_tokens,
                                             self.config.micro_batch_layout, self.logprobs)

    # The step ---------------------------------------------------------------------------------
    def step(self, batch: Batch, advantages: torch.Tensor,
             old_logp: Optional[torch.Tensor] = None,
             joint: Optional["JointLoss"] = None) -> Dict[str, float]:
        """Policy optimizer steps on `batch` (see the module docstring); returns whole-batch
        statistics (those of config.policy_loss, plus policy_grad_norm). `joint`: a loss on the
        trunk's hidden state added to every micro-batch's policy loss, whose own parameters
        step with the policy (a shared-trunk value head; JointLoss)."""
        cfg = self.config
        # Every pass of the step (old log-probs, the gradient pass) sees the policy without
        # dropout, as the actors do (models/modes.py).
        modes.train_without_dropout(self.policy, self._checkpointed)
        if registry.policy_loss(cfg.policy_loss).needs_old_logp and old_logp is None:
            old_logp = self.logprobs_no_grad(batch)
        logp_all = torch.zeros(batch.tokens.shape, dtype=torch.float32,
                               device=batch.tokens.device)
        entropy_all = torch.zeros_like(logp_all) if cfg.token_entropy else None
        self._entropy_complete = cfg.token_entropy
        norms: List[float] = []
        for rows in minibatches.row_splits(batch.size, cfg.policy_minibatches):
            mb = batch if len(rows) == batch.size else minibatches.select_rows(batch, rows)
            norms.append(self._optimizer_step(mb, rows, advantages, old_logp, logp_all, joint,
                                              entropy_all))
        if cfg.token_entropy and self.collective.world_size > 1:   # every rank, or none
            self._entropy_complete = not self.collective.max(
                [0.0 if self._entropy_complete else 1.0])[0]
        stats = self.whole_batch_stats(batch, logp_all, advantages, old_logp,
                                       entropy_all if self._entropy_complete else None)
        finite = [n for n in norms if n == n and n != float("inf")]
        stats["policy_grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
        stats["policy_minibatches"] = len(norms)
        stats["nonfinite_skipped"] = self.nonfinite_skipped
        if self.alarms is not None:
            for message in self.alarms.check(stats):
                if self.collective.is_main:
                    logging.warning("drift alarm: %s", message)
            stats.update(self.alarms.counters())
        return stats

    def _optimizer_step(self, mb: Batch, rows: Sequence[int], advantages: torch.Tensor,
                        old_logp: Optional[torch.Tensor], logp_all: torch.Tensor,
                        joint: Optional["JointLoss"] = None,
                        entropy_all: Optional[torch.Tensor] = None) -> float:
        cfg = self.config
        rows_t = torch.as_tensor(rows, device=mb.tokens.device)
        adv, old = advantages[rows_t], None if old_logp is None else old_logp[rows_t]
        n_actions = self.collective.sum([float(mb.action_mask.sum())])[0]
        self.optimizer.zero_grad(set_to_none=True)
        if joint is not None:
            joint.zero_grad()
        loss_total, kept = 0.0, 0.0
        for micro_rows in minibatches.micro_batch_groups(mb.lengths.tolist(),
                                                         cfg.micro_batch_tokens,
                                                         cfg.micro_batch_layout):
            micro = minibatches.select_rows(mb, micro_rows, trim=True)
            width = micro.tokens.shape[1]
            m = torch.as_tensor(micro_rows, device=mb.tokens.device)
            cached = None if joint is None else joint.cached_forward(rows_t[m], micro)
            logp, hidden, *rest = cached if cached is not None else \
                self.forward_and_entropy(micro, with_hidden=joint is not None,
                                         actions_only=cfg.logprob_positions == "actions")
            entropy = rest[0] if rest else None
            loss, s = self._loss(micro, logp, adv[m, :width],
                                 None if old is None else old[m, :width], n_actions)
            total = loss if joint is None else loss + joint.loss(rows_t[m], micro, hidden,
                                                                 n_actions)
            total.backward()
            loss_total += float(loss.detach())
            kept += s["num_kept_tokens"]
            logp_all[rows_t[m], :width] = logp.detach()
            if entropy_all is not None and entropy is not None:
                entropy_all[rows_t[m], :width] = entropy
            else:
                self._entropy_complete = False
        distributed.all_reduce_gradients(self.params, self.collective)
        if cfg.loss_normalization == "kept_tokens":
            kept_total = self.collective.sum([kept])[0]
            scale = n_actions / max(kept_total, 1.0)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        norm = distributed.clip_grad_norm(self.params, cfg.max_grad_norm, self.collective)
        loss_total = self.collective.sum([loss_total])[0]
        checked = [norm, loss_total]
        if joint is not None:
            checked += joint.reduce_and_clip()
        if not all(x == x and abs(x) != float("inf") for x in checked):
            self.nonfinite_skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
            if joint is not None:
                joint.skip()
            logging.warning("policy step skipped: non-finite loss %s or gradient norm %s (%d "
                            "skipped so far); the weights are unchanged", loss_total, norm,
                            self.nonfinite_skipped)
            return norm
        self.optimizer.step()
        if joint is not None:
            joint.step()
        return norm

    def _loss(self, batch: Batch, logp: torch.Tensor, advantages: torch.Tensor,
              old_logp: Optional[torch.Tensor], normalizer: Optional[float]):
        """(loss, stats) of config.policy_loss, its options from the config; a loss with a
        kernel (DIS) runs on the kernel dispatcher."""
        return losses.policy_loss(self.config.policy_loss, logp, batch.rollout_logp, advantages,
                                  batch.action_mask, old_logp, options=self.config,
                                  normalizer=normalizer, kernel=True)

    def whole_batch_stats(self, batch: Batch, logp: torch.Tensor, advantages: torch.Tensor,
                          old_logp: Optional[torch.Tensor],
                          entropy: Optional[torch.Tensor] = None) -> Dict[str, float]:
        """The loss's statistics on the whole batch of the whole group, from the detached
        per-token log-probs the step computed (the loss value included: it is the loss of the
        parameters before the step, as every micro-batch saw them), and the drift metrics
        (drift.drift_stats; token_entropy_mean when `entropy` is given; ratio_outside_band_frac
        against DIS's band whatever the loss)."""
        tensors = {"logp": logp, "rollout_logp": batch.rollout_logp.float(),
                   "advantages": advantages.float(), "mask": batch.action_mask.float()}
        if old_logp is not None:
            tensors["old_logp"] = old_logp.float()
        if entropy is not None:
            tensors["entropy"] = entropy.float()
        t = gather_rows(self.collective, tensors)
        with torch.no_grad():
            _, stats = losses.policy_loss(
                self.config.policy_loss, t["logp"], t["rollout_logp"], t["advantages"],
                t["mask"], t.get("old_logp"), options=self.config)
            stats.update(drift.drift_stats(t["logp"], t["rollout_logp"], t["advantages"],
                                           t["mask"], t.get("entropy"),
                                           band=(1.0 - self.config.eps_low,
                                                 1.0 + self.config.eps_high)))
        return stats

    # Checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The optimizer (whole, also under FSDP2: every rank must call it) and counters."""
        return {"optimizer": distributed.optimizer_state(self.policy, self.optimizer),
                "nonfinite_skipped": self.nonfinite_skipped,
                "drift_alarms": None if self.alarms is None else self.alarms.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        distributed.load_optimizer_state(self.policy, self.optimizer, state["optimizer"])
        self.nonfinite_skipped = int(state.get("nonfinite_skipped", 0))
        if self.alarms is not None:
            self.alarms.load_state_dict(state.get("drift_alarms") or {})
