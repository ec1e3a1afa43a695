"""The SAO learner (SAO.md sections 2-6), in the order one step runs:

  1. sample B rollouts from the FIFO table; drop (and count) any staler than max_staleness;
  2. critic values (no grad) -> skip-observation GAE: policy advantages with length-adaptive
     lambda, critic targets with lambda_critic;
  3. one policy step on the DIS loss against the rollout log-probs (no old-policy recompute);
  4. K critic steps on the same batch, values recomputed each time, attention frozen;
  5. version += 1, publish the weights, log the step.

`update()` is the math on a collated batch and needs no replay or network, so tests drive it
directly; `step()` and `run()` add sampling, publishing and logging.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from absl import logging

from sao_actor_learner import core, kernels
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.learner import advantages as adv_lib
from sao_actor_learner.learner import losses, minibatches
from sao_actor_learner.models.checkpoint import sync_state_dict
from sao_actor_learner.models.value import base_model_of
from sao_actor_learner.types import Batch, Rollout, collate

def _gae_function(mode: str, backend: str):
    """The advantage estimator for config.gae; skip-observation GAE runs as a kernel."""
    if mode == "skip_observation":
        return functools.partial(kernels.skip_observation_gae, backend=backend)
    if mode == "standard":
        return adv_lib.token_level_gae
    raise ValueError(f"gae={mode!r}: must be skip_observation or standard")


def _grad_norm_and_clip(params, max_norm: float) -> float:
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


class SAOLearner(core.Worker, core.VariableSource):
    """Trains a policy and its critic with SAO on rollouts sampled from replay.

    Args:
      config: the run configuration.
      policy: a Hugging Face causal LM (the warm start).
      critic: a `models.value.ValueModel`, already frozen as configured.
      reader: something with `sample(n, timeout_s) -> List[Rollout]` and `queue_size()`.
      publisher: something with `publish(version, payload_bytes, dropped_total)`; None: no publish.
      serialize: state_dict -> bytes for the publisher.
      logger: something with `write(dict)`; None: no logging.
      checkpoint_fn: called as checkpoint_fn(learner, step) to save; None: no checkpoints.
      pad_id: the id padding batches.
      token_limit: log-probs are over the LM head's first token_limit rows (the ids the
        tokenizer has; engines never sample the others); None: all rows.
    """

    def __init__(self, config: SAOConfig, policy: torch.nn.Module, critic: torch.nn.Module,
                 reader=None, publisher=None, serialize: Optional[Callable[[dict], bytes]] = None,
                 logger=None, checkpoint_fn=None, pad_id: int = 0,
                 token_limit: Optional[int] = None):
        self.config = config
        self._token_limit = token_limit
        self.policy = policy
        self.critic = critic
        self._reader = reader
        self._publisher = publisher
        self._serialize = serialize
        self._logger = logger
        self._checkpoint_fn = checkpoint_fn
        self._pad_id = pad_id
        self.policy_opt = torch.optim.AdamW(policy.parameters(), lr=config.policy_lr,
                                            betas=(0.9, 0.999), weight_decay=0.0)
        self.critic_opt = None if critic is None else torch.optim.AdamW(  # None: critic-free
            [p for p in critic.parameters() if p.requires_grad], lr=config.critic_lr,
            betas=(0.9, 0.999), weight_decay=0.0)
        self.version = 0                 # learner steps done = policy version
        self.dropped_stale = 0           # rollouts dropped for staleness, in total
        self.pretrain_consumed = 0       # rollouts consumed by value pretraining
        self.rollouts_trained = 0
        self._stop = threading.Event()
        self._gae = _gae_function(config.gae, config.kernel_backend)
        self._start_time = time.time()
        # Resuming (issue 7, learner/journal.py).
        self.pretrain_done = False       # value pretraining finished (not redone on resume)
        self.resumed_from: Optional[int] = None   # version of the checkpoint resumed from
        self.resume_publish_conflicts = 0  # republished versions the server refused (diverged)

    # --- core interfaces ------------------------------------------------------------------------
    def get_variables(self) -> Tuple[int, dict]:
        return self.version, sync_state_dict(self.policy)

    # --- checkpoints and resuming (issue 7) -----------------------------------------------------
    # Attributes in which subclasses keep training state between steps (the critic-free
    # baselines' trackers, GRPO's group assembler): saved with the checkpoint when present.
    resume_attributes: Tuple[str, ...] = ("baseline", "assembler")

    def learner_state(self) -> dict:
        """Everything but the policy weights that a resumed learner needs to continue exactly:
        critic, optimisers, version, counters, RNG states and subclass state."""
        import pickle
        import random
        return {
            "critic": self.critic.state_dict() if self.critic is not None else None,
            "policy_opt": self.policy_opt.state_dict(),
            "critic_opt": self.critic_opt.state_dict() if self.critic_opt is not None else None,
            "version": self.version, "dropped_stale": self.dropped_stale,
            "pretrain_consumed": self.pretrain_consumed,
            "rollouts_trained": self.rollouts_trained, "pretrain_done": self.pretrain_done,
            # For accounting: rollouts the reader took from replay that no step has used yet
            # (lost if the learner ends now; see learner/journal.py for the data position).
            "reader_buffered": getattr(self._reader, "buffered", 0),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                    "python": random.getstate()},
            "extra": pickle.dumps({k: getattr(self, k) for k in self.resume_attributes
                                   if hasattr(self, k)}),
        }

    def restore(self, state: dict) -> None:
        """Loads `learner_state()` output (the policy weights are loaded separately)."""
        import pickle
        import random
        if (state.get("critic") is None) != (self.critic is None):
            raise ValueError("the checkpoint's critic does not match this learner (a checkpoint "
                             "of another algorithm?); resume with the same --algorithm")
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_opt.load_state_dict(state["critic_opt"])
        self.policy_opt.load_state_dict(state["policy_opt"])
        self.version = int(state["version"])
        self.dropped_stale = int(state["dropped_stale"])
        self.pretrain_consumed = int(state.get("pretrain_consumed", 0))
        self.rollouts_trained = int(state["rollouts_trained"])
        self.pretrain_done = bool(state.get("pretrain_done", self.version > 0))
        rng = state.get("rng")
        if rng:
            torch.set_rng_state(rng["torch"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
        for key, value in pickle.loads(state["extra"]).items() if state.get("extra") else ():
            setattr(self, key, value)
        self.resumed_from = self.version

    def stop(self) -> None:
        self._stop.set()

    # --- the math ---------------------------------------------------------------------------------
    def compute_advantages(self, batch: Batch) -> Dict[str, torch.Tensor]:
        """Critic values (no grad) and GAE for a batch: advantages, returns, values, lambdas."""
        cfg = self.config
        with torch.no_grad():
            values = self.critic.values_for_tokens(batch.tokens, batch.attention_mask)
        mask = batch.action_mask
        n_actions = mask.sum(1)
        if cfg.adaptive_lambda:
            lam_policy = adv_lib.length_adaptive_lambda(n_actions, cfg.lambda_alpha)
        else:
            lam_policy = torch.full_like(n_actions, cfg.lambda_policy)
        advantages, _ = self._gae(batch.rewards, values, mask, cfg.gamma, lam_policy)
        _, returns = self._gae(batch.rewards, values, mask, cfg.gamma, cfg.lambda_critic)
        if cfg.normalize_advantages:
            advantages = adv_lib.masked_whiten(advantages, mask)
        return {"advantages": advantages, "returns": returns, "values": values,
                "lambda_policy": lam_policy}

    def policy_logprobs(self, batch: Batch) -> torch.Tensor:
        """log pi_theta(x_t | x_<t) at every position, with the rollouts' sampling temperature.

        With config.fused_logprobs the LM head runs inside `kernels.fused_logprobs` on the last
        hidden states, so the [B, T, V] logits are never materialised; else the plain way.
        """
        cfg = self.config
        head = self.policy.get_output_embeddings()
        if cfg.fused_logprobs and getattr(head, "bias", None) is None:
            body = base_model_of(self.policy)
            hidden = body(input_ids=batch.tokens, attention_mask=batch.attention_mask).last_hidden_state
            weight = head.weight if self._token_limit is None else \
                head.weight[:self._token_limit]
            picked = kernels.fused_logprobs(hidden[:, :-1], weight, batch.tokens[:, 1:],
                                            temperature=cfg.temperature,
                                            backend=cfg.kernel_backend)
            return torch.cat([torch.zeros_like(picked[:, :1]), picked.float()], dim=1)
        logits = self.policy(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits
        if self._token_limit is not None:
            logits = logits[..., :self._token_limit]
        return losses.token_logprobs(logits, batch.tokens, cfg.temperature)

    def policy_update(self, batch: Batch, advantages: torch.Tensor) -> Dict[str, float]:
        """One policy optimizer step per minibatch (config.policy_minibatches, default 1).

        config.policy_loss picks the loss (DIS by default, against the rollout log-probs); the
        ppo_clip, tis and icepop losses take their ratio against the log-probs of the policy as
        it is before this step's first minibatch, recomputed here without gradient.
        """
        cfg = self.config
        self.policy.train()
        old_logp = None
        if cfg.policy_loss in losses.NEEDS_OLD_LOGP:
            with torch.no_grad():
                old_logp = self.policy_logprobs(batch)
        per_minibatch = []
        for rows in minibatches.row_splits(batch.size, cfg.policy_minibatches):
            whole = len(rows) == batch.size
            mb = batch if whole else minibatches.select_rows(batch, rows)
            mb_adv = advantages if whole else advantages[rows]
            mb_old = old_logp if (old_logp is None or whole) else old_logp[rows]
            logp = self.policy_logprobs(mb)
            loss, stats = self._policy_loss(mb, logp, mb_adv, mb_old)
            self.policy_opt.zero_grad(set_to_none=True)
            loss.backward()
            stats["policy_grad_norm"] = _grad_norm_and_clip(self.policy.parameters(),
                                                            cfg.max_grad_norm)
            self.policy_opt.step()
            per_minibatch.append(stats)
        return minibatches.merge_stats(per_minibatch)

    def _policy_loss(self, batch: Batch, logp: torch.Tensor, advantages: torch.Tensor,
                     old_logp: Optional[torch.Tensor]):
        """(loss, stats) of config.policy_loss; DIS runs on the kernel dispatcher."""
        cfg = self.config
        if cfg.policy_loss == "dis":
            return kernels.dis_loss(logp, batch.rollout_logp, advantages, batch.action_mask,
                                    cfg.eps_low, cfg.eps_high, cfg.loss_normalization,
                                    backend=cfg.kernel_backend)
        return losses.policy_loss(cfg.policy_loss, logp, batch.rollout_logp, advantages,
                                  batch.action_mask, old_logp, eps_low=cfg.eps_low,
                                  eps_high=cfg.eps_high, clip_low=cfg.ppo_clip_low,
                                  clip_high=cfg.ppo_clip_high, tis_cap=cfg.tis_cap,
                                  icepop_low=cfg.icepop_low, icepop_high=cfg.icepop_high,
                                  normalization=cfg.loss_normalization)

    def critic_update(self, batch: Batch, returns: torch.Tensor, old_values: torch.Tensor,
                      steps: int) -> Dict[str, float]:
        """`steps` critic optimizer steps on the same batch, recomputing values each time."""
        cfg = self.config
        self.critic.train()
        stats: Dict[str, float] = {}
        for k in range(steps):
            values = self.critic.values_for_tokens(batch.tokens, batch.attention_mask)
            loss, s = losses.value_loss(values, returns, batch.action_mask, old_values,
                                        cfg.value_clip)
            self.critic_opt.zero_grad(set_to_none=True)
            loss.backward()
            s["critic_grad_norm"] = _grad_norm_and_clip(self.critic.parameters(), cfg.max_grad_norm)
            self.critic_opt.step()
            if k == 0:
                # Explained variance of the values the advantages were computed from.
                stats["explained_variance"] = s["explained_variance"]
                stats["value_loss"] = s["value_loss"]
            stats["critic_grad_norm"] = s["critic_grad_norm"]
            stats["value_loss_last"] = s["value_loss"]
        return stats

    def update(self, batch: Batch, train_policy: bool = True) -> Dict[str, float]:
        """One SAO update on a collated batch; returns its statistics. Does not bump the version."""
        est = self.compute_advantages(batch)
        stats: Dict[str, float] = {}
        if train_policy:
            stats.update(self.policy_update(batch, est["advantages"]))
        stats.update(self.critic_update(batch, est["returns"], est["values"],
                                        self.config.critic_updates))
        mask = batch.action_mask.bool()
        stats["advantage_mean"] = float(est["advantages"][mask].mean()) if mask.any() else 0.0
        stats["lambda_policy_mean"] = float(est["lambda_policy"].mean())
        return stats

    # --- data ---------------------------------------------------------------------------------------
    def staleness_of(self, rollout: Rollout) -> int:
        return rollout.staleness(self.version)

    def sample_fresh(self, n: int) -> Tuple[List[Rollout], float, int]:
        """n rollouts no staler than max_staleness (staler ones are dropped and counted).

        Returns (rollouts, seconds spent waiting, dropped now). Returns early when stopped.
        """
        fresh: List[Rollout] = []
        waited, dropped = 0.0, 0
        while len(fresh) < n and not self._stop.is_set():
            t0 = time.time()
            got = self._reader.sample(n - len(fresh), timeout_s=1.0)
            waited += time.time() - t0
            stale = [r for r in got if self.staleness_of(r) > self.config.max_staleness]
            fresh.extend(r for r in got if self.staleness_of(r) <= self.config.max_staleness)
            if stale:
                dropped += len(stale)
                self.dropped_stale += len(stale)
                # Each drop is admission credit: without it, actors that filled their quota with
                # rollouts that are now too stale would wait for a version that never comes.
                self.publish_progress()
        return fresh, waited, dropped

    # --- publishing and the loop ------------------------------------------------------------------
    def publish(self) -> None:
        if self._publisher is None:
            return
        payload = self._serialize(sync_state_dict(self.policy))
        try:
            self._publisher.publish(self.version, payload,
                                    dropped_total=self.dropped_stale + self.pretrain_consumed)
        except Exception as e:
            # A resumed learner redoes the steps its crashed predecessor published (journal.py):
            # the server refuses versions older than its newest ("not newer") and accepts its
            # newest again only with identical weights; anything else means the redo diverged.
            code = getattr(getattr(e, "code", None), "name", "")
            if self.resumed_from is None or code != "FAILED_PRECONDITION":
                raise
            if "different payload" in str(e):
                self.resume_publish_conflicts += 1
                logging.warning("resumed learner: version %d differs from the one published "
                                "before the crash (the redo diverged): %s", self.version, e)
            else:
                logging.info("resumed learner: version %d was published before the crash",
                             self.version)

    def _log(self, row: dict) -> None:
        if self._logger is not None:
            self._logger.write(row)

    def pretrain_value(self) -> Dict[str, float]:
        """Critic-only steps on rollouts of the fixed initial policy (SAO.md section 4).

        Runs up to value_pretrain_steps steps, stopping early once explained variance reaches
        value_pretrain_min_ev. The version does not change, so the rollouts stay on-policy.
        """
        cfg = self.config
        stats: Dict[str, float] = {}
        for i in range(cfg.value_pretrain_steps):
            rollouts, _, _ = self.sample_fresh(cfg.batch_size)
            if self._stop.is_set():
                break
            self.pretrain_consumed += len(rollouts)
            batch = collate(rollouts, self._pad_id)
            stats = self.update(batch, train_policy=False)
            stats = {"value_pretrain_step": i, **stats}
            self._log({"kind": "value_pretrain", **stats})
            self.publish_progress()  # consumed rollouts count as admission credit
            if stats["explained_variance"] >= cfg.value_pretrain_min_ev:
                break
        return stats

    def publish_progress(self) -> None:
        """Re-publishes the current version (same weights) with updated admission credit.

        The variable server accepts a republish of its current version when the payload is
        identical and only refreshes dropped_total, which keeps admission open while value
        pretraining consumes rollouts without bumping the version.
        """
        self.publish()

    def step(self) -> Dict[str, float]:
        cfg = self.config
        t_start = time.time()
        replaying = getattr(self._reader, "replaying", False)   # redoing journalled steps
        rollouts, waited, dropped = self.sample_fresh(cfg.batch_size)
        if not rollouts:
            return {}
        batch = collate(rollouts, self._pad_id)
        train_policy = self.version >= cfg.critic_warmup_steps
        stats = self.update(batch, train_policy=train_policy)
        trained_version = self.version
        self.version += 1
        self.rollouts_trained += len(rollouts)
        self.publish()
        elapsed = time.time() - t_start
        stats.update(self._batch_stats(batch, rollouts, trained_version))
        stats.update({
            "step": self.version,
            "policy_version": self.version,
            "trained_policy": int(train_policy),
            "dropped_stale": self.dropped_stale,
            "dropped_stale_step": dropped,
            "learner_wait_frac": waited / max(elapsed, 1e-9),
            "step_time_s": elapsed,
            "samples_per_s": len(rollouts) / max(elapsed, 1e-9),
            "tokens_per_s": float(batch.attention_mask.sum()) / max(elapsed, 1e-9),
            "queue_size": self._reader.queue_size() if self._reader is not None else 0,
            "rollouts_trained": self.rollouts_trained,
            "wall_time_s": time.time() - self._start_time,
        })
        if self.resumed_from is not None:   # issue 7: a resumed learner's rows say so
            stats.update({"resumed_from": self.resumed_from,
                          "replayed": int(replaying),
                          "resume_publish_conflicts": self.resume_publish_conflicts})
        stats["dis_masked_frac"] = stats.get("masked_frac", 0.0)
        self._log(stats)
        if self._checkpoint_fn is not None and cfg.checkpoint_every and \
                self.version % cfg.checkpoint_every == 0:
            self._checkpoint_fn(self, self.version)
        return stats

    def _batch_stats(self, batch: Batch, rollouts: Sequence[Rollout], version: int) -> Dict[str, float]:
        mask = batch.action_mask.bool()
        token_staleness = (version - batch.versions)[mask].float()
        rollout_staleness = np.array([r.staleness(version) for r in rollouts])
        rewards = np.array([r.total_reward for r in rollouts])
        hist = np.bincount(rollout_staleness, minlength=self.config.max_staleness + 1)
        return {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "staleness_mean": float(token_staleness.mean()) if token_staleness.numel() else 0.0,
            "staleness_max": int(rollout_staleness.max()),
            "staleness_hist": hist.tolist(),
            "response_length_mean": float(mask.sum(1).float().mean()),
            "batch_size": len(rollouts),
        }

    def run(self) -> None:
        cfg = self.config
        self._start_time = time.time()
        self.publish()  # version 0: the warm start (or the version resumed from)
        if cfg.value_pretrain_steps and not self.pretrain_done:
            self.pretrain_value()
        self.pretrain_done = True
        while self.version < cfg.max_steps and not self._stop.is_set():
            self.step()
        if self._checkpoint_fn is not None and self.version > 0:
            self._checkpoint_fn(self, self.version)
        logging.info("learner finished at version %d (%d rollouts trained, %d dropped stale)",
                     self.version, self.rollouts_trained, self.dropped_stale)
