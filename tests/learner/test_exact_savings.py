"""The learner step's exact savings (BENCHMARKS.md section 1, where SAO's learner step goes):
the policy step's LM head reads only the hidden states that predict action tokens
(config logprob_positions=actions) and the first of the K critic steps reuses the estimate's
forward (config critic_reuse_estimate_forward). Each against the step that does not save: the
same log-probs, entropies and gradients at the action tokens, the same parameters and statistics
after learner steps, and the saving really taken (LM-head rows, critic forwards counted)."""
import os
import sys

if "triton" not in sys.modules:  # the Triton interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch

from sao_actor_learner import kernels
from sao_actor_learner.types import collate
from test_packing import (assert_same_params, drifting, learner_for, params, rollouts,
                          run_learner_step_benchmark)

torch.set_num_threads(1)


def _actions(batch):
    return batch.action_mask.bool()


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("qwen3", {"micro_batch_layout": "packed"}),
    ("qwen2", {"top_p": 0.8}),                     # the nucleus path, not the fused kernel
    ("llama", {"fused_logprobs": False}),
])
def test_action_only_log_probs_equal_every_position_ones_at_the_actions(arch, overrides):
    batch = collate(rollouts(seed=5))
    a, b = learner_for(arch, **overrides), learner_for(arch, **overrides)
    m = _actions(batch)
    advantages = torch.linspace(-1.0, 1.0, m.numel()).reshape(m.shape)
    out = []
    for learner, actions_only in ((a, False), (b, True)):
        logp, _, ent = learner.policy_trainer.forward_and_entropy(batch, with_hidden=False,
                                                                  actions_only=actions_only)
        (logp * advantages * m).sum().backward()
        grads = {k: p.grad.clone() for k, p in learner.policy.named_parameters()
                 if p.grad is not None}
        out.append((logp.detach(), ent, grads))
    (logp_a, ent_a, grads_a), (logp_b, ent_b, grads_b) = out
    assert torch.allclose(logp_a[m], logp_b[m], atol=2e-5, rtol=1e-5)
    assert torch.allclose(ent_a[m], ent_b[m], atol=2e-5, rtol=1e-5)
    assert not logp_b[~m].any() and not ent_b[~m].any()      # nothing off the actions
    assert logp_a[~m & (torch.arange(m.shape[1]) > 0)].any()  # ... where the full forward has
    assert grads_a.keys() == grads_b.keys() and grads_a
    for k in grads_a:
        diff = float((grads_a[k] - grads_b[k]).norm())
        assert diff <= 1e-4 * float(grads_a[k].norm()) + 1e-7, (k, diff)


def test_the_lm_head_reads_only_the_rows_that_predict_actions(monkeypatch):
    batch = collate(rollouts(seed=6))
    learner = learner_for()
    rows = []
    real = kernels.fused_logprobs

    def counting(hidden, *args, **kwargs):
        rows.append(int(np.prod(hidden.shape[:-1])))
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(kernels, "fused_logprobs", counting)
    with torch.no_grad():
        learner.policy_trainer.forward_and_entropy(batch, actions_only=True)
        learner.policy_trainer.forward_and_entropy(batch, actions_only=False)
    b, w = batch.tokens.shape
    assert rows == [int(batch.action_mask.sum()), b * (w - 1)]
    assert rows[0] < rows[1]


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),                                                   # SAO: DIS, critic K=2
    ("qwen3", {"micro_batch_layout": "packed", "micro_batch_tokens": 40}),
    ("llama", {"critic": "shared_trunk"}),
    ("qwen2", {"policy_loss": "ppo_clip", "policy_minibatches": 2, "micro_batch_tokens": 30}),
    ("qwen3", {"critic_updates": 3, "token_entropy": False}),
    ("qwen3", {"critic_minibatches": 2}),      # the first slice's forward is kept
])
def test_learner_steps_with_the_savings_equal_steps_without(arch, overrides):
    saving = learner_for(arch, **overrides)
    plain = learner_for(arch, logprob_positions="all", critic_reuse_estimate_forward=False,
                        **overrides)
    rs = drifting(plain, rollouts(seed=7))
    before = params(plain)
    for _ in range(2):
        stats_a = plain.update(collate(rs))
        stats_b = saving.update(collate(rs))
        for key in ("policy_loss", "masked_frac", "kl_rollout", "ess", "token_entropy_mean",
                    "value_loss", "value_loss_last", "explained_variance"):
            if key in stats_a:
                assert stats_b[key] == pytest.approx(stats_a[key], rel=1e-4, abs=1e-6), key
    assert_same_params(params(plain), params(saving))
    assert any(not torch.equal(before[k], v) for k, v in params(saving).items()
               if k.startswith("policy."))


