"""The learner's section of the run configuration: the algorithm, its objectives, the critic,
precision and memory, and the data-parallel learner group. Formulas and defaults: docs/METHOD.md.
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

from sao_actor_learner.config.sections import (CRITIC_FREE_BASELINES, CRITICS, DTYPES,
                                               GAE_MODES, KERNEL_BACKENDS, LEARNER_STRATEGIES,
                                               LOSS_NORMALIZATIONS, LR_SCHEDULES, Fail, Section,
                                               at_least, choice, option)
# The registered algorithms and policy losses (learner/registry.py imports only the standard
# library, so the config still validates without torch).
from sao_actor_learner.learner import registry

# learner/packing.LAYOUTS (config/ imports no torch).
MICRO_BATCH_LAYOUTS = ("padded", "packed")
LOGPROB_POSITIONS = ("actions", "all")


@dataclasses.dataclass(frozen=True)
class LearnerConfig(Section):
    """How the learner turns a batch into one policy step (and K critic steps)."""
    algorithm: str = option("sao", "sao (critic + skip-observation GAE), grpo (group-"
                            "normalised rewards), critic_free (a tracked reward baseline) or "
                            "rloo (leave-one-out group baseline); learner/registry.py.")
    policy_loss: str = option("dis", "dis (double-sided IS against rollout log-probs), "
                              "ppo_clip, tis, icepop, none (no correction), gspo (sequence-"
                              "level clipped ratio), or ppo_clip_decoupled / gspo_decoupled "
                              "(the clip against the recomputed old policy, weighted by old / "
                              "rollout policy: AReaL's decoupled PPO); learner/registry.py.")
    eps_low: float = option(0.3, "DIS keeps tokens whose ratio is >= 1 - eps_low (paper: 0.3 "
                            "math, 0.8 coding).")
    eps_high: float = option(5.0, "DIS keeps tokens whose ratio is <= 1 + eps_high (paper: 5 "
                             "math, 3 coding).")
    loss_normalization: str = option("action_tokens", "The policy loss divides by all action "
                                     "tokens of the batch, or by the kept ones (kept_tokens).")
    policy_lr: float = option(5e-5, "AdamW learning rate of the policy.")
    critic_lr: float = option(2.5e-4, "AdamW learning rate of the critic (5x the policy's, as "
                              "the public ports use).")
    lr_schedule: str = option("constant", "The policy's learning rate over max_steps: "
                              "constant, linear (to 0 at max_steps) or cosine (half a cosine "
                              "to 0 at max_steps).")
    lr_warmup_steps: int = option(0, "Policy steps of linear learning-rate warm-up before the "
                                  "schedule.")
    critic_updates: int = option(2, "K: critic epochs over the batch per policy step, each on "
                                 "recomputed values (critic=shared_trunk: the joint step plus "
                                 "K-1 steps of the head alone on the step's hidden states).")
    critic_minibatches: int = option(1, "Critic optimizer steps per epoch, on consecutive "
                                     "slices of the batch: K x this many steps per policy step "
                                     "(critic=separate).")
    critic: str = option("separate", "separate (SAO: a network of its own, attention frozen, K "
                         "steps) or shared_trunk (a value head on the policy's last hidden "
                         "state, trained with the policy loss; not SAO's critic).")
    value_loss_coef: float = option(0.5, "critic=shared_trunk: the value loss's weight against "
                                    "the policy loss in the joint loss the shared trunk learns.")
    critic_reuse_estimate_forward: bool = option(
        True, "The first of the K critic steps reuses the estimate's forward of its rows (run "
        "with gradient, kept through the policy step) instead of computing the same values "
        "again: exact, one critic forward of 1/critic_minibatches of the batch fewer per step; "
        "only when micro_batch_tokens=0 (the kept activations cost memory).")
    critic_concurrent: bool = option(
        False, "critic=separate: the K critic steps run in a thread of their own at the same "
        "time as the policy step (after the estimate, joined before the step ends: the same "
        "parameters as in sequence), on the cores or GPU --placement's critic entry names; "
        "learner/critic_worker.py.")
    critic_frozen_patterns: Tuple[str, ...] = option(
        ("self_attn", "embed_tokens", "norm"), "Regexes of critic parameters kept frozen "
        "(attention, embeddings and norms); each must match some parameter.")
    critic_warmup_steps: int = option(0, "Critic-only steps before the first policy step (they "
                                      "do not bump the version).")
    value_pretrain_rollouts: int = option(0, "Value pretraining's budget: rollouts of the "
                                          "initial policy the critic is fitted on before RL "
                                          "(epochs of minibatches, a held-out part for the "
                                          "stopping rule; critic/fit.py); 0: none.")
    value_pretrain_epochs: int = option(14, "Value pretraining: the most epochs over the "
                                        "budget.")
    value_pretrain_minibatch: int = option(16, "Value pretraining: rollouts per critic "
                                           "optimizer step.")
    value_pretrain_lr: float = option(5e-4, "Value pretraining: the critic's learning rate "
                                      "(the critic probe's choice on the dataset workload: "
                                      "docs/REPRODUCTION.md, the critic).")
    value_pretrain_patience: int = option(3, "Value pretraining stops when the held-out "
                                          "explained variance has not improved for this many "
                                          "evaluations (one per epoch).")
    value_pretrain_heldout: float = option(0.2, "Value pretraining: the budget's fraction held "
                                           "out to measure explained variance.")
    value_pretrain_min_ev: float = option(1.0, "Value pretraining stops early at this held-out "
                                          "explained variance.")
    critic_eval_every: int = option(10, "Measure the critic's explained variance on its "
                                    "fixed held-out rollouts every this many versions (and at "
                                    "version 0 and the end; metrics rows of kind critic_eval); "
                                    "0: only at the start and the end.")
    critic_heldout_file: str = option("", "The held-out rollouts (.npz, critic/rollout_set.py) "
                                      "the critic is measured on; default: the critic "
                                      "directory's heldout_rollouts.npz, else value "
                                      "pretraining's held-out part.")
    gamma: float = option(1.0, "Discount factor of the returns and of GAE (1.0: undiscounted).")
    gae: str = option("skip_observation", "skip_observation GAE (observation tokens skipped) or "
                      "standard (bootstraps through them).")
    adaptive_lambda: bool = option(True, "lambda_policy = 1 - 1 / (lambda_alpha * n) with n "
                                   "the rollout's action tokens.")
    lambda_alpha: float = option(1.5, "alpha of the length-adaptive lambda (SAO review: 1.5; "
                                 "VAPO: 0.05).")
    lambda_policy: float = option(0.95, "GAE lambda of the policy advantages when "
                                  "adaptive_lambda is off.")
    lambda_critic: float = option(1.0, "GAE lambda of the critic targets (1: Monte-Carlo "
                                  "returns).")
    normalize_advantages: bool = option(True, "Whiten advantages over the batch's action "
                                        "tokens.")
    max_grad_norm: float = option(1.0, "Gradient-norm clip of the policy and the critic.")
    value_clip: float = option(0.0, "PPO-style value clipping range; 0: off.")
    bootstrap_truncated: bool = option(False, "Bootstrap truncated episodes from the critic's "
                                       "value at the cut (otherwise they end with value 0).")
    grpo_scale_by_std: bool = option(True, "grpo: divide by the group's reward std (False: Dr. "
                                     "GRPO).")
    rloo_scale_by_std: bool = option(False, "rloo: divide each group's leave-one-out "
                                     "advantages by the group's reward std (as "
                                     "grpo_scale_by_std).")
    baseline: str = option("running_mean", "critic_free: the baseline tracker, running_mean or "
                           "per_prompt.")
    baseline_decay: float = option(0.9, "critic_free: EMA decay of the baseline tracker.")
    ppo_clip_low: float = option(0.2, "PPO clip range starts at 1 - ppo_clip_low (ppo_clip, "
                                 "tis, icepop).")
    ppo_clip_high: float = option(0.2, "PPO clip range ends at 1 + ppo_clip_high.")
    gspo_clip_low: float = option(3e-4, "gspo: the sequence ratio's clip range starts at 1 - "
                                  "gspo_clip_low (GSPO paper: 3e-4).")
    gspo_clip_high: float = option(4e-4, "gspo: the sequence ratio's clip range ends at 1 + "
                                   "gspo_clip_high (GSPO paper: 4e-4).")
    tis_cap: float = option(2.0, "tis: C in min(pi_old / mu, C).")
    decoupled_weight_cap: float = option(5.0, "ppo_clip_decoupled, gspo_decoupled: tokens "
                                         "whose behaviour weight pi_old / mu exceeds this are "
                                         "dropped from the loss (AReaL: 5); > 1; inf: no cap.")
    icepop_low: float = option(0.5, "icepop: lower end of the band on pi_old / mu.")
    icepop_high: float = option(5.0, "icepop: upper end of the band on pi_old / mu.")
    policy_minibatches: int = option(1, "Policy optimizer steps per learner step, on "
                                     "consecutive slices of the batch.")
    micro_batch_tokens: int = option(0, "Token budget of one forward/backward; a step "
                                     "accumulates gradients over micro-batches; 0: whole batch.")
    micro_batch_layout: str = option(
        "padded", "padded (each micro-batch a [rows, longest row] block; micro_batch_tokens "
        "bounds rows x longest) or packed (its rollouts concatenated into one row with "
        "restarting position ids and attention kept within each rollout: no compute on "
        "padding; micro_batch_tokens bounds the row's tokens; sdpa models attend rollout by "
        "rollout, eager and sliding-window ones through an O(tokens^2) block-diagonal mask). "
        "Policy and critic; docs/DESIGN.md section 8.")
    dtype: str = option("float32", "Parameter and activation dtype of the policy and critic "
                        "(bfloat16 keeps fp32 master weights and optimizer state).")
    gradient_checkpointing: bool = option(False, "Recompute activations in the backward pass "
                                          "(less memory, ~30% more compute).")
    lora_rank: int = option(0, "LoRA rank r of the policy's adapters: the learner trains "
                            "low-rank adapters only (PEFT; models/lora.py) and publishes, "
                            "evaluates and checkpoints merged weights; 0: full fine-tuning.")
    lora_alpha: float = option(16.0, "LoRA alpha: the adapters' update B A is scaled by "
                               "lora_alpha / lora_rank.")
    lora_target_modules: Tuple[str, ...] = option(
        (), "Regexes (re.search) of the full names of the policy's linear layers that get "
        "adapters, e.g. q_proj,v_proj; each must match one; empty: the architecture's default "
        "(attention and MLP projections; attention only for MoE).")
    kernel_backend: str = option("auto", "auto (Triton on CUDA tensors, torch elsewhere), "
                                 "triton or torch.")
    fused_logprobs: bool = option(True, "Log-probs from hidden states and the LM head without "
                                  "materialising [N, V] logits.")
    logprob_positions: str = option(
        "actions", "actions: the policy step's LM head reads only the hidden states that "
        "predict action tokens (its loss and statistics use no other position: exact, and "
        "prompt and tool-observation positions cost no LM head); all: every position (as "
        "before; for comparison).")
    token_entropy: bool = option(True, "Log token_entropy_mean, the entropy of the current "
                                 "policy's sampling distribution at the action tokens, computed "
                                 "in the policy step's own forward (one more sum per logit).")
    drift_alarms: bool = option(True, "Warn and count (drift_alarm_<name> in the step rows and "
                                "summary.json) each policy step whose ess, kl_rollout or "
                                "chi2_token crosses alarm_min_ess, alarm_max_kl or "
                                "alarm_max_chi2.")
    alarm_min_ess: float = option(0.3, "drift_alarms: an ess below this raises ess_low.")
    alarm_max_kl: float = option(0.1, "drift_alarms: a kl_rollout (k3 KL, rollout vs current) "
                                 "above this raises kl_high.")
    alarm_max_chi2: float = option(1.0, "drift_alarms: a chi2_token (token chi-squared, current "
                                   "vs rollout) above this raises chi2_high.")
    checkpoint_every: int = option(0, "Save a learner checkpoint every this many versions; 0: "
                                   "only at the end.")
    keep_checkpoints: int = option(2, "The newest learner checkpoints kept (2: the newest and "
                                   "one to fall back to if it is found damaged); 0: all.")
    journal_max_mb: int = option(1024, "Also write a learner checkpoint once the journal "
                                 "since the newest one holds this many MiB (all ranks "
                                 "together), so the journal stays below about twice this "
                                 "whatever checkpoint_every is; 0: no limit.")
    learners: int = option(1, "Learner ranks in one torch.distributed group (gloo on CPU, NCCL "
                           "on GPU); each takes its share of every batch.")
    learner_strategy: str = option("ddp", "With learners > 1: ddp (gradients all-reduced) or "
                                   "fsdp2 (parameters sharded).")
    collective_timeout_s: float = option(300.0, "A learner-group collective slower than this "
                                         "fails the group (naming the rank) instead of hanging.")

    def check(self, fail: Fail) -> None:
        for field, options in (("algorithm", registry.ALGORITHM_NAMES),
                               ("policy_loss", registry.POLICY_LOSS_NAMES),
                               ("gae", GAE_MODES), ("loss_normalization", LOSS_NORMALIZATIONS),
                               ("kernel_backend", KERNEL_BACKENDS), ("baseline",
                                                                     CRITIC_FREE_BASELINES),
                               ("dtype", DTYPES), ("learner_strategy", LEARNER_STRATEGIES),
                               ("critic", CRITICS),
                               ("micro_batch_layout", MICRO_BATCH_LAYOUTS),
                               ("logprob_positions", LOGPROB_POSITIONS)):
            choice(self, field, options, fail)
        at_least(self, ("critic_updates", "critic_minibatches", "learners", "policy_minibatches"), 1,
                 fail)
        if not 0.0 < self.eps_low < 1.0:
            fail(f"eps_low={self.eps_low}: must be in (0, 1); the lower bound of the DIS band is "
                 "1 - eps_low and must stay positive (paper: 0.3 math, 0.8 coding)")
        if self.eps_high <= 0.0:
            fail(f"eps_high={self.eps_high}: must be > 0 (paper: 5.0 math, 3.0 coding)")
        for field in ("policy_lr", "critic_lr"):
            if not getattr(self, field) > 0:
                fail(f"{field}={getattr(self, field)}: must be > 0")
        if not 0.0 <= self.gamma <= 1.0:
            fail(f"gamma={self.gamma}: must be in [0, 1]")
        for field in ("lambda_policy", "lambda_critic"):
            if not 0.0 <= getattr(self, field) <= 1.0:
                fail(f"{field}={getattr(self, field)}: must be in [0, 1]")
        if self.lambda_alpha <= 0:
            fail(f"lambda_alpha={self.lambda_alpha}: must be > 0 (SAO review: 1.5; VAPO: 0.05)")
        choice(self, "lr_schedule", LR_SCHEDULES, fail)
        at_least(self, ("critic_warmup_steps", "value_pretrain_rollouts", "checkpoint_every",
                        "keep_checkpoints", "journal_max_mb", "micro_batch_tokens",
                        "lr_warmup_steps"), 0, fail)
        if self.max_grad_norm <= 0:
            fail(f"max_grad_norm={self.max_grad_norm}: must be > 0")
        if self.value_clip < 0:
            fail(f"value_clip={self.value_clip}: must be >= 0 (0 disables value clipping)")
        if not 0.0 < self.value_pretrain_min_ev <= 1.0:
            fail(f"value_pretrain_min_ev={self.value_pretrain_min_ev}: must be in (0, 1]")
        at_least(self, ("critic_eval_every",), 0, fail)
        at_least(self, ("value_pretrain_epochs", "value_pretrain_minibatch",
                        "value_pretrain_patience"), 1, fail)
        if not self.value_pretrain_lr > 0:
            fail(f"value_pretrain_lr={self.value_pretrain_lr}: must be > 0")
        if not 0.0 < self.value_pretrain_heldout < 1.0:
            fail(f"value_pretrain_heldout={self.value_pretrain_heldout}: must be in (0, 1) (the "
                 "fraction of the budget held out to measure explained variance)")
        if 0 < self.value_pretrain_rollouts < 10:
            fail(f"value_pretrain_rollouts={self.value_pretrain_rollouts}: too few to split "
                 "into train and held-out parts; use 0 (no pretraining) or >= 10 (hundreds "
                 "are typical: docs/METHOD.md, value pretraining)")
        if not 0.0 < self.ppo_clip_low < 1.0:
            fail(f"ppo_clip_low={self.ppo_clip_low}: must be in (0, 1); the clip range starts at "
                 "1 - ppo_clip_low, which must stay positive (PPO/GRPO: 0.2)")
        if self.ppo_clip_high <= 0.0:
            fail(f"ppo_clip_high={self.ppo_clip_high}: must be > 0 (PPO/GRPO: 0.2; DAPO: 0.28)")
        if not 0.0 < self.gspo_clip_low < 1.0:
            fail(f"gspo_clip_low={self.gspo_clip_low}: must be in (0, 1); the clip range starts "
                 "at 1 - gspo_clip_low (GSPO: 3e-4)")
        if self.gspo_clip_high <= 0.0:
            fail(f"gspo_clip_high={self.gspo_clip_high}: must be > 0 (GSPO: 4e-4)")
        if self.tis_cap <= 0.0:
            fail(f"tis_cap={self.tis_cap}: the truncation C of min(pi_old/mu, C) must be > 0 "
                 "(typical: 2)")
        if not self.decoupled_weight_cap > 1.0:
            fail(f"decoupled_weight_cap={self.decoupled_weight_cap}: must be > 1 so on-policy "
                 "tokens (behaviour weight 1) stay in the loss (AReaL: 5; inf: no cap)")
        if not 0.0 < self.icepop_low <= 1.0 <= self.icepop_high:
            fail(f"icepop_low={self.icepop_low}, icepop_high={self.icepop_high}: need "
                 "0 < icepop_low <= 1 <= icepop_high so on-policy tokens (ratio 1) are kept "
                 "(IcePop: 0.5 and 5)")
        if not 0.0 <= self.baseline_decay < 1.0:
            fail(f"baseline_decay={self.baseline_decay}: must be in [0, 1)")
        has_critic = self.algorithm in registry.CRITIC_ALGORITHMS
        with_critic = ",".join(registry.CRITIC_ALGORITHMS)
        if not has_critic and (self.value_pretrain_rollouts or self.critic_warmup_steps):
            fail(f"algorithm={self.algorithm!r} has no critic: value_pretrain_rollouts="
                 f"{self.value_pretrain_rollouts} and critic_warmup_steps={self.critic_warmup_steps}"
                 f" must be 0 (or use --algorithm={with_critic})")
        if self.bootstrap_truncated and not has_critic:
            fail(f"bootstrap_truncated=True needs a critic (algorithm={with_critic}, not "
                 f"{self.algorithm!r})")
        if self.critic == "shared_trunk":
            self._check_shared_trunk(fail)
        if self.critic_concurrent:
            self._check_concurrent_critic(fail)
        self._check_lora(fail)
        if not self.collective_timeout_s > 0:
            fail(f"collective_timeout_s={self.collective_timeout_s}: must be > 0 seconds")
        if not 0.0 < self.alarm_min_ess <= 1.0:
            fail(f"alarm_min_ess={self.alarm_min_ess}: must be in (0, 1] (ess is in (0, 1]; "
                 "default 0.3)")
        for field in ("alarm_max_kl", "alarm_max_chi2"):
            if not getattr(self, field) > 0:
                fail(f"{field}={getattr(self, field)}: must be > 0 (defaults: 0.1 and 1.0)")

    def _check_lora(self, fail: Fail) -> None:
        """LoRA's own settings and the learner strategies it cannot run under (target patterns
        are matched against the model before launch, preflight.py)."""
        if self.lora_rank < 0:
            fail(f"lora_rank={self.lora_rank}: must be > 0 for LoRA (typical: 8-64), or 0 for "
                 "full fine-tuning")
        if not self.lora_rank:
            if self.lora_target_modules:
                fail(f"lora_target_modules={','.join(self.lora_target_modules)} with "
                     "lora_rank=0: LoRA is off; set --lora_rank > 0 or drop "
                     "--lora_target_modules")
            return
        if not self.lora_alpha > 0:
            fail(f"lora_alpha={self.lora_alpha}: must be > 0 (the update is scaled by "
                 "lora_alpha / lora_rank; typical: 16 or 2 x rank)")
        if self.learners > 1 and self.learner_strategy == "fsdp2":
            fail(f"lora_rank={self.lora_rank} with learner_strategy='fsdp2': LoRA runs with "
                 "ddp (the frozen base is replicated, only the adapters' gradients are "
                 "all-reduced; merging sharded weights for every publish is not supported); "
                 "use --learner_strategy=ddp or --lora_rank=0")

    def _check_concurrent_critic(self, fail: Fail) -> None:
        """critic_concurrent: the settings that need the critic after the policy step."""
        if self.algorithm not in registry.CRITIC_ALGORITHMS:
            fail(f"critic_concurrent=True with algorithm={self.algorithm!r}: there is no "
                 "critic to run concurrently; drop --critic_concurrent")
        if self.critic != "separate":
            fail(f"critic_concurrent=True with critic={self.critic!r}: the value head shares "
                 "the policy's trunk and trains in the policy step; use --critic=separate or "
                 "drop --critic_concurrent")
        if self.learners > 1:
            fail(f"critic_concurrent=True with learners={self.learners}: the critic's and the "
                 "policy's collectives would interleave on one process group; use "
                 "--learners=1 or drop --critic_concurrent")

    def _check_shared_trunk(self, fail: Fail) -> None:
        """critic=shared_trunk: the combinations it does not support (docs/METHOD.md, the
        shared-trunk value head)."""
        if self.algorithm not in registry.CRITIC_ALGORITHMS:
            fail(f"critic='shared_trunk' with algorithm={self.algorithm!r}: only "
                 f"{', '.join(registry.CRITIC_ALGORITHMS)} has a critic; drop --critic or use "
                 f"--algorithm={registry.CRITIC_ALGORITHMS[0]}")
        if not self.value_loss_coef > 0:
            fail(f"value_loss_coef={self.value_loss_coef}: must be > 0 (the value head reaches "
                 "the trunk only through the joint loss)")
        if self.value_pretrain_rollouts or self.critic_warmup_steps:
            fail(f"critic='shared_trunk' with value_pretrain_rollouts="
                 f"{self.value_pretrain_rollouts}, "
                 f"critic_warmup_steps={self.critic_warmup_steps}: critic-only steps would move "
                 "the policy's trunk without a new version; set both to 0 or use "
                 "--critic=separate")
        if self.loss_normalization != "action_tokens":
            fail(f"critic='shared_trunk' with loss_normalization={self.loss_normalization!r}: "
                 "the kept-token rescaling of the policy gradient would rescale the value "
                 "loss's gradient in the shared trunk too; use action_tokens or "
                 "--critic=separate")
