"""critic=shared_trunk: a value head on the policy's last hidden state, trained with the policy
loss (docs/METHOD.md section 6, the shared-trunk option). Values, gradients into head and trunk,
one learner step against a slow, obvious computation (K = 1, 2, 3 critic steps: the joint one,
then head-only ones), the one-pass and micro-batched paths, HF architectures, and checkpoints (the head and its optimizer saved and restored; a resumed run
ends with the weights of an uninterrupted one)."""
import copy
import os
import sys

if "triton" not in sys.modules:  # the Triton interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from sao_actor_learner import core
from sao_actor_learner.builder import assemble_learner, make_critic
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.learner.estimators import CriticGAE, SharedTrunkGAE
from sao_actor_learner.models.factory import make_tiny_model
from sao_actor_learner.models.value import ValueModel, base_model_of
from sao_actor_learner.types import Rollout, collate

V = 20


def tiny_policy(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, max_position_embeddings=64))


def shared_learner(policy=None, source=None, publisher=None, **overrides):
    config = SAOConfig(**{"batch_size": 6, "actor_batch": 6, "max_steps": 5,
                          "critic": "shared_trunk", **overrides})
    policy = policy if policy is not None else tiny_policy()
    return assemble_learner(config, policy, None, source, publisher=publisher,
                            serialize=lambda sd: b"")


def rollouts(n=6, seed=0, vocab=V, version=0):
    """Single-turn rollouts: a 2-4 token prompt, 2-7 action tokens, a 0/1 reward at the end."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, a = int(rng.integers(2, 5)), int(rng.integers(2, 8))
        tokens = list(rng.integers(1, vocab, size=p + a))
        out.append(Rollout(tokens=tokens, action_mask=[0] * p + [1] * a,
                           rollout_logp=[0.0] * (p + a), versions=[-1] * p + [version] * a,
                           rewards=[0.0] * (p + a - 1) + [float(rng.integers(0, 2))],
                           prompt_id=i, actor_id=0, seq=i))
    return out


def near_policy(learner, rs, noise=0.4, seed=1):
    """Behaviour log-probs = the policy's plus noise, so the DIS band keeps most tokens."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        logp = learner.policy_trainer.logprobs(collate(rs))
    for i, r in enumerate(rs):
        r.rollout_logp = ((logp[i, :r.length].numpy() + noise * rng.normal(size=r.length))
                          * r.action_mask).astype(np.float32)
    return rs


def randomize_head(learner, seed=3):
    """A zero head passes no value gradient into the trunk; give it weights first."""
    g = torch.Generator().manual_seed(seed)
    head = learner.estimator.critic.head
    with torch.no_grad():
        head.weight.copy_(0.3 * torch.randn(head.weight.shape, generator=g))
        head.bias.fill_(0.2)


def test_the_value_head_sits_on_the_policys_own_trunk():
    policy = tiny_policy()
    critic = ValueModel.sharing_trunk(policy)
    assert critic.shares_trunk and critic.body is base_model_of(policy)
    assert not ValueModel.from_policy(policy).shares_trunk
    batch = collate(rollouts())
    values = critic(batch.tokens, batch.attention_mask)
    assert values.shape == batch.tokens.shape and values.dtype == torch.float32
    assert torch.count_nonzero(values) == 0                       # zero-initialised head
    learner = shared_learner(policy)
    assert isinstance(learner.estimator, SharedTrunkGAE)
    assert learner.estimator.params == list(learner.estimator.critic.head.parameters())
    randomize_head(learner)
    head = learner.estimator.critic.head
    with torch.no_grad():
        hidden = base_model_of(policy)(input_ids=batch.tokens,
                                       attention_mask=batch.attention_mask).last_hidden_state
        expected = hidden @ head.weight[0] + head.bias[0]
    aligned, last = learner.estimator.values(batch)
    torch.testing.assert_close(aligned[:, 1:], expected[:, :-1], atol=1e-6, rtol=1e-6)
    assert torch.count_nonzero(aligned[:, 0]) == 0
    torch.testing.assert_close(last, expected[torch.arange(6), batch.lengths - 1])


