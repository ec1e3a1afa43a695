"""The decoupled losses (policy_loss=ppo_clip_decoupled / gspo_decoupled, learner/decoupled.py):
values and gradients against slow per-token loops, the behaviour correction (it changes the
gradient when the behaviour policy is far from the proximal one and nothing when they agree),
the config's options, and one learner update of each selected by config."""
import math

import numpy as np
import pytest
import torch

from test_baselines import rollouts_for, tiny_policy  # noqa: E402  (sets TRITON_INTERPRET first)

from sao_actor_learner.builder import assemble_learner
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.learner import losses
from sao_actor_learner.learner.decoupled import gspo_decoupled_loss, ppo_clip_decoupled_loss
from sao_actor_learner.learner.gspo import gspo_policy_loss
from sao_actor_learner.types import collate


def make_inputs(seed, behaviour_noise=0.6, proximal_noise=0.15):
    """logp (pi_theta), old (pi_prox, near it) and mu (the behaviour policy, far away)."""
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 7
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = logp + proximal_noise * torch.randn(B, T, generator=g, dtype=torch.float64)
    mu = old + behaviour_noise * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[:, 0] = 0.0
    mask[-1] = 0.0                                    # a row without action tokens
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    return logp, old, mu, adv * mask, mask


def slow_weight(old, mu, cap):
    k = math.exp(old - mu)
    return k if k <= cap else 0.0


def slow_ppo_decoupled(logp, old, mu, adv, mask, lo, hi, cap, kept_tokens=False):
    """(loss, d loss / d logp) one token at a time, in Python floats."""
    B, T = logp.shape
    tokens = [(b, t) for b in range(B) for t in range(T) if mask[b, t]]
    w = {bt: slow_weight(float(old[bt]), float(mu[bt]), cap) for bt in tokens}
    n = sum(1 for bt in tokens if w[bt] > 0) if kept_tokens else len(tokens)
    total, grad = 0.0, torch.zeros(B, T, dtype=torch.float64)
    for bt in tokens:
        rho = math.exp(float(logp[bt] - old[bt]))
        a = float(adv[bt])
        total -= w[bt] * min(rho * a, min(max(rho, 1 - lo), 1 + hi) * a)
        active = (rho > 1 + hi and a > 0) or (rho < 1 - lo and a < 0)
        grad[bt] = 0.0 if active else -w[bt] * rho * a / n
    return total / n, grad


def slow_gspo_decoupled(logp, old, mu, adv, mask, lo, hi, cap, kept_tokens=False):
    B, T = logp.shape
    n_kept, n_all = 0, 0
    total, grad = 0.0, torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        tokens = [t for t in range(T) if mask[b, t]]
        if not tokens:
            continue
        s = math.exp(sum(float(logp[b, t] - old[b, t]) for t in tokens) / len(tokens))
        for t in tokens:
            w = slow_weight(float(old[b, t]), float(mu[b, t]), cap)
            n_all += 1
            n_kept += w > 0
            a = float(adv[b, t])
            total -= w * min(s * a, min(max(s, 1 - lo), 1 + hi) * a)
            active = (s > 1 + hi and a > 0) or (s < 1 - lo and a < 0)
            grad[b, t] = 0.0 if active else -w * s * a
    n = n_kept if kept_tokens else n_all
    return total / n, grad / n


CASES = [(0.2, 0.2, 5.0, False), (0.05, 0.05, 1.5, False), (0.2, 0.3, 2.0, True),
         (0.2, 0.2, float("inf"), False)]


@pytest.mark.parametrize("lo, hi, cap, kept", CASES)
def test_ppo_clip_decoupled_matches_a_slow_loop(lo, hi, cap, kept):
    logp, old, mu, adv, mask = make_inputs(0)
    x = logp.clone().requires_grad_(True)
    loss, stats = ppo_clip_decoupled_loss(x, old, mu, adv, mask, lo, hi, cap,
                                          "kept_tokens" if kept else "action_tokens")
    loss.backward()
    want, want_grad = slow_ppo_decoupled(logp, old, mu, adv, mask, lo, hi, cap, kept)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(x.grad, want_grad)
    k = torch.exp(old - mu)[mask.bool()]
    assert stats["behaviour_capped_frac"] == pytest.approx(float((k > cap).double().mean()))
    assert stats["masked_frac"] == stats["behaviour_capped_frac"]
    assert stats["num_kept_tokens"] == float((k <= cap).sum())
    assert stats["behaviour_weight_max"] == pytest.approx(float(k.max()))
    if cap == 1.5:
        assert 0.0 < stats["masked_frac"] < 1.0 and stats["clip_frac"] > 0.0
    for key in ("ratio_mean", "kl_rollout", "ess", "num_action_tokens", "ppo_ratio_mean",
                "policy_loss", "kl_behaviour"):
        assert math.isfinite(stats[key]), key


