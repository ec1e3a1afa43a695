"""The algorithm registry: one entry per algorithm and one per policy loss, in one place.

An algorithm is what turns a batch into advantages (its estimator), whether it trains a critic,
whether it compares the rollouts of a prompt's group (then the learner samples whole groups and
group_size must be >= 2), and the config fields that are its options. A policy loss is a pure
function of the per-token log-probs and advantages, whether it needs the old policy's log-probs
(recomputed by the learner), and which config fields are its options (keyword -> field of
LearnerConfig: the options come from the config section alone, docs/METHOD.md section 5).

Adding an algorithm is one file (its estimator, with a `from_config`-style factory) plus one
`ALGORITHMS` line here; adding a policy loss is one file (its function) plus one `POLICY_LOSSES`
line. The config takes its allowed --algorithm and --policy_loss values from here and the
learner (builder.assemble_learner, estimators.make_estimator, losses.policy_loss) asks here what
to build, so nothing else branches on their names.

Only the standard library is imported: the config validates names and options without torch.
Factories and functions are named "module:attribute" and imported when first used.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Dict, Tuple

_PACKAGE = "sao_actor_learner.learner"


def load(path: str) -> Any:
    """The object named "module:attr[.attr]" (module relative to sao_actor_learner.learner when
    it starts with a dot)."""
    module, _, attrs = path.partition(":")
    obj: Any = importlib.import_module(_PACKAGE + module if module.startswith(".") else module)
    for attr in attrs.split("."):
        obj = getattr(obj, attr)
    return obj


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One algorithm.

    estimator: "module:callable"; callable(config: LearnerConfig, critic, collective,
      policy_trainer) -> estimators.AdvantageEstimator (critic: a ValueModel when needs_critic,
      else None).
    needs_critic: it trains a critic (builder.make_critic makes one; value pretraining, critic
      warm-up and bootstrap_truncated apply).
    groups: its advantages compare the rollouts of one prompt's group: the learner samples
      whole groups (learner/sampling.GroupSampler) and config needs group_size >= 2.
    options: the LearnerConfig fields that only this algorithm reads.
    """
    name: str
    estimator: str
    needs_critic: bool = False
    groups: bool = False
    options: Tuple[str, ...] = ()

    def make_estimator(self, config, critic=None, collective=None, policy_trainer=None):
        return load(self.estimator)(config, critic, collective, policy_trainer)


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """One policy loss.

    function: "module:function", the torch reference, called with keywords logp, rollout_logp,
      advantages, action_mask, normalization, normalizer, old_logp (when needs_old_logp) and
      its options; returns (loss, stats).
    options: (keyword, LearnerConfig field) pairs: the loss's parameters and where they come from.
    needs_old_logp: its ratio is taken against the recomputed old policy (no gradient).
    kernel: "module:function" with the same keywords plus `backend` (the kernel dispatcher),
      used in the policy step when given; "" : the step uses `function` too.
    """
    name: str
    function: str
    options: Tuple[Tuple[str, str], ...] = ()
    needs_old_logp: bool = False
    kernel: str = ""


_PPO_CLIP = (("clip_low", "ppo_clip_low"), ("clip_high", "ppo_clip_high"))
_GSPO_CLIP = (("clip_low", "gspo_clip_low"), ("clip_high", "gspo_clip_high"))
_BEHAVIOUR_CAP = (("cap", "decoupled_weight_cap"),)

# --- the registrations: one entry each ------------------------------------------------------
ALGORITHMS: Dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("sao", ".sao:make_critic_estimator", needs_critic=True,
              options=("critic", "gae", "adaptive_lambda", "lambda_alpha", "lambda_policy",
                       "lambda_critic", "bootstrap_truncated", "value_clip", "critic_updates")),
    Algorithm("grpo", ".group_normalized:GroupNormalized.from_config", groups=True,
              options=("grpo_scale_by_std",)),
    Algorithm("critic_free", ".tracked_baseline:TrackedBaseline.from_config",
              options=("baseline", "baseline_decay")),
    Algorithm("rloo", ".rloo:LeaveOneOut.from_config", groups=True,
              options=("rloo_scale_by_std",)),
)}

POLICY_LOSSES: Dict[str, PolicyLoss] = {p.name: p for p in (
    PolicyLoss("dis", ".losses:dis_policy_loss", (("eps_low", "eps_low"), ("eps_high", "eps_high")),
               kernel="sao_actor_learner.kernels:dis_loss"),
    PolicyLoss("ppo_clip", ".losses:ppo_clip_loss", _PPO_CLIP, needs_old_logp=True),
    PolicyLoss("tis", ".losses:tis_policy_loss", (("cap", "tis_cap"),) + _PPO_CLIP,
               needs_old_logp=True),
    PolicyLoss("icepop", ".losses:icepop_policy_loss",
               (("band_low", "icepop_low"), ("band_high", "icepop_high")) + _PPO_CLIP,
               needs_old_logp=True),
    PolicyLoss("none", ".losses:no_correction_loss"),
    PolicyLoss("gspo", ".gspo:gspo_policy_loss", _GSPO_CLIP, needs_old_logp=True),
    PolicyLoss("ppo_clip_decoupled", ".decoupled:ppo_clip_decoupled_loss",
               _PPO_CLIP + _BEHAVIOUR_CAP, needs_old_logp=True),
    PolicyLoss("gspo_decoupled", ".decoupled:gspo_decoupled_loss", _GSPO_CLIP + _BEHAVIOUR_CAP,
               needs_old_logp=True),
)}

ALGORITHM_NAMES: Tuple[str, ...] = tuple(ALGORITHMS)
POLICY_LOSS_NAMES: Tuple[str, ...] = tuple(POLICY_LOSSES)
# The algorithms that train a critic, and those that compare a prompt's group of rollouts.
CRITIC_ALGORITHMS: Tuple[str, ...] = tuple(a.name for a in ALGORITHMS.values() if a.needs_critic)
GROUP_ALGORITHMS: Tuple[str, ...] = tuple(a.name for a in ALGORITHMS.values() if a.groups)


def algorithm(name: str) -> Algorithm:
    """The entry of algorithm `name`; ValueError naming the known ones."""
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm={name!r}: must be one of {', '.join(ALGORITHM_NAMES)}")
    return ALGORITHMS[name]


def policy_loss(name: str) -> PolicyLoss:
    """The entry of policy loss `name`; ValueError naming the known ones."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy loss {name!r}: must be one of {', '.join(POLICY_LOSS_NAMES)}")
    return POLICY_LOSSES[name]