def test_value_loss_gradients_reach_the_head_and_the_trunk_but_not_the_lm_head():
    """With zero advantages the policy loss has no gradient: what moves is the value loss's,
    through the head into the shared trunk; the LM head (policy loss only) stays put."""
    learner = shared_learner()
    randomize_head(learner)
    batch = collate(near_policy(learner, rollouts()))
    estimate = learner.estimator.estimate(batch)
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    head_before = learner.estimator.critic.head.weight.clone()
    learner.policy_trainer.step(batch, torch.zeros_like(estimate.advantages),
                                joint=learner.estimator.joint_loss(batch, estimate))
    after = learner.policy.state_dict()
    assert torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    moved = [k for k in before if k.startswith("model.") and not torch.equal(after[k], before[k])]
    assert any("mlp" in k for k in moved) and any("self_attn" in k for k in moved)
    assert not torch.equal(learner.estimator.critic.head.weight, head_before)
    # The separate critic: the same zero-advantage step leaves the policy's trunk untouched.
    config = SAOConfig(batch_size=6, actor_batch=6, max_steps=5)
    policy = tiny_policy()
    separate = assemble_learner(config, policy, make_critic(config, policy))
    assert isinstance(separate.estimator, CriticGAE)
    before = {k: v.clone() for k, v in separate.policy.state_dict().items()}
    separate.policy_trainer.step(batch, torch.zeros_like(estimate.advantages))
    assert all(torch.equal(v, before[k]) for k, v in separate.policy.state_dict().items())


def _reference_step(policy, head, batch, cfg):
    """One shared-trunk learner step written out the obvious way: values and GAE by loops,
    DIS and the value loss by formula, one backward of policy loss + c x value loss, both
    gradients clipped apart, two AdamW steps; then K-1 AdamW steps of the head alone on the
    step's hidden states (detached). Returns (policy loss, value loss, the last critic step's
    value loss)."""
    B, T = batch.tokens.shape
    mask = batch.action_mask.double()
    with torch.no_grad():
        h = policy.model(input_ids=batch.tokens, attention_mask=batch.attention_mask
                         ).last_hidden_state
        raw = head(h)[..., 0].double()
    values = torch.zeros(B, T, dtype=torch.float64)
    values[:, 1:] = raw[:, :-1]                      # V(t): the value before x_t is emitted
    adv = torch.zeros(B, T, dtype=torch.float64)
    ret = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        acts = [t for t in range(T) if mask[b, t] == 1]
        lam = 1.0 - 1.0 / (cfg.lambda_alpha * len(acts))      # length-adaptive, gamma 1
        next_v = next_a = 0.0
        future = 0.0
        for t in reversed(acts):
            r = float(batch.rewards[b, t])
            delta = r + next_v - float(values[b, t])
            next_a = delta + lam * next_a
            adv[b, t] = next_a
            next_v = float(values[b, t])
            future += r
            ret[b, t] = future                        # lambda_critic 1: Monte-Carlo return
    a = adv[mask == 1]
    adv = torch.where(mask == 1, (adv - a.mean()) / (a.std(unbiased=False) + 1e-8), adv)
    h = policy.model(input_ids=batch.tokens, attention_mask=batch.attention_mask
                     ).last_hidden_state
    logp_all = torch.log_softmax(policy.lm_head(h).double(), dim=-1)
    logp = torch.zeros(B, T, dtype=torch.float64)
    logp[:, 1:] = logp_all[:, :-1].gather(-1, batch.tokens[:, 1:, None])[..., 0]
    ratio = torch.exp(torch.where(mask == 1, logp - batch.rollout_logp.double(), 0.0))
    keep = mask * ((ratio >= 1 - cfg.eps_low) & (ratio <= 1 + cfg.eps_high)).double()
    policy_loss = -(keep * ratio * adv).sum() / mask.sum()
    new_values = torch.zeros(B, T, dtype=torch.float64)
    new_values[:, 1:] = head(h)[..., 0].double()[:, :-1]
    value_loss = (0.5 * (new_values - ret) ** 2 * mask).sum() / mask.sum()
    (policy_loss + cfg.value_loss_coef * value_loss).backward()
    torch.nn.utils.clip_grad_norm_(list(policy.parameters()), cfg.max_grad_norm)
    torch.nn.utils.clip_grad_norm_(list(head.parameters()), cfg.max_grad_norm)
    torch.optim.AdamW(policy.parameters(), lr=cfg.policy_lr, weight_decay=0.0).step()
    head_opt = torch.optim.AdamW(head.parameters(), lr=cfg.critic_lr, weight_decay=0.0)
    head_opt.step()
    features = h.detach()
    last = value_loss
    for _ in range(cfg.critic_updates - 1):
        head_opt.zero_grad()
        v = torch.zeros(B, T, dtype=torch.float64)
        v[:, 1:] = head(features)[..., 0].double()[:, :-1]
        last = (0.5 * (v - ret) ** 2 * mask).sum() / mask.sum()
        last.backward()
        torch.nn.utils.clip_grad_norm_(list(head.parameters()), cfg.max_grad_norm)
        head_opt.step()
    return float(policy_loss.detach()), float(value_loss.detach()), float(last.detach())


