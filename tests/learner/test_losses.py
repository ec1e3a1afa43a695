"""Losses against slow, obvious per-token loops, including gradients."""
import math

import numpy as np
import pytest
import torch

from sao_actor_learner.learner import losses


def slow_dis(logp, rollout_logp, adv, mask, eps_low, eps_high, normalization):
    total, kept, n = 0.0, 0, 0
    below = above = 0
    ratios = []
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            n += 1
            r = math.exp(logp[b, t] - rollout_logp[b, t])
            ratios.append(r)
            if r < 1 - eps_low:
                below += 1
            elif r > 1 + eps_high:
                above += 1
            else:
                kept += 1
                total += r * adv[b, t]
    denom = n if normalization == "action_tokens" else kept
    ratios = np.array(ratios)
    kl = np.mean(ratios - 1 - np.log(ratios))
    ess = ratios.sum() ** 2 / (len(ratios) * (ratios ** 2).sum())
    return -total / max(denom, 1), below / n, above / n, kl, ess


def make_inputs(seed, B=4, T=9):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    rollout_logp = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.8
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = False
    return logp, rollout_logp, adv, mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("normalization", ["action_tokens", "kept_tokens"])
def test_dis_loss_matches_slow_loop(seed, normalization):
    logp, rlp, adv, mask = make_inputs(seed)
    loss, stats = losses.dis_policy_loss(logp, rlp, adv, mask, 0.3, 0.5, normalization)
    ref, below, above, kl, ess = slow_dis(logp.numpy(), rlp.numpy(), adv.numpy(), mask.numpy(),
                                          0.3, 0.5, normalization)
    assert loss.item() == pytest.approx(ref, abs=1e-12)
    assert stats["masked_below_frac"] == pytest.approx(below)
    assert stats["masked_above_frac"] == pytest.approx(above)
    assert stats["kl_rollout"] == pytest.approx(kl)
    assert stats["ess"] == pytest.approx(ess)
    assert 0 < below + above < 1  # the band really masks something in these inputs


def test_dis_gradient_is_zero_outside_the_band_and_ratio_times_adv_inside():
    logp, rlp, adv, mask = make_inputs(1)
    logp = logp.clone().requires_grad_(True)
    loss, _ = losses.dis_policy_loss(logp, rlp, adv, mask, 0.3, 0.5)
    loss.backward()
    r = torch.exp(logp.detach() - rlp)
    keep = mask & (r >= 0.7) & (r <= 1.5)
    expected = torch.where(keep, -r * adv / mask.sum(), torch.zeros_like(r))
    torch.testing.assert_close(logp.grad, expected)
    assert torch.all(logp.grad[~mask] == 0)


def test_dis_is_finite_for_extreme_ratios():
    logp = torch.tensor([[0.0, -0.1, -200.0, -0.5]], requires_grad=True)
    rlp = torch.tensor([[0.0, -300.0, -0.1, -0.5]])
    adv = torch.ones(1, 4)
    mask = torch.tensor([[0, 1, 1, 1]])
    loss, stats = losses.dis_policy_loss(logp, rlp, adv, mask, 0.3, 5.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.all(torch.isfinite(logp.grad))
    assert stats["masked_above_frac"] == pytest.approx(1 / 3)
    assert stats["masked_below_frac"] == pytest.approx(1 / 3)


def test_token_logprobs_alignment():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    tokens = torch.randint(0, 7, (2, 5))
    out = losses.token_logprobs(logits, tokens, temperature=0.7)
    assert torch.all(out[:, 0] == 0)
    for b in range(2):
        for t in range(1, 5):
            ref = torch.log_softmax(logits[b, t - 1] / 0.7, -1)[tokens[b, t]]
            assert out[b, t].item() == pytest.approx(ref.item(), abs=1e-6)


def test_value_loss_and_explained_variance():
    v = torch.tensor([[0.0, 1.0, 2.0, 9.0]], requires_grad=True)
    R = torch.tensor([[0.0, 2.0, 2.0, 0.0]])
    m = torch.tensor([[0, 1, 1, 0]])
    loss, stats = losses.value_loss(v, R, m)
    assert loss.item() == pytest.approx(0.5 * (1 + 0) / 2)
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, -0.5, 0.0, 0.0]]))
    # Clipping against old values keeps the larger loss.
    old = torch.tensor([[0.0, 0.0, 2.0, 0.0]])
    loss_c, _ = losses.value_loss(v.detach(), R, m, old_values=old, clip=0.2)
    assert loss_c.item() == pytest.approx(0.5 * ((0.2 - 2.0) ** 2) / 2)
    r = torch.randn(100)
    assert losses.explained_variance(r[None], r[None], torch.ones(1, 100)) == pytest.approx(1.0)
    assert losses.explained_variance(torch.zeros(1, 100), r[None], torch.ones(1, 100)) == pytest.approx(0.0, abs=1e-9)


def test_unknown_normalization_is_rejected():
    logp, rlp, adv, mask = make_inputs(0)
    with pytest.raises(ValueError, match="normalization"):
        losses.dis_policy_loss(logp, rlp, adv, mask, 0.3, 0.5, "tokens")
