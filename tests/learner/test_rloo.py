"""RLOO (algorithm=rloo, learner/rloo.py): leave-one-out advantages against a slow obvious loop,
the config's group check, and one learner update on a tiny model selected by config."""
import statistics

import numpy as np
import pytest
import torch

from test_baselines import rollouts_for, tiny_policy  # noqa: E402  (sets TRITON_INTERPRET first)

from sao_actor_learner.builder import assemble_learner
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.learner.rloo import LeaveOneOut, leave_one_out_advantages
from sao_actor_learner.learner.sampling import GroupSampler
from sao_actor_learner.types import collate


def slow_rloo(rewards, group_ids, scale_by_std, eps=1e-6):
    """A_i = r_i - mean of the others in i's group (/ group std); baseline that mean."""
    adv, base = [], []
    for i, g in enumerate(group_ids):
        members = [j for j, h in enumerate(group_ids) if h == g]
        if len(members) == 1:
            adv.append(0.0)
            base.append(rewards[i])
            continue
        others = [rewards[j] for j in members if j != i]
        b = sum(others) / len(others)
        a = rewards[i] - b
        if scale_by_std:
            a /= statistics.stdev([rewards[j] for j in members]) + eps
        adv.append(a)
        base.append(b)
    return adv, base


@pytest.mark.parametrize("scale_by_std", [False, True])
def test_leave_one_out_advantages_match_a_slow_loop(scale_by_std):
    rng = np.random.default_rng(0)
    group_ids = [3, 1, 3, 2, 1, 3, 2, 1, 9, 3]  # interleaved groups, a singleton, uneven sizes
    rewards = rng.normal(size=len(group_ids)).tolist()
    adv, base = leave_one_out_advantages(torch.tensor(rewards), group_ids, scale_by_std)
    want_adv, want_base = slow_rloo(rewards, group_ids, scale_by_std)
    np.testing.assert_allclose(adv.numpy(), want_adv, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(base.numpy(), want_base, rtol=1e-6, atol=1e-6)
    assert adv[group_ids.index(9)] == 0.0
    # G/(G-1) times the group-centred reward: the group's advantages sum to zero.
    if not scale_by_std:
        members = [i for i, g in enumerate(group_ids) if g == 3]
        r = torch.tensor([rewards[i] for i in members], dtype=torch.float64)
        np.testing.assert_allclose(adv[members].numpy(), (4 / 3 * (r - r.mean())).numpy())
    same, _ = leave_one_out_advantages(torch.ones(4), [0, 0, 0, 0], scale_by_std)
    assert torch.all(same == 0)


def test_rloo_needs_groups_and_is_a_config_choice():
    with pytest.raises(ConfigError, match="group_size=1 with algorithm='rloo'"):
        SAOConfig(algorithm="rloo")
    with pytest.raises(ConfigError, match="has no critic"):
        SAOConfig(algorithm="rloo", group_size=2, batch_size=8, actor_batch=4,
                  critic_warmup_steps=1)
    with pytest.raises(ConfigError, match="sao, grpo, critic_free, rloo"):
        SAOConfig(algorithm="leave_one_out")


def test_rloo_selected_by_config_runs_one_learner_update():
    config = SAOConfig(algorithm="rloo", group_size=4, batch_size=8, actor_batch=4, max_steps=5,
                       policy_loss="ppo_clip", fused_logprobs=False, rloo_scale_by_std=True)
    learner = assemble_learner(config, tiny_policy())
    assert isinstance(learner.estimator, LeaveOneOut) and not learner.estimator.has_critic
    assert isinstance(learner.sampler, GroupSampler)
    batch = collate(rollouts_for(learner, 2, 4))
    est = learner.estimator.estimate(batch)
    rewards = batch.rewards.sum(1).tolist()
    want, _ = slow_rloo(rewards, [r.group_id for r in batch.rollouts], True)
    per_rollout = est.advantages.sum(1) / batch.action_mask.sum(1)
    np.testing.assert_allclose(per_rollout.numpy(), want, atol=1e-5)
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    stats = learner.update(batch)
    assert np.isfinite(stats["policy_loss"]) and "baseline_mean" in stats
    assert any(not torch.equal(v, before[k]) for k, v in learner.policy.state_dict().items())
