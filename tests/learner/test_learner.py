"""The SAO learner's update on a real (tiny, locally built) Hugging Face model."""
import os
import subprocess
import sys
import threading

if "triton" not in sys.modules:  # the Triton interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sao_actor_learner import core
from sao_actor_learner.builder import assemble_learner
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.models.value import ValueModel
from sao_actor_learner.types import Rollout, collate

V = 16


def tiny_policy(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def make_learner(source=None, publisher=None, **overrides):
    config = SAOConfig(batch_size=4, actor_batch=4, max_steps=5, **overrides)
    policy = tiny_policy()
    critic = ValueModel.from_policy(policy)
    critic.freeze(config.critic_frozen_patterns)
    return assemble_learner(config, policy, critic, source, publisher=publisher,
                            serialize=lambda sd: b"x" * len(sd))


def on_policy_rollouts(learner, n=4, seed=0, version=0):
    """Rollouts whose rollout_logp is exactly the current policy's: ratios are 1."""
    rng = np.random.default_rng(seed)
    rollouts = []
    for i in range(n):
        prompt = list(rng.integers(1, V, size=3))
        action = list(rng.integers(1, V, size=int(rng.integers(2, 6))))
        tokens = prompt + action
        mask = [0] * 3 + [1] * len(action)
        rewards = [0.0] * (len(tokens) - 1) + [float(rng.integers(0, 2))]
        rollouts.append(Rollout(tokens=tokens, action_mask=mask, rollout_logp=np.zeros(len(tokens)),
                                versions=[-1] * 3 + [version] * len(action), rewards=rewards,
                                prompt_id=i))
    batch = collate(rollouts)
    with torch.no_grad():
        logp = learner.policy_trainer.logprobs(batch)
    for i, r in enumerate(rollouts):
        r.rollout_logp = (logp[i, :r.length].numpy() * r.action_mask).astype(np.float32)
    return rollouts


def test_on_policy_update_masks_nothing_and_trains_only_unfrozen_critic_params():
    learner = make_learner()
    rollouts = on_policy_rollouts(learner)
    batch = collate(rollouts)
    critic = learner.estimator.critic
    critic_before = {k: v.clone() for k, v in critic.state_dict().items()}
    policy_before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    stats = learner.update(batch)
    assert stats["masked_frac"] == 0.0
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["kl_rollout"] == pytest.approx(0.0, abs=1e-6)
    after = critic.state_dict()
    for name, before in critic_before.items():
        changed = not torch.equal(before, after[name])
        frozen = any(p in name for p in ("self_attn", "embed_tokens", "norm"))
        if frozen:
            assert not changed, f"frozen critic parameter {name} changed"
    assert not torch.equal(critic_before["body.layers.0.mlp.up_proj.weight"],
                           after["body.layers.0.mlp.up_proj.weight"])
    assert not torch.equal(critic_before["head.weight"], after["head.weight"])
    changed_policy = [k for k, v in learner.policy.state_dict().items()
                      if not torch.equal(v, policy_before[k])]
    assert any("self_attn" in k for k in changed_policy)  # the policy trains everything


def test_k_critic_updates_take_k_optimizer_steps():
    for k in (1, 3):
        learner = make_learner(critic_updates=k)
        learner.update(collate(on_policy_rollouts(learner)))
        state = learner.estimator.optimizer.state_dict()["state"]
        assert all(int(s["step"]) == k for s in state.values())


def test_critic_warmup_step_leaves_policy_unchanged():
    learner = make_learner()
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    stats = learner.update(collate(on_policy_rollouts(learner)), train_policy=False)
    assert all(torch.equal(v, before[k]) for k, v in learner.policy.state_dict().items())
    assert "policy_loss" not in stats and "value_loss" in stats


def test_off_band_tokens_are_dropped_from_gradient():
    learner = make_learner(eps_low=0.3, eps_high=0.3, normalize_advantages=False)
    rollouts = on_policy_rollouts(learner)
    # Make every rollout look very stale: its sampling probabilities were much higher.
    for r in rollouts:
        r.rollout_logp = np.where(r.action_mask == 1, r.rollout_logp + 2.0, 0).astype(np.float32)
    stats = learner.update(collate(rollouts))
    assert stats["masked_below_frac"] == 1.0
    assert stats["policy_grad_norm"] == 0.0


class ListReader(core.RolloutSource):
    """An in-memory RolloutSource, to test the learner's staleness filter alone."""

    def __init__(self, rollouts):
        self.rollouts = list(rollouts)

    def sample(self, n, timeout_s):
        out, self.rollouts = self.rollouts[:n], self.rollouts[n:]
        return out

    def queue_size(self):
        return len(self.rollouts)


def test_stale_rollouts_are_dropped_and_counted():
    first = make_learner(max_staleness=1)
    fresh = on_policy_rollouts(first, n=4, version=4)
    stale = on_policy_rollouts(first, n=3, version=3, seed=1)
    learner = make_learner(max_staleness=1,
                           source=ListReader(stale[:2] + fresh[:2] + stale[2:] + fresh[2:]))
    learner.version = 5
    got, _, dropped = learner.sampler.sample(4, learner.version, threading.Event())
    assert dropped == 3 and learner.dropped_stale == 3
    assert all(r.staleness(5) <= 1 for r in got) and len(got) == 4


def test_freeze_rejects_unknown_pattern():
    critic = ValueModel.from_policy(tiny_policy())
    with pytest.raises(ValueError, match="match no critic parameter"):
        critic.freeze(("attention_typo",))


def test_fused_logprobs_path_matches_plain_logits_path():
    learner = make_learner()
    batch = collate(on_policy_rollouts(learner))
    fused = learner.policy_trainer.logprobs(batch)
    plain = make_learner(fused_logprobs=False).policy_trainer.logprobs(batch)
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gae", ["skip_observation", "standard"])
def test_triton_kernels_give_the_same_update_as_torch(gae):
    """The learner on Triton kernels (interpreted on CPU) vs on the torch references."""
    from sao_actor_learner import kernels
    if not kernels.interpreter_enabled():
        # Triton was imported earlier in this process without the interpreter: rerun this test
        # in a fresh process that selects it before triton loads.
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             f"{__file__}::test_triton_kernels_give_the_same_update_as_torch[{gae}]"],
            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
            timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        assert "1 passed" in proc.stdout
        return
    stats, params = {}, {}
    for backend in ("triton", "torch"):
        learner = make_learner(kernel_backend=backend, gae=gae)
        rollouts = on_policy_rollouts(learner)
        for r in rollouts:  # off-policy enough that the DIS band masks some tokens
            r.rollout_logp = (r.rollout_logp + 0.3 * r.action_mask * np.sin(np.arange(r.length))).astype(np.float32)
        stats[backend] = learner.update(collate(rollouts))
        params[backend] = learner.policy.state_dict()
    for key in ("policy_loss", "value_loss", "advantage_mean", "kl_rollout", "masked_frac",
                "policy_grad_norm", "token_entropy_mean", "chi2_token"):
        assert stats["triton"][key] == pytest.approx(stats["torch"][key], rel=1e-4, abs=1e-5), key
    for name, p in params["torch"].items():
        torch.testing.assert_close(params["triton"][name], p, atol=1e-5, rtol=1e-4)


