"""The comparison policy losses (PPO-clip, TIS, IcePop, none) against slow per-token loops.

Each reference writes the formula of learner/losses.py token by token (scalar tensors, Python
control flow for the min/clip/mask); loss values and gradients w.r.t. logp must agree.
"""
import math

import pytest
import torch

from sao_actor_learner.learner import losses


def make_inputs(seed, B=4, T=9, spread=0.8):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old_logp = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    rollout_logp = old_logp + torch.randn(B, T, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = False
    return logp, old_logp, rollout_logp, adv, mask


def slow_ppo_terms(logp, old_logp, adv, mask, clip_low, clip_high, weight_fn):
    """Per-token PPO-clip terms -w * min(rho A, clip(rho) A) as a list of (b, t, value, weight)."""
    terms = []
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            rho = torch.exp(logp[b, t] - old_logp[b, t])
            a = float(adv[b, t])
            clipped = min(max(rho.item(), 1 - clip_low), 1 + clip_high)
            w = weight_fn(b, t)
            # min(rho A, clip(rho) A): the clipped branch has no gradient
            if rho.item() * a <= clipped * a:
                value = -w * rho * a
            else:
                value = -w * torch.tensor(clipped * a, dtype=logp.dtype)
            terms.append((b, t, value, w))
    return terms


def slow_loss(terms, normalization):
    n = len(terms)
    kept = sum(1 for *_, w in terms if w > 0)
    total = sum(v for _, _, v, _ in terms)
    return total / max(n if normalization == "action_tokens" else kept, 1)


def grad_of(fn, logp):
    x = logp.clone().requires_grad_(True)
    out = fn(x)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("normalization", ["action_tokens", "kept_tokens"])
def test_ppo_clip_matches_slow_loop(seed, normalization):
    logp, old, rlp, adv, mask = make_inputs(seed)
    lo, hi = 0.2, 0.28
    loss, g = grad_of(lambda x: losses.ppo_clip_loss(x, old, adv, mask, lo, hi, normalization,
                                                     rollout_logp=rlp), logp)
    ref, g_ref = grad_of(lambda x: slow_loss(
        slow_ppo_terms(x, old, adv, mask, lo, hi, lambda b, t: 1.0), normalization), logp)
    assert float(loss) == pytest.approx(float(ref), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(g, g_ref)
    _, stats = losses.ppo_clip_loss(logp, old, adv, mask, lo, hi, normalization, rollout_logp=rlp)
    rho = torch.exp(logp - old)[mask]
    a = adv[mask]
    clipped = ((rho > 1 + hi) & (a > 0)) | ((rho < 1 - lo) & (a < 0))
    assert stats["clip_frac"] == pytest.approx(float(clipped.double().mean()))
    assert 0 < stats["clip_frac"] < 1  # the inputs exercise the clip
    assert stats["masked_frac"] == stats["clip_frac"]
    r = torch.exp(logp - rlp)[mask]  # drift stats are against the behaviour policy
    assert stats["kl_rollout"] == pytest.approx(float((r - 1 - torch.log(r)).mean()))
    assert stats["ess"] == pytest.approx(float(r.sum() ** 2 / (len(r) * (r ** 2).sum())))


def test_ppo_clip_with_old_equal_to_current_is_the_plain_policy_gradient():
    logp, _, rlp, adv, mask = make_inputs(7)
    _, g = grad_of(lambda x: losses.ppo_clip_loss(x, x.detach(), adv, mask, 0.2, 0.2), logp)
    _, g_pg = grad_of(lambda x: losses.no_correction_loss(x, adv, mask), logp)
    torch.testing.assert_close(g, g_pg)
    _, stats = losses.ppo_clip_loss(logp, logp, adv, mask, 0.2, 0.2)
    assert stats["clip_frac"] == 0.0


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cap", [1.5, 3.0])
def test_tis_matches_slow_loop(seed, cap):
    logp, old, rlp, adv, mask = make_inputs(seed, spread=1.0)
    lo, hi = 0.2, 0.2

    def weight(b, t):
        return min(math.exp(float(old[b, t] - rlp[b, t])), cap)

    loss, g = grad_of(lambda x: losses.tis_policy_loss(x, old, rlp, adv, mask, cap, lo, hi), logp)
    ref, g_ref = grad_of(lambda x: slow_loss(slow_ppo_terms(x, old, adv, mask, lo, hi, weight),
                                             "action_tokens"), logp)
    assert float(loss) == pytest.approx(float(ref), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(g, g_ref)
    _, stats = losses.tis_policy_loss(logp, old, rlp, adv, mask, cap, lo, hi)
    k = torch.exp(old - rlp)[mask]
    assert stats["tis_truncated_frac"] == pytest.approx(float((k > cap).double().mean()))
    assert 0 < stats["tis_truncated_frac"] < 1  # the inputs exercise both sides of the cap
    assert stats["tis_weight_mean"] == pytest.approx(float(k.clamp(max=cap).mean()))


def test_tis_with_one_step_is_classic_truncated_is():
    """pi_old == pi_theta: the gradient is -min(pi/mu, C) A grad log pi / N."""
    logp, _, rlp, adv, mask = make_inputs(3, spread=1.0)
    cap = 2.0
    _, g = grad_of(lambda x: losses.tis_policy_loss(x, x.detach(), rlp, adv, mask, cap, 0.2, 0.2),
                   logp)
    w = torch.exp(logp - rlp).clamp(max=cap) * mask
    torch.testing.assert_close(g, -(w * adv) / mask.sum())


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("normalization", ["action_tokens", "kept_tokens"])
def test_icepop_matches_slow_loop(seed, normalization):
    logp, old, rlp, adv, mask = make_inputs(seed, spread=1.0)
    band_low, band_high, lo, hi = 0.5, 2.0, 0.2, 0.2

    def weight(b, t):
        k = math.exp(float(old[b, t] - rlp[b, t]))
        return k if band_low <= k <= band_high else 0.0

    loss, g = grad_of(lambda x: losses.icepop_policy_loss(x, old, rlp, adv, mask, band_low,
                                                          band_high, lo, hi, normalization), logp)
    ref, g_ref = grad_of(lambda x: slow_loss(slow_ppo_terms(x, old, adv, mask, lo, hi, weight),
                                             normalization), logp)
    assert float(loss) == pytest.approx(float(ref), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(g, g_ref)
    _, stats = losses.icepop_policy_loss(logp, old, rlp, adv, mask, band_low, band_high, lo, hi)
    k = torch.exp(old - rlp)[mask]
    assert stats["masked_below_frac"] == pytest.approx(float((k < band_low).double().mean()))
    assert stats["masked_above_frac"] == pytest.approx(float((k > band_high).double().mean()))
    assert stats["masked_below_frac"] > 0 and stats["masked_above_frac"] > 0


def test_no_correction_matches_slow_loop():
    logp, _, rlp, adv, mask = make_inputs(5)

    def slow(x):
        total, n = 0.0, 0
        for b in range(x.shape[0]):
            for t in range(x.shape[1]):
                if mask[b, t]:
                    total = total - adv[b, t] * x[b, t]
                    n += 1
        return total / n

    loss, g = grad_of(lambda x: losses.no_correction_loss(x, adv, mask, rlp), logp)
    ref, g_ref = grad_of(slow, logp)
    assert float(loss) == pytest.approx(float(ref))
    torch.testing.assert_close(g, g_ref)
    _, stats = losses.no_correction_loss(logp, adv, mask, rlp)
    assert stats["masked_frac"] == 0.0 and stats["kl_rollout"] > 0


def test_policy_loss_dispatch_and_errors():
    logp, old, rlp, adv, mask = make_inputs(1)
    for name in losses.POLICY_LOSS_NAMES:
        loss, stats = losses.policy_loss(name, logp, rlp, adv, mask, old)
        assert torch.isfinite(loss) and "masked_frac" in stats and "kl_rollout" in stats
    dis, _ = losses.policy_loss("dis", logp, rlp, adv, mask, eps_low=0.3, eps_high=0.5)
    ref, _ = losses.dis_policy_loss(logp, rlp, adv, mask, 0.3, 0.5)
    assert float(dis) == float(ref)
    with pytest.raises(ValueError, match="needs old_logp"):
        losses.policy_loss("ppo_clip", logp, rlp, adv, mask)
    with pytest.raises(ValueError, match="must be one of"):
        losses.policy_loss("vtrace", logp, rlp, adv, mask, old)
    with pytest.raises(ValueError, match="cap"):
        losses.tis_policy_loss(logp, old, rlp, adv, mask, 0.0, 0.2, 0.2)
    with pytest.raises(ValueError, match="band_low"):
        losses.icepop_policy_loss(logp, old, rlp, adv, mask, 1.5, 5.0, 0.2, 0.2)
