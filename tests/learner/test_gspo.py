"""GSPO (policy_loss=gspo, learner/gspo.py): the loss and its gradient against a slow obvious
loop, its sequence-level equivalence with per-rollout advantages, the config's options, and one
learner update on a tiny model with SAO's critic and with groups, selected by config."""
import math

import numpy as np
import pytest
import torch

from test_baselines import rollouts_for, tiny_policy  # noqa: E402  (sets TRITON_INTERPRET first)

from sao_actor_learner.builder import assemble_learner
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.learner import losses
from sao_actor_learner.learner.gspo import gspo_policy_loss
from sao_actor_learner.models.value import ValueModel
from sao_actor_learner.types import collate


def make_inputs(seed, per_token=True):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 7
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = logp + 0.08 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[:, 0] = 0.0
    mask[-1] = 0.0                                    # a row without action tokens
    if per_token:
        adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    else:
        adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    return logp, old, adv * mask, mask


def slow_gspo(logp, old, adv, mask, lo, hi):
    """(loss, d loss / d logp) one rollout and one token at a time, in Python floats."""
    B, T = logp.shape
    n = sum(float(mask[b, t]) for b in range(B) for t in range(T))
    total, grad = 0.0, torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        tokens = [t for t in range(T) if mask[b, t]]
        if not tokens:
            continue
        s = math.exp(sum(float(logp[b, t] - old[b, t]) for t in tokens) / len(tokens))
        for t in tokens:
            a = float(adv[b, t])
            clipped = min(max(s, 1 - lo), 1 + hi)
            total -= min(s * a, clipped * a)
            active = (s > 1 + hi and a > 0) or (s < 1 - lo and a < 0)
            # d/dlogp of sg(s) * exp(logp - sg(logp)) is s; nothing where the clip is active
            grad[b, t] = 0.0 if active else -s * a / n
    return total / n, grad


@pytest.mark.parametrize("lo, hi", [(0.03, 0.04), (3e-4, 4e-4), (0.5, 0.5)])
def test_gspo_loss_and_gradient_match_a_slow_loop(lo, hi):
    logp, old, adv, mask = make_inputs(0)
    x = logp.clone().requires_grad_(True)
    loss, stats = gspo_policy_loss(x, old, adv, mask, lo, hi)
    loss.backward()
    want, want_grad = slow_gspo(logp, old, adv, mask, lo, hi)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(x.grad, want_grad)
    assert 0.0 <= stats["clip_frac"] <= 1.0 and stats["masked_frac"] == stats["clip_frac"]
    if lo < 0.01:   # GSPO's ranges: every rollout's ratio (noise 0.08) is outside them
        assert stats["gspo_clipped_rollout_frac"] == 1.0 and stats["clip_frac"] > 0
    if lo == 0.03:  # some rollouts clipped, some not
        assert 0.0 < stats["gspo_clipped_rollout_frac"] < 1.0
    if lo == 0.5:   # nothing clipped: the plain sequence-ratio policy gradient
        assert stats["clip_frac"] == 0.0


def test_gspo_with_one_advantage_per_rollout_is_sequence_level_gspo():
    """The token-level gradient equals that of GSPO's sequence objective |y_i| min(s_i A_i,
    clip(s_i) A_i) with the gradient through s_i itself (token mean over the batch)."""
    logp, old, adv, mask = make_inputs(1, per_token=False)
    lo, hi = 0.03, 0.04
    x = logp.clone().requires_grad_(True)
    gspo_policy_loss(x, old, adv, mask, lo, hi)[0].backward()
    y = logp.clone().requires_grad_(True)
    lengths = mask.sum(1)
    s = torch.exp(((y - old) * mask).sum(1) / lengths.clamp(min=1))
    a = adv.max(1).values + adv.min(1).values   # the row's advantage (0 off action tokens)
    seq = torch.minimum(s * a, s.clamp(1 - lo, 1 + hi) * a)
    (-(lengths * seq).sum() / mask.sum()).backward()
    torch.testing.assert_close(x.grad, y.grad)


def test_gspo_options_come_from_the_config_section():
    logp, old, adv, mask = make_inputs(2)
    loss, _ = losses.policy_loss("gspo", logp, logp, adv, mask, old,
                                 options=LearnerConfig(gspo_clip_low=0.03, gspo_clip_high=0.04))
    want, _ = gspo_policy_loss(logp, old, adv, mask, 0.03, 0.04)
    assert float(loss) == float(want)
    default, _ = losses.policy_loss("gspo", logp, logp, adv, mask, old)
    assert float(default) == float(gspo_policy_loss(logp, old, adv, mask, 3e-4, 4e-4)[0])
    with pytest.raises(ValueError, match="needs old_logp"):
        losses.policy_loss("gspo", logp, logp, adv, mask)
    with pytest.raises(ConfigError, match="gspo_clip_low=1.0"):
        SAOConfig(gspo_clip_low=1.0)
    with pytest.raises(ConfigError, match="gspo_clip_high=0.0"):
        SAOConfig(gspo_clip_high=0.0)


@pytest.mark.parametrize("algorithm", ["sao", "grpo"])
def test_gspo_selected_by_config_runs_one_learner_update(algorithm):
    groups = dict(group_size=4, batch_size=8) if algorithm == "grpo" else dict(batch_size=4)
    config = SAOConfig(algorithm=algorithm, actor_batch=4, max_steps=5, policy_loss="gspo",
                       fused_logprobs=False, policy_minibatches=2, gspo_clip_low=0.01,
                       gspo_clip_high=0.01, **groups)
    policy = tiny_policy()
    critic = None
    if algorithm == "sao":
        critic = ValueModel.from_policy(policy)
        critic.freeze(config.critic_frozen_patterns)
    learner = assemble_learner(config, policy, critic)
    batch = collate(rollouts_for(learner, 2 if algorithm == "grpo" else 4,
                                 4 if algorithm == "grpo" else 1, noise=1.0))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    stats = learner.update(batch)
    assert np.isfinite(stats["policy_loss"]) and stats["policy_minibatches"] == 2
    assert "gspo_ratio_max" in stats and stats["kl_rollout"] > 0
    assert any(not torch.equal(v, before[k]) for k, v in policy.state_dict().items())
