"""A learner that fits real models: micro-batches equal the whole batch, minibatch statistics are
token-weighted, bf16 and gradient checkpointing, non-finite steps skipped, truncated episodes
bootstrapped, critic warm-up does not bump the version, and top_p < 1 scored as sampled."""
import os
import sys
import threading

if "triton" not in sys.modules:  # the Triton interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sao_actor_learner import core
from sao_actor_learner.builder import assemble_learner, make_critic
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.engines.torch_engine import TorchEngine
from sao_actor_learner.learner import losses
from sao_actor_learner.learner.minibatches import pack_by_tokens
from sao_actor_learner.models import lora
from sao_actor_learner.types import Rollout, collate

V = 24


def tiny_policy(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    return LlamaForCausalLM(cfg)


def learner_for(source=None, seed=0, **overrides):
    config = SAOConfig(**{"batch_size": 6, "actor_batch": 6, "max_steps": 3, **overrides})
    policy = tiny_policy(seed)
    critic = make_critic(config, policy)
    lora.prepare_learner_policy(policy, lora.LoraSpec.from_config(config), None)   # lora_rank
    return assemble_learner(config, policy, critic, source, serialize=lambda sd: b"")


def rollouts(n=6, seed=0, version=0, noise=0.5, lengths=(3, 17)):
    """Variable-length rollouts (prompts of 2-5 tokens), behaviour log-probs near the policy's."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(rng.integers(2, 6))
        a = int(rng.integers(*lengths))
        tokens = list(rng.integers(1, V, size=p + a))
        rewards = [0.0] * (p + a - 1) + [float(rng.integers(0, 2))]
        out.append(Rollout(tokens=tokens, action_mask=[0] * p + [1] * a,
                           rollout_logp=[0.0] * p + list(-3.0 + noise * rng.normal(size=a)),
                           versions=[-1] * p + [version] * a, rewards=rewards, prompt_id=i))
    return out


def on_policy(learner, rs):
    batch = collate(rs)
    with torch.no_grad():
        logp = learner.policy_trainer.logprobs(batch)
    for i, r in enumerate(rs):
        r.rollout_logp = (logp[i, :r.length].numpy() * r.action_mask).astype(np.float32)
    return rs


def params(learner):
    out = {f"policy.{k}": v.detach().clone() for k, v in learner.policy.state_dict().items()}
    if learner.estimator.has_critic:
        out.update({f"critic.{k}": v.detach().clone()
                    for k, v in learner.estimator.critic.state_dict().items()})
    return out


def assert_same_params(a, b, rtol=1e-6):
    """Every tensor within `rtol` of the other relative to its norm (elementwise relative error
    is ill-posed for entries near 0, where float summation order alone moves Adam's update)."""
    for k in a:
        diff = float((a[k].double() - b[k].double()).norm())
        assert diff <= rtol * float(b[k].double().norm()) + 1e-12, (k, diff)


def test_pack_by_tokens_respects_the_budget_and_covers_every_row():
    lengths = [5, 17, 3, 9, 9, 2, 30]
    groups = pack_by_tokens(lengths, 40)
    assert sorted(int(r) for g in groups for r in g) == list(range(7))
    for g in groups:
        assert len(g) * max(lengths[r] for r in g) <= 40 or len(g) == 1
    assert [list(g) for g in pack_by_tokens(lengths, 0)] == [list(range(7))]
    assert len(pack_by_tokens(lengths, 10 ** 6)) == 1


@pytest.mark.parametrize("overrides", [
    dict(),                                                          # SAO: DIS + critic
    dict(loss_normalization="kept_tokens", eps_low=0.05, eps_high=0.05),
    dict(policy_loss="ppo_clip", policy_minibatches=2),
    dict(algorithm="critic_free", baseline="per_prompt"),
])
def test_a_micro_batched_step_gives_the_whole_batch_step(overrides):
    rs = rollouts()
    whole = learner_for(**overrides)
    on_policy(whole, rs)
    for r in rs:   # drift, so the DIS band and the clip act
        r.rollout_logp = (r.rollout_logp + 0.2 * r.action_mask * np.cos(np.arange(r.length))
                          ).astype(np.float32)
    micro = learner_for(micro_batch_tokens=40, **overrides)
    assert len(pack_by_tokens([r.length for r in rs], 40)) >= 3
    stats_whole = whole.update(collate(rs))
    stats_micro = micro.update(collate(rs))
    assert_same_params(params(whole), params(micro))
    for key in ("policy_loss", "masked_frac", "ratio_mean", "ratio_max", "kl_rollout", "ess",
                "advantage_mean", "value_loss", "explained_variance"):
        if key in stats_whole:
            assert stats_micro[key] == pytest.approx(stats_whole[key], rel=1e-5, abs=1e-7), key


def test_minibatch_statistics_are_weighted_by_tokens():
    learner = learner_for(policy_minibatches=2, batch_size=2, actor_batch=2,
                          normalize_advantages=False)
    rs = on_policy(learner, rollouts(2, lengths=(2, 3)))
    long = on_policy(learner, rollouts(1, seed=3, lengths=(8, 9)))[0]
    rs = [rs[0], long]
    rs[0].rollout_logp = np.where(rs[0].action_mask == 1, rs[0].rollout_logp + 5.0, 0
                                  ).astype(np.float32)     # every token of row 0 masked
    stats = learner.update(collate(rs))
    n0, n1 = rs[0].num_action_tokens, rs[1].num_action_tokens
    assert stats["policy_minibatches"] == 2
    assert stats["masked_frac"] == pytest.approx(n0 / (n0 + n1))   # not (1 + 0) / 2


def test_bfloat16_and_gradient_checkpointing_train_with_finite_losses():
    rs = rollouts()
    fp32 = learner_for()
    on_policy(fp32, rs)
    ckpt = learner_for(gradient_checkpointing=True)
    stats_a, stats_b = fp32.update(collate(rs)), ckpt.update(collate(rs))
    assert_same_params(params(fp32), params(ckpt))
    assert stats_b["policy_loss"] == pytest.approx(stats_a["policy_loss"], rel=1e-5)
    bf16 = learner_for(dtype="bfloat16", micro_batch_tokens=40)
    before = params(bf16)
    stats = bf16.update(collate(rs))
    for key in ("policy_loss", "value_loss", "policy_grad_norm", "critic_grad_norm"):
        assert np.isfinite(stats[key]), key
    after = params(bf16)
    assert all(t.dtype == torch.float32 for t in after.values())     # fp32 master weights
    assert any(not torch.equal(before[k], after[k]) for k in before)
    state = bf16.policy_trainer.optimizer.state_dict()["state"]
    assert all(s["exp_avg"].dtype == torch.float32 for s in state.values())


def test_a_non_finite_loss_skips_the_step_and_leaves_the_weights():
    learner = learner_for()
    rs = on_policy(learner, rollouts())
    rs[2].rewards = rs[2].rewards.copy()
    rs[2].rewards[-1] = np.nan
    before = params(learner)
    stats = learner.update(collate(rs))
    assert stats["nonfinite_skipped"] == 1 and stats["critic_nonfinite_skipped"] == 2
    assert_same_params(before, params(learner), rtol=0)
    good = on_policy(learner, rollouts(seed=1))
    learner.update(collate(good))                       # the next finite step trains
    assert any(not torch.equal(before[k], v) for k, v in params(learner).items())


def test_truncated_episodes_are_bootstrapped_from_the_value_at_the_cut():
    rs = rollouts(4, lengths=(4, 6))
    rs[1].truncated = 1
    plain = learner_for(gamma=1.0, lambda_critic=1.0, normalize_advantages=False)
    boot = learner_for(gamma=1.0, lambda_critic=1.0, normalize_advantages=False,
                       bootstrap_truncated=True)
    for learner in (plain, boot):
        with torch.no_grad():
            learner.estimator.critic.head.bias.fill_(0.75)   # a critic that predicts 0.75
    batch = collate(rs)
    a, b = plain.estimator.estimate(batch), boot.estimator.estimate(batch)
    last = rs[1].length - 1
    assert b.returns[1, last] == pytest.approx(float(batch.rewards[1, last]) + 0.75)
    assert a.returns[1, last] == pytest.approx(float(batch.rewards[1, last]))
    for row in (0, 2, 3):                                    # not truncated: the same
        torch.testing.assert_close(a.returns[row], b.returns[row])
    assert b.stats["bootstrapped_rollouts"] == 1


class ListSource(core.RolloutSource):
    def __init__(self, rollouts):
        self.items = list(rollouts)

    def sample(self, n, timeout_s):
        out, self.items = self.items[:n], self.items[n:]
        return out


class Recorder:
    def __init__(self):
        self.published, self.reports = [], []

    def publish(self, version, payload, dropped_total=0):
        self.published.append(version)

    def report_progress(self, version, dropped_total, trained_total, **kwargs):
        self.reports.append((version, dropped_total))


def test_critic_warmup_steps_do_not_bump_the_version():
    stream = [r for s in range(5) for r in rollouts(6, seed=s)]
    learner = learner_for(ListSource(stream), critic_warmup_steps=2, max_steps=3)
    recorder = Recorder()
    learner.progress.publisher = recorder
    policy_before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    versions_seen = []
    original = learner.sampler.sample

    def sample(n, version, stop):
        versions_seen.append(version)
        return original(n, version, stop)

    learner.sampler.sample = sample
    learner.run()
    assert versions_seen == [0, 0, 0, 1, 2]      # two warm-up steps at version 0, then 3 steps
    assert learner.version == 3 and learner.critic_only_steps == 2
    assert recorder.published == [0, 1, 2, 3]      # no version for the warm-up steps
    assert (0, 12) in recorder.reports            # their rollouts are admission credit
    changed = [k for k, v in learner.policy.state_dict().items()
               if not torch.equal(v, policy_before[k])]
    assert changed


def test_top_p_rollouts_are_on_policy_for_the_learner():
    """With top_p < 1 the engine's log-probs are renormalised over the nucleus; the learner
    scores with the same nucleus, so on-policy tokens have ratio 1."""
    policy = tiny_policy(3)
    with torch.no_grad():   # a peaked model, so the nucleus at 0.6 holds few tokens
        policy.lm_head.weight.mul_(30.0)
    engine = TorchEngine(policy, eos_token_id=0, pad_token_id=0)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    gens = engine.generate(prompts, core.SamplingParams(max_new_tokens=12, temperature=1.0,
                                                        top_p=0.6, seed=0))
    rs = [Rollout(tokens=p + g.tokens, action_mask=[0] * len(p) + [1] * len(g.tokens),
                  rollout_logp=[0.0] * len(p) + g.logprobs, versions=[-1] * len(p) + g.versions,
                  rewards=[0.0] * (len(p) + len(g.tokens)), prompt_id=i)
          for i, (p, g) in enumerate(zip(prompts, gens))]
    batch = collate(rs)
    mask = batch.action_mask.bool()
    for fused in (True, False):
        learner = learner_for(seed=3, top_p=0.6, fused_logprobs=fused, batch_size=3,
                              actor_batch=3)
        learner.policy.load_state_dict(policy.state_dict())
        with torch.no_grad():
            logp = learner.policy_trainer.logprobs(batch)
        torch.testing.assert_close(logp[mask], batch.rollout_logp[mask], atol=1e-4, rtol=1e-4)
        stats = losses.drift_stats(logp, batch.rollout_logp, batch.action_mask)
        assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    full = learner_for(seed=3, top_p=1.0, batch_size=3, actor_batch=3)
    full.policy.load_state_dict(policy.state_dict())
    with torch.no_grad():
        full_logp = full.policy_trainer.logprobs(batch)
    # Scored over the whole vocabulary instead, the ratio is the nucleus mass (< 1): the bug.
    assert losses.drift_stats(full_logp, batch.rollout_logp, batch.action_mask)[
        "ratio_mean"] < 0.95


@pytest.mark.parametrize("loss", ["dis", "ppo_clip", "tis", "icepop", "none", "ppo_clip_decoupled",
                                  "gspo_decoupled"])
def test_tokens_outside_the_nucleus_give_finite_losses(loss):
    """Off-policy data at top_p < 1: some sampled tokens lie outside the learner's nucleus;
    every loss stays finite and the step trains."""
    learner = learner_for(top_p=0.3, policy_loss=loss, policy_minibatches=2)
    with torch.no_grad():
        learner.policy.lm_head.weight.mul_(20.0)    # peaked: small nuclei
    rs = rollouts(noise=2.0)
    before = params(learner)
    stats = learner.update(collate(rs))
    assert np.isfinite(stats["policy_loss"]) and stats["nonfinite_skipped"] == 0, stats
    assert any(not torch.equal(before[k], v) for k, v in params(learner).items())