def _assert_close_params(a, b, rtol=1e-5):
    for name, t in a.items():
        diff = float((t.double() - b[name].double()).norm())
        assert diff <= rtol * float(t.double().norm()) + 1e-9, (name, diff)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_one_learner_step_equals_the_obvious_computation(k):
    learner = shared_learner(value_loss_coef=0.7, critic_updates=k)
    randomize_head(learner)
    rs = near_policy(learner, rollouts())
    batch = collate(rs)
    ref_policy = copy.deepcopy(learner.policy)
    ref_head = copy.deepcopy(learner.estimator.critic.head)
    assert learner.estimator.one_pass(batch)
    stats = learner.update(batch)
    ref_pi, ref_v, ref_last = _reference_step(ref_policy, ref_head, batch,
                                              learner.estimator.config)
    assert 0 < stats["masked_frac"] < 0.5          # the band is at work, most tokens kept
    assert stats["policy_loss"] == pytest.approx(ref_pi, rel=1e-5, abs=1e-7)
    assert stats["value_loss"] == pytest.approx(ref_v, rel=1e-5)
    assert stats["value_loss_last"] == pytest.approx(ref_last, rel=1e-5)
    if k == 1:
        assert ref_last == ref_v                   # no head-only step: the joint step's values
    else:
        assert ref_last != pytest.approx(ref_v, rel=1e-6)   # the head moved in between
    _assert_close_params(ref_policy.state_dict(), learner.policy.state_dict())
    _assert_close_params(ref_head.state_dict(), learner.estimator.critic.head.state_dict())


def test_micro_batches_and_two_passes_give_the_one_pass_step():
    one = shared_learner()
    randomize_head(one)
    rs = near_policy(one, rollouts())
    micro = shared_learner(micro_batch_tokens=20)
    randomize_head(micro)
    batch = collate(rs)
    assert one.estimator.one_pass(batch) and not micro.estimator.one_pass(batch)
    a, b = one.update(batch), micro.update(batch)
    for key in ("policy_loss", "value_loss", "explained_variance", "advantage_mean"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    _assert_close_params(one.policy.state_dict(), micro.policy.state_dict())
    _assert_close_params(one.estimator.critic.head.state_dict(),
                         micro.estimator.critic.head.state_dict())


def test_the_head_steps_with_every_policy_step_then_k_minus_1_times_alone():
    """policy_minibatches=3, K=5: three joint steps, then four of the head alone, which leave
    the policy (trunk and LM head) exactly where K=1 leaves it."""
    many = shared_learner(policy_minibatches=3, critic_updates=5)
    one = shared_learner(policy_minibatches=3, critic_updates=1)
    randomize_head(many)
    randomize_head(one)
    batch = collate(near_policy(many, rollouts()))
    stats = many.update(batch)
    one.update(batch)
    state = many.estimator.optimizer.state_dict()["state"]
    assert state and all(int(s["step"]) == 3 + 4 for s in state.values())
    assert all(int(s["step"]) == 3 for s in one.estimator.optimizer.state_dict()["state"].values())
    assert stats["policy_minibatches"] == 3 and np.isfinite(stats["critic_grad_norm"])
    for name, t in one.policy.state_dict().items():
        assert torch.equal(t, many.policy.state_dict()[name]), name
    assert not torch.equal(one.estimator.critic.head.weight, many.estimator.critic.head.weight)
    with pytest.raises(ValueError, match="critic-only step"):
        many.update(collate(rollouts(seed=4)), train_policy=False)


@pytest.mark.parametrize("kind", ["llama_factory", "qwen3_tied", "qwen3_moe_factory"])
def test_shared_trunk_trains_on_the_hf_architectures(kind):
    vocab = 32
    if kind == "qwen3_tied":
        torch.manual_seed(0)
        policy = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            tie_word_embeddings=True, max_position_embeddings=64))
    else:
        policy = make_tiny_model("llama" if kind == "llama_factory" else "qwen3_moe",
                                 vocab_size=vocab, hidden_size=64, num_heads=2)
    learner = shared_learner(policy)
    randomize_head(learner)
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    head = learner.estimator.critic.head.weight.clone()
    stats = learner.update(collate(near_policy(learner, rollouts(vocab=vocab))))
    assert np.isfinite([stats["policy_loss"], stats["value_loss"],
                        stats["critic_grad_norm"]]).all()
    assert not torch.equal(head, learner.estimator.critic.head.weight)
    assert any(not torch.equal(v, before[k]) for k, v in learner.policy.state_dict().items())
    # What the learner publishes is the policy alone: no value-head tensors go to the actors.
    from sao_actor_learner.models.checkpoint import sync_state_dict
    assert not any("head.weight" == k or k.startswith("value") for k in
                   sync_state_dict(learner.policy))