class RecordingPublisher:
    """Keeps what the learner publishes and reports (the variable server's own tests cover
    the wire)."""

    def __init__(self):
        self.published = []
        self.reports = []

    def publish(self, version, payload, dropped_total=0):
        self.published.append((version, len(payload), dropped_total))

    def report_progress(self, version, dropped_total, trained_total, **kwargs):
        self.reports.append((version, dropped_total, trained_total))


def test_value_pretraining_trains_only_the_critic_and_keeps_admission_open():
    rollouts = [r for seed in range(3) for r in on_policy_rollouts(make_learner(), n=4, seed=seed)]
    publisher = RecordingPublisher()
    learner = make_learner(value_pretrain_rollouts=12, value_pretrain_epochs=2,
                           value_pretrain_minibatch=4, source=ListReader(rollouts),
                           publisher=publisher)
    policy_before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    stats = learner.pretrain_value()
    # 12 rollouts: whole prompts held out (the yardstick from now on), at least 2 (here one
    # prompt drawn 3 times), the rest fitted in minibatches of 4.
    assert stats["rollouts"] == 12 and stats["optimizer_steps"] <= 2 * 2
    assert len(learner.yardstick.rollouts) == 3
    assert learner.estimator.optimizer.param_groups[0]["lr"] == learner.estimator.config.critic_lr
    assert all(torch.equal(v, policy_before[k]) for k, v in learner.policy.state_dict().items())
    # The critic took its optimizer steps (the best held-out evaluation's weights are kept,
    # which with these random rewards may be the starting ones).
    assert stats["optimizer_steps"] > 0
    assert all(int(s["step"]) == stats["optimizer_steps"]
               for s in learner.estimator.optimizer.state_dict()["state"].values())
    assert learner.version == 0 and learner.consumed_without_version == 12
    # Admission credit grows after each pretraining step, in small progress reports: the
    # weights are not re-sent.
    assert publisher.published == []
    assert [r[:2] for r in publisher.reports] == [(0, 4), (0, 8), (0, 12)]


def test_resume_keeps_the_critic_state_value_pretraining_added():
    """learner_state -> restore: the critic and its optimizer, the pretraining's outcome, the
    yardstick's rollouts and readings come back, and pretraining is not run again."""
    rollouts = [r for seed in range(3) for r in on_policy_rollouts(make_learner(), n=4, seed=seed)]
    first = make_learner(value_pretrain_rollouts=12, value_pretrain_epochs=1,
                         value_pretrain_minibatch=4, source=ListReader(rollouts))
    first.pretrain_value()
    first.pretrain_done = True
    first.measure_critic()
    state = first.learner_state()
    second = make_learner(value_pretrain_rollouts=12, source=ListReader([]))
    second.restore(state)
    assert second.pretrain_done and second.value_pretrain_summary == first.value_pretrain_summary
    assert [r.key for r in second.yardstick.rollouts] == [r.key for r in first.yardstick.rollouts]
    assert second.yardstick.measured == first.yardstick.measured == {
        0: pytest.approx(first.yardstick.measured[0])}
    assert not second.yardstick.due(0)          # version 0 was measured before the restart
    for (n, p), (_, q) in zip(first.estimator.critic.named_parameters(),
                              second.estimator.critic.named_parameters()):
        assert torch.equal(p, q), n
