"""Value pretraining as a fit (critic/fit.py): a predictable signal is learned, the stopping
rule, the budget's errors, the held-out split; the learner's critic minibatches."""
import dataclasses

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sao_actor_learner.config import SAOConfig
from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.critic import fit as fit_lib
from sao_actor_learner.critic.rollout_set import load_rollouts, save_rollouts
from sao_actor_learner.learner.estimators import CriticGAE
from sao_actor_learner.models.value import ValueModel
from sao_actor_learner.types import Rollout, collate

V = 16
SIGNAL = 7   # a prompt whose last token is SIGNAL succeeds


def tiny_critic(seed=0, **learner):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    critic = ValueModel.from_policy(LlamaForCausalLM(cfg))
    config = SAOConfig(batch_size=4, actor_batch=4, **learner).section(LearnerConfig)
    critic.freeze(config.critic_frozen_patterns)
    return CriticGAE(critic, config)


def predictable_rollouts(n, seed=0, noise=0.0):
    """The reward is 1 for the prompts made of SIGNAL tokens (half of them): a critic can tell
    from the first action token on, through its frozen attention; `noise` flips that share
    of the rewards."""
    rng = np.random.default_rng(seed)
    others = [t for t in range(1, V) if t != SIGNAL]
    out = []
    for i in range(n):
        good = i % 2 == 1
        prompt = [SIGNAL] * 3 if good else [int(t) for t in rng.choice(others, size=3)]
        action = list(rng.integers(1, V, size=3))
        reward = float(good)
        if rng.uniform() < noise:
            reward = 1.0 - reward
        tokens = prompt + action
        out.append(Rollout(tokens=tokens, action_mask=[0] * 3 + [1] * 3,
                           rollout_logp=np.zeros(6), versions=[-1] * 3 + [0] * 3,
                           rewards=[0.0] * 5 + [reward], prompt_id=seed * 10000 + i))
    return out


def test_a_critic_fitted_to_a_predictable_signal_reaches_high_explained_variance():
    estimator = tiny_critic(critic_lr=1e-3)
    train, held = predictable_rollouts(128), predictable_rollouts(32, seed=1)
    before = fit_lib.heldout_metrics(estimator, held, pad_id=0)["heldout_ev"]
    result = fit_lib.fit(estimator, train, held,
                         fit_lib.FitSettings(max_epochs=10, minibatch_size=16, patience=30))
    after = fit_lib.heldout_metrics(estimator, held, pad_id=0)["heldout_ev"]
    assert before == pytest.approx(0.0, abs=1e-6)     # zero head: a constant prediction
    assert after > 0.9
    # The best evaluation's parameters are the ones kept.
    assert after == pytest.approx(result.best["heldout_ev"], abs=1e-6)
    assert result.optimizer_steps == 10 * 8 and result.stopped == "max_epochs"
    # Only the critic's trainable parameters moved: attention stayed frozen.
    assert all(not p.requires_grad for n, p in estimator.critic.body.named_parameters()
               if "self_attn" in n)


def test_the_fit_stops_on_a_plateau_and_at_the_target():
    # Pure noise: nothing to learn, so the held-out EV never improves by min_delta.
    estimator = tiny_critic(critic_lr=1e-3)
    train, held = predictable_rollouts(64, noise=0.5), predictable_rollouts(32, 1, noise=0.5)
    settings = fit_lib.FitSettings(max_epochs=50, minibatch_size=16, patience=2,
                                   min_delta=0.5)
    result = fit_lib.fit(estimator, train, held, settings)
    assert result.stopped == "plateau"
    assert len(result.curve) == 3 and result.optimizer_steps == 2 * 4   # eval 0, 1, 2
    estimator = tiny_critic(critic_lr=1e-3)
    result = fit_lib.fit(estimator, predictable_rollouts(64), predictable_rollouts(32, 1),
                         dataclasses.replace(settings, patience=50, target_ev=0.3))
    assert result.stopped == "target_ev" and result.curve[-1]["heldout_ev"] >= 0.3
    assert result.best["heldout_ev"] >= 0.3


def test_a_budget_that_cannot_be_fitted_is_a_clear_error():
    estimator = tiny_critic()
    same = predictable_rollouts(20)
    for r in same:
        r.rewards[:] = 0.0
        r.rewards[-1] = 1.0
    with pytest.raises(fit_lib.ValueFitError, match="all 30 rollouts have reward 1"):
        fit_lib.fit(estimator, same, predictable_rollouts(10, 1) and same[:10],
                    fit_lib.FitSettings())
    with pytest.raises(fit_lib.ValueFitError, match="got no rollouts"):
        fit_lib.check_fittable([])
    with pytest.raises(fit_lib.ValueFitError, match="value_pretrain_rollouts"):
        fit_lib.split_heldout(predictable_rollouts(2), 0.5)
    with pytest.raises(fit_lib.ValueFitError, match="minibatch_size"):
        fit_lib.FitSettings(minibatch_size=0).check()


