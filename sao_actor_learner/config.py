"""The run configuration: one flat frozen dataclass, validated when it is made.

Every check runs before any process starts and its message names the field, the value and what
to change (STYLE.md: "max_staleness=-1: must be >= 0; 0 means strictly on-policy").
Choices the SAO paper leaves open are marked (ours) in SAO.md and stay options here.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Optional, Tuple

LAUNCH_TYPES = ("local_mt", "local_mp")
ENGINES = ("torch",)
GAE_MODES = ("skip_observation", "standard")
LOSS_NORMALIZATIONS = ("action_tokens", "kept_tokens")
POLICY_LOSSES = ("dis",)
TASKS = ("arithmetic",)


class ConfigError(ValueError):
    """An invalid configuration; the message says which field to change and why."""


@dataclasses.dataclass(frozen=True)
class SAOConfig:
    # --- program -------------------------------------------------------------------------------
    task: str = "arithmetic"
    seed: int = 0
    run_dir: str = "runs/default"
    launch: str = "local_mp"
    num_actors: int = 2
    init_checkpoint: str = "checkpoints/warm_start"
    max_steps: int = 100
    threads_per_process: int = 1          # torch.set_num_threads in every node
    engine: str = "torch"

    # --- replay and staleness (SAO.md section 6) -------------------------------------------------
    batch_size: int = 32                  # rollouts (= distinct prompts) per learner step
    max_staleness: int = 4                # eta: nothing staler than this is trained on
    queue_capacity: int = 0               # Reverb rate limiter bound on queued rollouts; 0: 2*batch_size
    admission_control: bool = True        # actors start rollouts only while started <= (v+eta+1)*B
    max_sequence_length: int = 64         # longer rollouts are rejected by the writer

    # --- actors --------------------------------------------------------------------------------
    actor_batch: int = 8                  # prompts an actor generates together (one rollout each)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    variable_update_period_s: float = 0.05  # how often actors poll the variable server

    # --- SAO learner (SAO.md sections 3-5) -----------------------------------------------------
    policy_loss: str = "dis"
    eps_low: float = 0.3
    eps_high: float = 5.0
    loss_normalization: str = "action_tokens"   # (ours); "kept_tokens" normalises by kept tokens
    policy_lr: float = 5e-5
    critic_lr: float = 2.5e-4                     # 5x the policy lr, as the public ports do
    critic_updates: int = 2                       # K critic steps per policy step
    critic_frozen_patterns: Tuple[str, ...] = ("self_attn", "embed_tokens", "norm")
    critic_warmup_steps: int = 0                  # first steps update only the critic
    value_pretrain_steps: int = 0                 # critic-only steps on the initial policy's rollouts
    value_pretrain_min_ev: float = 1.0            # stop pretraining early at this explained variance
    gamma: float = 1.0
    gae: str = "skip_observation"
    adaptive_lambda: bool = True                  # lambda_policy = 1 - 1/(alpha*n)
    lambda_alpha: float = 1.5
    lambda_policy: float = 0.95                   # used when adaptive_lambda is False
    lambda_critic: float = 1.0
    normalize_advantages: bool = True             # (ours) whiten advantages over the batch's action tokens
    max_grad_norm: float = 1.0
    value_clip: float = 0.0                       # 0: no value clipping
    checkpoint_every: int = 0                     # 0: only at the end

    # --- evaluation ------------------------------------------------------------------------------
    eval_every: int = 10
    eval_size: int = 200

    def __post_init__(self):
        # Tuples from flags may arrive as lists.
        object.__setattr__(self, "critic_frozen_patterns", tuple(self.critic_frozen_patterns))
        self.validate()

    # Convenience -----------------------------------------------------------------------------
    @property
    def effective_queue_capacity(self) -> int:
        return self.queue_capacity or 2 * self.batch_size

    def replace(self, **kwargs) -> "SAOConfig":
        return dataclasses.replace(self, **kwargs)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SAOConfig":
        return cls(**json.loads(text))

    # Validation ------------------------------------------------------------------------------
    def validate(self) -> None:
        def fail(msg):
            raise ConfigError(msg)

        def choice(field, options):
            value = getattr(self, field)
            if value not in options:
                fail(f"{field}={value!r}: must be one of {', '.join(options)}")

        choice("task", TASKS)
        choice("launch", LAUNCH_TYPES)
        choice("engine", ENGINES)
        choice("gae", GAE_MODES)
        choice("loss_normalization", LOSS_NORMALIZATIONS)
        choice("policy_loss", POLICY_LOSSES)
        for field in ("num_actors", "max_steps", "batch_size", "actor_batch", "max_new_tokens",
                      "critic_updates", "threads_per_process", "eval_size", "max_sequence_length"):
            if getattr(self, field) < 1:
                fail(f"{field}={getattr(self, field)}: must be >= 1")
        if self.max_staleness < 0:
            fail(f"max_staleness={self.max_staleness}: must be >= 0; 0 means strictly on-policy")
        if self.queue_capacity < 0:
            fail(f"queue_capacity={self.queue_capacity}: must be >= 0 (0 picks 2*batch_size)")
        if self.queue_capacity and self.queue_capacity < self.batch_size:
            fail(f"queue_capacity={self.queue_capacity} < batch_size={self.batch_size}: the learner "
                 f"waits for {self.batch_size} rollouts while actors block once {self.queue_capacity} "
                 "are queued, a deadlock; raise queue_capacity or lower batch_size")
        if self.actor_batch > self.effective_queue_capacity:
            fail(f"actor_batch={self.actor_batch} > queue capacity {self.effective_queue_capacity}: "
                 "an actor could never insert its whole batch; lower actor_batch")
        if not 0.0 < self.eps_low < 1.0:
            fail(f"eps_low={self.eps_low}: must be in (0, 1); the lower bound of the DIS band is "
                 "1 - eps_low and must stay positive (paper: 0.3 math, 0.8 coding)")
        if self.eps_high <= 0.0:
            fail(f"eps_high={self.eps_high}: must be > 0 (paper: 5.0 math, 3.0 coding)")
        if self.temperature <= 0.0:
            fail(f"temperature={self.temperature}: training rollouts need temperature > 0; "
                 "greedy sampling has no valid behaviour log-probs for importance sampling")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p={self.top_p}: must be in (0, 1]")
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
        for field in ("critic_warmup_steps", "value_pretrain_steps", "checkpoint_every",
                      "eval_every"):
            if getattr(self, field) < 0:
                fail(f"{field}={getattr(self, field)}: must be >= 0")
        if self.critic_warmup_steps >= self.max_steps:
            fail(f"critic_warmup_steps={self.critic_warmup_steps} >= max_steps={self.max_steps}: "
                 "the policy would never be trained; lower critic_warmup_steps")
        if self.max_grad_norm <= 0:
            fail(f"max_grad_norm={self.max_grad_norm}: must be > 0")
        if self.value_clip < 0:
            fail(f"value_clip={self.value_clip}: must be >= 0 (0 disables value clipping)")
        if self.variable_update_period_s <= 0:
            fail(f"variable_update_period_s={self.variable_update_period_s}: must be > 0")
        if not 0.0 < self.value_pretrain_min_ev <= 1.0:
            fail(f"value_pretrain_min_ev={self.value_pretrain_min_ev}: must be in (0, 1]")