def test_the_value_head_and_its_optimizer_round_trip_through_the_learner_state(tmp_path):
    a = shared_learner(source=_Stream([]))
    for seed in range(2):
        a.update(collate(near_policy(a, rollouts(seed=seed))))
    path = tmp_path / "learner_state.pt"
    torch.save(a.learner_state(), path)
    b = shared_learner(source=_Stream([]))
    b.policy.load_state_dict(a.policy.state_dict())
    b.restore(torch.load(path, weights_only=False))
    for name, t in a.estimator.critic.head.state_dict().items():
        assert torch.equal(t, b.estimator.critic.head.state_dict()[name])
    sa, sb = a.estimator.optimizer.state_dict(), b.estimator.optimizer.state_dict()
    for k, s in sa["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(sb["state"][k][n]))
                   for n, v in s.items())
    batch = collate(near_policy(a, rollouts(seed=7)))
    a.update(batch)
    b.update(batch)
    for name, t in a.policy.state_dict().items():
        assert torch.equal(t, b.policy.state_dict()[name]), name
    assert torch.equal(a.estimator.critic.head.weight, b.estimator.critic.head.weight)
    # A checkpoint of the other critic option says which one to resume with.
    config = SAOConfig(batch_size=6, actor_batch=6, max_steps=5)
    policy = tiny_policy()
    separate = assemble_learner(config, policy, make_critic(config, policy))
    with pytest.raises(ValueError, match="--critic=shared_trunk"):
        separate.estimator.load_state_dict(a.estimator.state_dict())
    with pytest.raises(ValueError, match="same --critic"):
        a.estimator.load_state_dict(separate.estimator.state_dict())


class _Stream(core.RolloutSource):
    """A replay stand-in handing out a fixed stream in order."""

    def __init__(self, stream, position=0):
        self.stream, self.position = stream, position

    def sample(self, n, timeout_s, min_items=1):
        got = self.stream[self.position:self.position + n]
        self.position += len(got)
        return got

    def queue_size(self):
        return len(self.stream) - self.position


class _Publisher:
    def publish(self, version, payload, dropped_total=0):
        pass

    def report_progress(self, version, dropped_total, trained_total, **kwargs):
        return None


def _resumable(config, run_dir, stream, position=0):
    """builder.make_learner's resume path (checkpoint + journal) with a stand-in reader."""
    from sao_actor_learner.learner.journal import ResumePoint
    from sao_actor_learner.models import checkpoint as ckpt
    resume = ResumePoint(os.path.join(run_dir, "checkpoints"))
    policy, tokenizer = ckpt.load_policy(resume.checkpoint or config.init_checkpoint)
    learner = assemble_learner(config, policy, make_critic(config, policy),
                               resume.reader(_Stream(stream, position)), publisher=_Publisher(),
                               serialize=lambda sd: b"", tokenizer=tokenizer,
                               checkpoint_root=os.path.join(run_dir, "checkpoints"),
                               pad_id=tokenizer.pad_id)
    resume.restore(learner)
    return learner


def test_a_resumed_shared_trunk_learner_ends_with_the_uninterrupted_weights(warm_start,
                                                                            tmp_path):
    config = SAOConfig(init_checkpoint=warm_start, batch_size=4, actor_batch=4, max_steps=4,
                       checkpoint_every=2, critic="shared_trunk", max_staleness=4)
    from sao_actor_learner.models import checkpoint as ckpt
    vocab = ckpt.load_policy(warm_start)[1].vocab_size
    stream = rollouts(n=16, vocab=vocab)
    a = _resumable(config, str(tmp_path / "a"), stream)
    near_policy(a, stream)
    a.run()
    b = _resumable(config, str(tmp_path / "b"), stream)
    b.publish()
    for _ in range(3):
        b.step()                                   # checkpoint at 2, step 3 journalled; "crash"
    del b
    c = _resumable(config, str(tmp_path / "b"), stream, position=12)   # after 3 x 4 rollouts
    assert (c.version, c.resumed_from) == (2, 2)
    c.run()
    assert c.version == 4
    for name, t in a.policy.state_dict().items():
        assert torch.equal(t, c.policy.state_dict()[name]), name
    assert torch.equal(a.estimator.critic.head.weight, c.estimator.critic.head.weight)
    assert any(torch.count_nonzero(t) for t in c.estimator.critic.head.state_dict().values())