def grouped_rollouts(groups, per_group=4, first_group=0, prompt_of=lambda g: g):
    """`groups` groups of `per_group` rollouts; group g's prompt text is a function of
    prompt_of(g) (equal values: the same prompt text under another group id)."""
    rollouts = predictable_rollouts(groups * per_group)
    for i, r in enumerate(rollouts):
        g = first_group + i // per_group
        p = prompt_of(g)
        r.tokens[:3] = [1 + p % 15, 1 + (p // 15) % 15, 1 + (p // 225) % 15]
        r.group_id = g
        r.prompt_id = g
    return rollouts


def sides(train, held):
    return ({fit_lib.prompt_key(r) for r in train}, {fit_lib.prompt_key(r) for r in held})


def test_heldout_split_is_seeded_exact_and_keeps_prompts_together():
    rollouts = grouped_rollouts(10)            # 10 prompts x 4 samples
    train, held = fit_lib.split_heldout(rollouts, 0.2, seed=3)
    assert len(held) == 8 and len(train) == 32
    assert {r.group_id for r in held}.isdisjoint({r.group_id for r in train})
    again, held_again = fit_lib.split_heldout(rollouts, 0.2, seed=3)
    assert [r.prompt_id for r in held] == [r.prompt_id for r in held_again]


@pytest.mark.parametrize("seed", range(5))
def test_no_prompt_text_is_on_both_sides_of_the_heldout_split(seed):
    """A prompt drawn again (a later pass over the dataset) comes back under a new group id;
    single rollouts (group size 1) of one prompt text have ids of their own: neither puts the
    prompt text on both sides."""
    rollouts = grouped_rollouts(10) + grouped_rollouts(6, first_group=10,
                                                       prompt_of=lambda g: g - 10)
    rollouts += grouped_rollouts(8, per_group=1, first_group=20, prompt_of=lambda g: g % 3)
    train, held = fit_lib.split_heldout(rollouts, 0.2, seed=seed)
    assert len(train) + len(held) == len(rollouts) and len(held) >= 14
    train_prompts, held_prompts = sides(train, held)
    assert train_prompts and held_prompts and train_prompts.isdisjoint(held_prompts)
    assert {r.group_id for r in held}.isdisjoint({r.group_id for r in train})


def test_the_split_is_decided_on_every_rank_s_prompts_together():
    """Two ranks of a learner group, each with its own draw of the same prompts: a prompt held
    out on one is held out on the other."""
    a = grouped_rollouts(10)
    b = grouped_rollouts(10, first_group=100, prompt_of=lambda g: (g - 100) * 7 % 10)
    local = [[(r.group_id, fit_lib.prompt_key(r)) for r in part] for part in (a, b)]
    train_a, held_a = fit_lib.split_heldout(a, 0.2, seed=1, gather=lambda obj: [obj, local[1]])
    train_b, held_b = fit_lib.split_heldout(b, 0.2, seed=1, gather=lambda obj: [local[0], obj])
    train_prompts, held_prompts = sides(train_a + train_b, held_a + held_b)
    assert train_prompts.isdisjoint(held_prompts) and len(held_a) + len(held_b) >= 16
    assert held_prompts and train_a and train_b


def test_a_budget_of_one_prompt_cannot_be_split():
    rollouts = grouped_rollouts(5, prompt_of=lambda g: 3)     # one prompt under 5 group ids
    with pytest.raises(fit_lib.ValueFitError, match="1 distinct prompt"):
        fit_lib.split_heldout(rollouts, 0.2)


def test_heldout_metrics_match_the_slow_explained_variance():
    estimator = tiny_critic()
    with torch.no_grad():
        estimator.critic.head.weight.normal_()
    held = predictable_rollouts(10, seed=4)
    got = fit_lib.heldout_metrics(estimator, held, pad_id=0, chunk=3)
    batch = collate(held)
    est = estimator.estimate(batch)
    m = batch.action_mask.bool()
    r, v = est.returns[m].double().numpy(), est.values[m].double().numpy()
    assert got["heldout_ev"] == pytest.approx(1 - np.var(r - v) / np.var(r), rel=1e-6)
    assert got["heldout_tokens"] == m.sum()


def test_critic_minibatches_take_k_times_m_optimizer_steps():
    estimator = tiny_critic(critic_updates=2, critic_minibatches=3)
    batch = collate(predictable_rollouts(6))
    stats = estimator.update(batch, estimator.estimate(batch))
    assert stats["critic_optimizer_steps"] == 6
    state = estimator.optimizer.state_dict()["state"]
    assert all(int(s["step"]) == 6 for s in state.values())


def test_one_minibatch_update_equals_the_whole_batch_step_with_micro_batches():
    # critic_minibatches=1 with a token budget (micro-batches) is the whole-batch step.
    a = tiny_critic(critic_updates=1)
    b = tiny_critic(critic_updates=1, micro_batch_tokens=12)
    batch = collate(predictable_rollouts(6))
    a.update(batch, a.estimate(batch))
    b.update(batch, b.estimate(batch))
    for (n, p), (_, q) in zip(a.critic.named_parameters(), b.critic.named_parameters()):
        assert torch.allclose(p, q, atol=1e-6), n


def test_rollout_sets_round_trip(tmp_path):
    rollouts = predictable_rollouts(5)
    rollouts[2].truncated = 1
    path = save_rollouts(str(tmp_path / "set.npz"), rollouts, model="m", samples=4)
    back, meta = load_rollouts(path)
    assert meta == {"model": "m", "samples": 4}
    for a, b in zip(rollouts, back):
        for name in ("tokens", "action_mask", "rollout_logp", "versions", "rewards"):
            assert np.array_equal(getattr(a, name), getattr(b, name))
        assert (a.prompt_id, a.truncated, a.group_id) == (b.prompt_id, b.truncated, b.group_id)