@pytest.mark.parametrize("lo, hi, cap, kept", CASES)
def test_gspo_decoupled_matches_a_slow_loop(lo, hi, cap, kept):
    logp, old, mu, adv, mask = make_inputs(1)
    x = logp.clone().requires_grad_(True)
    loss, stats = gspo_decoupled_loss(x, old, mu, adv, mask, lo, hi, cap,
                                      "kept_tokens" if kept else "action_tokens")
    loss.backward()
    want, want_grad = slow_gspo_decoupled(logp, old, mu, adv, mask, lo, hi, cap, kept)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(x.grad, want_grad)
    k = torch.exp(old - mu)[mask.bool()]
    assert stats["num_kept_tokens"] == float((k <= cap).sum())
    assert stats["masked_frac"] == stats["behaviour_capped_frac"]
    assert "gspo_ratio_max" in stats and "kl_rollout" in stats and "ess" in stats


def grads(fn, logp, *args):
    x = logp.clone().requires_grad_(True)
    fn(x, *args)[0].backward()
    return x.grad


@pytest.mark.parametrize("kind", ["ppo_clip", "gspo"])
def test_the_behaviour_weight_changes_the_gradient_only_when_behaviour_differs(kind):
    """At one minibatch per step pi_theta == pi_prox: the plain loss's ratio is exactly 1 and its
    gradient ignores mu. The decoupled one's differs when mu is far from pi_prox, and equals the
    plain one when mu == pi_prox."""
    logp, _, mu, adv, mask = make_inputs(2, behaviour_noise=1.0)
    old = logp.clone()          # the proximal policy is the current one: one minibatch
    if kind == "ppo_clip":
        plain = grads(losses.ppo_clip_loss, logp, old, adv, mask, 0.2, 0.2)
        far = grads(ppo_clip_decoupled_loss, logp, old, mu, adv, mask, 0.2, 0.2, 5.0)
        same = grads(ppo_clip_decoupled_loss, logp, old, old, adv, mask, 0.2, 0.2, 5.0)
        _, stats = losses.ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2, rollout_logp=mu)
        assert stats["ppo_ratio_mean"] == 1.0 and stats["ppo_ratio_max"] == 1.0
    else:
        plain = grads(gspo_policy_loss, logp, old, adv, mask, 3e-4, 4e-4)
        far = grads(gspo_decoupled_loss, logp, old, mu, adv, mask, 3e-4, 4e-4, 5.0)
        same = grads(gspo_decoupled_loss, logp, old, old, adv, mask, 3e-4, 4e-4, 5.0)
    torch.testing.assert_close(same, plain, rtol=0, atol=0)
    assert not torch.allclose(far, plain)
    # The decoupled gradient is the importance-sampled one: -(pi_theta / mu) A / N, capped.
    k = torch.exp(logp - mu) * mask
    w = torch.where(k <= 5.0, k, torch.zeros_like(k))
    torch.testing.assert_close(far, -w * adv / mask.sum())


def test_options_come_from_the_config_section_and_bad_caps_fail():
    logp, old, mu, adv, mask = make_inputs(3)
    options = LearnerConfig(decoupled_weight_cap=2.0, ppo_clip_low=0.1, gspo_clip_low=0.01,
                            gspo_clip_high=0.02)
    got, _ = losses.policy_loss("ppo_clip_decoupled", logp, mu, adv, mask, old, options=options)
    want, _ = ppo_clip_decoupled_loss(logp, old, mu, adv, mask, 0.1, 0.2, 2.0)
    assert float(got) == float(want)
    got, _ = losses.policy_loss("gspo_decoupled", logp, mu, adv, mask, old, options=options)
    want, _ = gspo_decoupled_loss(logp, old, mu, adv, mask, 0.01, 0.02, 2.0)
    assert float(got) == float(want)
    for name in ("ppo_clip_decoupled", "gspo_decoupled"):
        with pytest.raises(ValueError, match="needs old_logp"):
            losses.policy_loss(name, logp, mu, adv, mask)
    with pytest.raises(ConfigError, match="decoupled_weight_cap=1.0"):
        SAOConfig(decoupled_weight_cap=1.0)
    with pytest.raises(ValueError, match="cap=0.5"):
        ppo_clip_decoupled_loss(logp, old, mu, adv, mask, 0.2, 0.2, 0.5)


@pytest.mark.parametrize("name", ["ppo_clip_decoupled", "gspo_decoupled"])
def test_selected_by_config_runs_one_learner_update(name):
    config = SAOConfig(algorithm="grpo", group_size=4, batch_size=8, actor_batch=4, max_steps=5,
                       policy_loss=name, fused_logprobs=False, gspo_clip_low=0.01,
                       gspo_clip_high=0.01, decoupled_weight_cap=2.0)
    policy = tiny_policy()
    learner = assemble_learner(config, policy, None)
    batch = collate(rollouts_for(learner, 2, 4, noise=1.0))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    stats = learner.update(batch)
    assert np.isfinite(stats["policy_loss"]) and stats["kl_rollout"] > 0
    assert 0.0 < stats["behaviour_capped_frac"] < 1.0 and "chi2_token" in stats
    assert any(not torch.equal(v, before[k]) for k, v in policy.state_dict().items())