def _counting_critic_forwards(estimator):
    calls = []
    real = estimator._raw_values

    def counting(batch):
        calls.append(batch.size)
        return real(batch)

    estimator._raw_values = counting
    return calls


@pytest.mark.parametrize("reuse,micro_batch_tokens,forwards", [
    (True, 0, 2),     # the estimate's forward is the first critic step's: 1 + (K - 1)
    (False, 0, 3),    # 1 + K
    (True, 40, None),  # several micro-batches: nothing kept (counted below)
])
def test_the_first_critic_step_reuses_the_estimates_forward(reuse, micro_batch_tokens,
                                                            forwards):
    learner = learner_for(critic_reuse_estimate_forward=reuse,
                          micro_batch_tokens=micro_batch_tokens)
    batch = collate(drifting(learner, rollouts(seed=8)))
    learner.update(batch)           # the critic is in training mode after its first update
    calls = _counting_critic_forwards(learner.estimator)
    learner.update(batch)
    if forwards is None:
        groups = len(calls) // 3
        assert groups > 1 and len(calls) == 3 * groups
    else:
        assert len(calls) == forwards
        assert calls == [batch.size] * forwards


@pytest.mark.parametrize("reuse", [True, False])
def test_with_two_critic_minibatches_the_first_slices_forward_is_reused(reuse):
    """K=2 epochs of 2 slices: the estimate runs the first slice with gradient and the second
    without (2 forwards), the steps then run 3 of their 4 forwards; without the reuse, one
    forward of the whole batch and 4. Rows through the critic: 2.5 vs 3 batches."""
    learner = learner_for(critic_reuse_estimate_forward=reuse, critic_minibatches=2)
    batch = collate(drifting(learner, rollouts(seed=8)))
    learner.update(batch)
    calls = _counting_critic_forwards(learner.estimator)
    learner.update(batch)
    half = (batch.size + 1) // 2
    if reuse:
        assert calls == [half, batch.size - half, batch.size - half, half, batch.size - half]
    else:
        assert calls == [batch.size, half, batch.size - half, half, batch.size - half]


def test_a_critic_in_eval_mode_or_without_gradient_keeps_no_forward():
    learner = learner_for()
    batch = collate(rollouts(seed=9))
    learner.estimator.critic.train()
    assert learner.estimator.estimate(batch).forward_cache is not None
    with torch.no_grad():
        assert learner.estimator.estimate(batch).forward_cache is None
    learner.estimator.critic.eval()
    assert learner.estimator.estimate(batch).forward_cache is None


def test_a_kept_forward_must_be_the_steps_own_rows_in_one_micro_batch():
    learner = learner_for()
    batch = collate(rollouts(seed=10))
    learner.estimator.critic.train()
    estimate = learner.estimator.estimate(batch)
    kept = estimate.forward_cache
    scratch = torch.zeros(batch.tokens.shape)
    with pytest.raises(ValueError, match="must be this step's rows in one micro-batch"):
        learner.estimator.optimizer_step(batch, estimate, np.arange(batch.size - 1), scratch,
                                         kept)


def test_the_learner_step_benchmark_compares_the_step_with_and_without_the_savings(tmp_path):
    """Format only: both cells, their parts, the ratio row and a profile (no timing asserted)."""
    result = run_learner_step_benchmark(tmp_path, "--savings=off,on", "--top_ops=5")
    cells = {c["savings"]: c for c in result["cells"]}
    assert set(cells) == {"off", "on"}, result
    for c in cells.values():
        assert c["policy_loss_finite"] and len(c["top_ops"]) == 5
        assert all(c[k] > 0 for k in ("estimate_s", "policy_step_s", "critic_step_s"))
        assert 0 < sum(op["share"] for op in c["top_ops"]) <= 1.0 + 1e-6
    [ratio] = result["savings_ratios"]
    assert ratio["step_s_on_over_off"] == pytest.approx(cells["on"]["step_s"] /
                                                        cells["off"]["step_s"])
