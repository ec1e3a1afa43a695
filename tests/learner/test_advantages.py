"""Advantage estimators against slow, obvious per-row Python loops."""
import math

import numpy as np
import pytest
import torch

from sao_actor_learner.learner import advantages as adv_lib


def slow_skip_observation_gae(rewards, values, mask, gamma, lams, boot=None):
    """docs/METHOD.md section 7 written out literally, one row at a time."""
    B, T = rewards.shape
    A = np.zeros((B, T))
    R = np.zeros((B, T))
    for b in range(B):
        pos = [t for t in range(T) if mask[b, t]]
        n = len(pos)
        a_next = 0.0
        for k in range(n - 1, -1, -1):
            t = pos[k]
            if k == n - 1:
                v_next = 0.0 if boot is None else boot[b]
            else:
                v_next = values[b, pos[k + 1]]
            delta = rewards[b, t] + gamma * v_next - values[b, t]
            a = delta + gamma * lams[b] * (a_next if k < n - 1 else 0.0)
            A[b, t] = a
            R[b, t] = a + values[b, t]
            a_next = a
    return A, R


def slow_token_level_gae(rewards, values, mask, gamma, lams):
    B, T = rewards.shape
    A = np.zeros((B, T))
    for b in range(B):
        pos = [t for t in range(T) if mask[b, t]]
        if not pos:
            continue
        first, last = pos[0], pos[-1]
        a_next = 0.0
        for t in range(last, first - 1, -1):
            r = rewards[b, t] if mask[b, t] else 0.0
            v_next = values[b, t + 1] if t < last else 0.0
            a = r + gamma * v_next - values[b, t] + (gamma * lams[b] * a_next if t < last else 0.0)
            A[b, t] = a if mask[b, t] else 0.0
            a_next = a
    R = np.where(mask, A + values, 0.0)
    return A, R


def random_agentic_batch(seed, B=5, T=23):
    """Prompt, then alternating action / observation segments; one row without action tokens."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T), dtype=bool)
    for b in range(B - 1):
        t = rng.integers(1, 5)
        while t < T:
            seg = rng.integers(1, 5)
            mask[b, t:t + seg] = True
            t += seg + rng.integers(0, 4)
    # Padding at the end of some rows.
    mask[1, T - 4:] = False
    rewards = rng.normal(size=(B, T)) * mask
    values = rng.normal(size=(B, T))
    return rewards, values, mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_skip_observation_gae_matches_slow_loop(seed, gamma):
    rewards, values, mask = random_agentic_batch(seed)
    lams = np.random.default_rng(seed + 100).uniform(0.5, 1.0, size=rewards.shape[0])
    boot = np.random.default_rng(seed + 200).normal(size=rewards.shape[0])
    for lam_arg, lam_np in ((torch.tensor(lams), lams), (0.95, np.full_like(lams, 0.95))):
        for b_arg, b_np in ((None, None), (torch.tensor(boot), boot)):
            A, R = adv_lib.skip_observation_gae(torch.tensor(rewards), torch.tensor(values),
                                                torch.tensor(mask), gamma, lam_arg, b_arg)
            A_ref, R_ref = slow_skip_observation_gae(rewards, values, mask, gamma, lam_np, b_np)
            np.testing.assert_allclose(A.numpy(), A_ref, atol=1e-10)
            np.testing.assert_allclose(R.numpy(), R_ref, atol=1e-10)


def test_skip_observation_equals_plain_gae_on_action_only_subsequence():
    rewards, values, mask = random_agentic_batch(7)
    lam = 0.9
    A, R = adv_lib.skip_observation_gae(torch.tensor(rewards), torch.tensor(values),
                                        torch.tensor(mask), 1.0, lam)
    for b in range(rewards.shape[0]):
        idx = np.flatnonzero(mask[b])
        if idx.size == 0:
            continue
        sub_mask = torch.ones(1, idx.size, dtype=torch.bool)
        A_sub, _ = adv_lib.token_level_gae(torch.tensor(rewards[b, idx])[None],
                                           torch.tensor(values[b, idx])[None], sub_mask, 1.0, lam)
        np.testing.assert_allclose(A.numpy()[b, idx], A_sub.numpy()[0], atol=1e-10)


def test_observation_and_prompt_tokens_get_zero_advantage():
    rewards, values, mask = random_agentic_batch(3)
    for fn in (adv_lib.skip_observation_gae, adv_lib.token_level_gae):
        A, R = fn(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), 1.0, 0.95)
        assert torch.all(A[~torch.tensor(mask)] == 0)
        assert torch.all(R[~torch.tensor(mask)] == 0)
    # The row without action tokens is all zeros.
    assert torch.all(A[-1] == 0)


@pytest.mark.parametrize("seed", range(3))
def test_token_level_gae_matches_slow_loop(seed):
    rewards, values, mask = random_agentic_batch(seed)
    lams = np.full(rewards.shape[0], 0.8)
    A, R = adv_lib.token_level_gae(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask),
                                   0.95, 0.8)
    A_ref, R_ref = slow_token_level_gae(rewards, values, mask, 0.95, lams)
    np.testing.assert_allclose(A.numpy(), A_ref, atol=1e-10)
    np.testing.assert_allclose(R.numpy(), R_ref, atol=1e-10)


def test_skip_and_token_level_differ_when_observations_exist():
    rewards, values, mask = random_agentic_batch(1)
    A1, _ = adv_lib.skip_observation_gae(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), 1.0, 0.9)
    A2, _ = adv_lib.token_level_gae(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), 1.0, 0.9)
    assert not torch.allclose(A1, A2)


def test_lambda_one_gives_monte_carlo_returns():
    rewards, values, mask = random_agentic_batch(5)
    _, R = adv_lib.skip_observation_gae(torch.tensor(rewards), torch.tensor(values),
                                        torch.tensor(mask), 1.0, 1.0)
    for b in range(rewards.shape[0]):
        idx = np.flatnonzero(mask[b])
        for k, t in enumerate(idx):
            np.testing.assert_allclose(R[b, t].item(), rewards[b, idx[k:]].sum(), atol=1e-9)


def test_length_adaptive_lambda():
    n = torch.tensor([0, 1, 2, 10, 1000])
    lam = adv_lib.length_adaptive_lambda(n, alpha=1.5)
    expected = [0.0, max(0.0, 1 - 1 / 1.5), 1 - 1 / 3.0, 1 - 1 / 15.0, 1 - 1 / 1500.0]
    np.testing.assert_allclose(lam.numpy(), expected, rtol=1e-6)
    assert adv_lib.length_adaptive_lambda(torch.tensor([1]), alpha=0.05).item() == 0.0  # clamped
    with pytest.raises(ValueError, match="alpha"):
        adv_lib.length_adaptive_lambda(n, alpha=0.0)


def test_bad_lambda_shape_is_rejected():
    r, v, m = random_agentic_batch(0)
    with pytest.raises(ValueError, match="lambda"):
        adv_lib.skip_observation_gae(torch.tensor(r), torch.tensor(v), torch.tensor(m), 1.0,
                                     torch.ones(2))


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 0]])
    w = adv_lib.masked_whiten(x, m)
    vals = w[m.bool()]
    assert abs(vals.mean().item()) < 1e-6 and abs(vals.std(unbiased=False).item() - 1) < 1e-5
    assert w[0, 2] == 0 and w[1, 2] == 0
