"""Padding-free packed micro-batches (micro_batch_layout=packed, learner/packing.py): the
grouping and the packed row against slow obvious versions, packed forwards equal padded ones
token by token on tiny Llama, Qwen2 and Qwen3 models (policy log-probs, entropies, hidden states
and critic values), and a packed learner step (policy + critic) gives the padded step's
parameters and statistics."""
import os
import sys

if "triton" not in sys.modules:  # the Triton interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from sao_actor_learner.builder import assemble_learner, make_critic
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.learner import packing
from sao_actor_learner.learner.minibatches import (micro_batch_groups, pack_by_token_sum,
                                                   select_rows)
from sao_actor_learner.types import Rollout, collate

torch.set_num_threads(1)
V = 40
ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM),
                 "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                 "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


# The grouping ---------------------------------------------------------------------------------
def slow_first_fit_decreasing(lengths, budget):
    """The obvious first-fit decreasing: bins as lists, sums recomputed every time."""
    if budget == 0 or sum(lengths) <= budget:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins = []
    for i in order:
        for b in bins:
            if sum(lengths[j] for j in b) + lengths[i] <= budget:
                b.append(i)
                break
        else:
            bins.append([i])
    return [sorted(b) for b in bins]


@pytest.mark.parametrize("seed", range(20))
def test_pack_by_token_sum_is_first_fit_decreasing(seed):
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(1, 60, size=int(rng.integers(1, 30)))]
    budget = int(rng.choice([0, 40, 64, 100, 1000]))
    groups = pack_by_token_sum(lengths, budget)
    assert [list(g) for g in groups] == slow_first_fit_decreasing(lengths, budget)
    assert sorted(int(r) for g in groups for r in g) == list(range(len(lengths)))
    for g in groups:
        assert sum(lengths[r] for r in g) <= budget or len(g) == 1 or budget == 0


def test_micro_batch_groups_follow_the_layout():
    lengths = [5, 17, 3, 9, 9, 2, 30]
    padded, packed = (micro_batch_groups(lengths, 40, layout) for layout in ("padded", "packed"))
    assert len(packed) == 2 and len(padded) == 3        # 75 tokens: 2 rows of <= 40
    assert all(sum(lengths[r] for r in g) <= 40 for g in packed)
    with pytest.raises(ValueError, match="padded or packed"):
        micro_batch_groups(lengths, 40, "ragged")
    with pytest.raises(ConfigError, match="micro_batch_layout"):
        SAOConfig(micro_batch_layout="ragged")


# The packed row --------------------------------------------------------------------------------
def slow_pack(tokens, lengths):
    """Tokens, positions, flat padded index and first-token flags, rollout by rollout."""
    toks, pos, index, starts = [], [], [], []
    w = tokens.shape[1]
    for i, n in enumerate(lengths):
        for t in range(n):
            toks.append(int(tokens[i, t]))
            pos.append(t)
            index.append(i * w + t)
            starts.append(t == 0)
    return toks, pos, index, starts


def slow_unpack(values, lengths, w, zero_starts):
    out = torch.zeros((len(lengths), w) + tuple(values.shape[2:]), dtype=values.dtype)
    j = 0
    for i, n in enumerate(lengths):
        for t in range(n):
            out[i, t] = 0 if (zero_starts and t == 0) else values[0, j]
            j += 1
    return out


@pytest.mark.parametrize("seed", range(5))
def test_the_packed_row_and_its_unpacking_match_the_obvious_loops(seed):
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(1, 12, size=int(rng.integers(1, 7)))]
    w = max(lengths) + int(rng.integers(0, 3))
    tokens = torch.as_tensor(rng.integers(1, V, size=(len(lengths), w)))
    row = packing.PackedRow.pack(tokens, torch.tensor(lengths))
    toks, pos, index, starts = slow_pack(tokens, lengths)
    assert row.tokens.tolist() == [toks] and row.position_ids.tolist() == [pos]
    assert row.index.tolist() == index and row.starts.tolist() == [starts]
    for extra, zero_starts in (((), False), ((), True), ((3,), False)):
        values = torch.randn((1, len(toks)) + extra, dtype=torch.float64, requires_grad=True)
        out = row.unpack(values, zero_starts=zero_starts)
        assert torch.equal(out, slow_unpack(values.detach(), lengths, w, zero_starts))
        out.sum().backward()   # the gradient reaches exactly the positions that were kept
        expect = torch.ones_like(values)
        if zero_starts:
            expect[0, torch.tensor(starts)] = 0
        assert torch.equal(values.grad, expect)
    with pytest.raises(ValueError, match="do not match"):
        row.unpack(torch.zeros(1, len(toks) + 1))


# Forwards ---------------------------------------------------------------------------------------
def tiny_policy(arch, seed=0, attn="sdpa"):
    config_cls, model_cls = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=128)
    config._attn_implementation = attn
    return model_cls(config)


def rollouts(n=6, seed=0, lengths=(3, 17), noise=0.5):
    """Variable-length rollouts (prompts of 2-5 tokens)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, a = int(rng.integers(2, 6)), int(rng.integers(*lengths))
        out.append(Rollout(tokens=list(rng.integers(1, V, size=p + a)),
                           action_mask=[0] * p + [1] * a,
                           rollout_logp=[0.0] * p + list(-3.0 + noise * rng.normal(size=a)),
                           versions=[-1] * p + [0] * a,
                           rewards=[0.0] * (p + a - 1) + [float(rng.integers(0, 2))],
                           prompt_id=i))
    return out


def learner_for(arch="llama", seed=0, attn="sdpa", **overrides):
    config = SAOConfig(**{"batch_size": 6, "actor_batch": 6, "max_steps": 3, **overrides})
    policy = tiny_policy(arch, seed, attn)
    return assemble_learner(config, policy, make_critic(config, policy), None,
                            serialize=lambda sd: b"")


def real(batch):
    """[B, T] bool: the positions holding tokens."""
    return torch.arange(batch.tokens.shape[1])[None] < batch.lengths[:, None]


@pytest.mark.parametrize("arch,attn,used", [
    ("llama", "sdpa", packing.PER_ROLLOUT_SDPA), ("qwen2", "sdpa", packing.PER_ROLLOUT_SDPA),
    ("qwen3", "sdpa", packing.PER_ROLLOUT_SDPA),
    ("qwen3", "eager", "eager"),          # transformers' block-diagonal mask from position ids
])
def test_a_packed_forward_equals_the_padded_forward(arch, attn, used):
    batch = collate(rollouts(seed=1))
    padded = learner_for(arch, attn=attn)
    packed = learner_for(arch, attn=attn, micro_batch_layout="packed")
    for body in (packed.policy.model, packed.estimator.critic.body):
        assert packing.attention_implementation(body) == used
    assert packing.attention_implementation(padded.policy.model) == attn
    m = real(batch)
    with torch.no_grad():
        logp_a, hidden_a, ent_a = padded.policy_trainer.forward_and_entropy(batch)
        logp_b, hidden_b, ent_b = packed.policy_trainer.forward_and_entropy(batch)
        values_a, last_a = padded.estimator.values(batch)
        values_b, last_b = packed.estimator.values(batch)
    for a, b in ((logp_a, logp_b), (ent_a, ent_b), (hidden_a, hidden_b), (values_a, values_b)):
        assert a.shape[:2] == b.shape[:2]
        assert torch.allclose(a[m], b[m], atol=2e-5, rtol=1e-5), float((a[m] - b[m]).abs().max())
        assert not b[~m].any()   # padding is 0 in the packed result
    assert torch.allclose(last_a, last_b, atol=2e-5)
    assert (logp_b[:, 0] == 0).all() and (logp_b[m] != 0).sum() == int(m.sum()) - batch.size
    assert float(values_a.abs().max()) == 0.0   # a fresh critic's head is zero: check the body
    critic = packed.estimator.critic
    torch.nn.init.normal_(critic.head.weight)
    padded.estimator.critic.head.load_state_dict(critic.head.state_dict())
    with torch.no_grad():
        raw_a = padded.estimator._raw_values(batch)
        raw_b = packed.estimator._raw_values(batch)
    assert float(raw_a[m].abs().min()) > 0
    assert torch.allclose(raw_a[m], raw_b[m], atol=2e-5, rtol=1e-5)


def test_packed_log_probs_under_top_p_and_without_the_fused_kernel_equal_padded_ones():
    batch = collate(rollouts(seed=2))
    m = real(batch)
    for overrides in ({"top_p": 0.8}, {"fused_logprobs": False}):
        a = learner_for(**overrides).policy_trainer.logprobs_no_grad(batch)
        b = learner_for(micro_batch_layout="packed", micro_batch_tokens=30,
                        **overrides).policy_trainer.logprobs_no_grad(batch)
        assert torch.allclose(a[m], b[m], atol=2e-5), overrides


def test_rollout_bounds_and_padded_batches_through_the_per_rollout_attention():
    assert packing.rollout_bounds(torch.tensor([[0, 1, 2, 0, 0, 1]])) == [0, 3, 4, 6]
    assert packing.rollout_bounds(torch.tensor([[0, 1, 2]])) == [0, 3]
    assert packing.rollout_bounds(torch.tensor([[3, 4, 0]])) is None      # not a packed row
    assert packing.rollout_bounds(torch.tensor([[0, 1], [0, 1]])) is None
    # A switched body still runs padded batches (left and right padding) as plain sdpa does.
    plain, switched = tiny_policy("llama").model, tiny_policy("llama").model
    assert packing.prepare_packed_attention(switched) == packing.PER_ROLLOUT_SDPA
    tokens = torch.randint(1, V, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [0] * 2 + [1] * 5])
    with torch.no_grad():
        a = plain(input_ids=tokens, attention_mask=mask).last_hidden_state
        b = switched(input_ids=tokens, attention_mask=mask).last_hidden_state
    assert torch.allclose(a[mask.bool()], b[mask.bool()], atol=1e-5)


class _DropsPositionIds(torch.nn.Module):
    """A fake body (marked as such): a real Llama body called without the position ids, as a
    transformers version without packed-sequence detection would attend."""

    def __init__(self, body):
        super().__init__()
        self.body, self.config = body, body.config

    def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=None):
        return self.body(input_ids=input_ids, use_cache=False)


def test_an_attention_that_sees_across_rollouts_is_refused():
    body = tiny_policy("llama").model
    packing.check_packed_attention(body)                      # the real one keeps them apart
    with pytest.raises(ValueError, match="sees across packed rollouts"):
        packing.check_packed_attention(_DropsPositionIds(body))
    body.config._attn_implementation = "my_kernel"
    with pytest.raises(ValueError, match="micro_batch_layout=padded"):
        packing.check_packed_attention(body)


# Learner steps ---------------------------------------------------------------------------------
def params(learner):
    out = {f"policy.{k}": v.detach().clone() for k, v in learner.policy.state_dict().items()}
    if learner.estimator.has_critic:
        out.update({f"critic.{k}": v.detach().clone()
                    for k, v in learner.estimator.critic.state_dict().items()})
    return out


def assert_same_params(a, b, rtol=2e-5):
    """Every tensor within `rtol` of the other relative to its norm. Qwen2's key bias is left
    out: it shifts every score of a query by the same amount, which softmax ignores, so its
    gradient is rounding noise, which Adam's normalisation turns into lr-sized steps."""
    for k in a:
        if k.endswith("k_proj.bias"):
            continue
        diff = float((a[k].double() - b[k].double()).norm())
        assert diff <= rtol * float(b[k].double().norm()) + 1e-12, (k, diff)


def drifting(learner, rs):
    """Rollout log-probs near the learner's own, with drift so the DIS band acts."""
    batch = collate(rs)
    with torch.no_grad():
        logp = learner.policy_trainer.logprobs(batch)
    for i, r in enumerate(rs):
        r.rollout_logp = ((logp[i, :r.length].numpy() + 0.2 * np.cos(np.arange(r.length)))
                          * r.action_mask).astype(np.float32)
    return rs


@pytest.mark.parametrize("arch,overrides", [
    ("llama", dict()),                                    # SAO: DIS, critic K=2
    ("qwen3", dict(micro_batch_tokens=40)),               # several packed rows
    ("llama", dict(critic="shared_trunk")),               # value head on the policy's trunk
    ("qwen2", dict(policy_loss="ppo_clip", policy_minibatches=2, micro_batch_tokens=30)),
    ("qwen3", dict(gradient_checkpointing=True, micro_batch_tokens=40)),   # recomputed packed
])
def test_a_packed_learner_step_equals_the_padded_step(arch, overrides):
    padded = learner_for(arch, **overrides)
    packed = learner_for(arch, micro_batch_layout="packed", **overrides)
    rs = drifting(padded, rollouts(seed=3))
    assert params(padded).keys() == params(packed).keys()
    stats_a = padded.update(collate(rs))
    stats_b = packed.update(collate(rs))
    assert_same_params(params(padded), params(packed))
    before = params(learner_for(arch, **overrides))
    moved = [k for k in before if not torch.equal(before[k], params(packed)[k])]
    assert any(k.startswith("policy.") for k in moved)
    if "critic" not in overrides:
        assert any(k.startswith("critic.") for k in moved)
    for key in ("policy_loss", "masked_frac", "kl_rollout", "ess", "token_entropy_mean",
                "value_loss", "value_loss_last", "explained_variance"):
        if key in stats_a:
            assert stats_b[key] == pytest.approx(stats_a[key], rel=1e-4, abs=1e-6), key


def test_a_micro_batch_of_one_packed_row_holds_no_padding():
    rs = rollouts(seed=4)
    batch = collate(rs)
    groups = micro_batch_groups(batch.lengths.tolist(), 40, "packed")
    row = packing.PackedRow.pack(*(lambda m: (m.tokens, m.lengths))(
        select_rows(batch, groups[0], trim=True)))
    assert row.num_tokens == sum(rs[i].length for i in groups[0]) <= 40


# The benchmark -------------------------------------------------------------------------------
def run_learner_step_benchmark(tmp_path, *flags):
    """programs/benchmarks/learner_step.py on the tiny shape, one step per cell, a batch of four
    rollouts from a small length mix (9, 30, 17 and 12 tokens); its last line's JSON."""
    import json
    import subprocess
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    mix = tmp_path / "lengths.json"
    mix.write_text(json.dumps({"lengths": [9, 30, 17, 12], "prompt_lengths": [3, 5, 4, 4]}))
    out = subprocess.run(
        [sys.executable, os.path.join(repo, "programs", "benchmarks", "learner_step.py"),
         "--sizes=tiny", "--micro_batch_tokens=0", "--dtypes=float32", "--batch=4", "--steps=1",
         "--threads=1", f"--lengths_file={mix}", *flags],
        capture_output=True, text=True, cwd=repo, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_learner_step_benchmark_compares_layouts_on_a_length_mix(tmp_path):
    result = run_learner_step_benchmark(tmp_path, "--layouts=padded,packed")
    cells = {c["layout"]: c for c in result["cells"]}
    assert set(cells) == {"padded", "packed"}, result
    for c in cells.values():   # the four lengths, drawn without replacement
        assert c["tokens"] == 9 + 30 + 17 + 12 and c["padded_tokens"] == 4 * 30
        assert c["policy_loss_finite"]
    [ratio] = result["ratios"]
    assert ratio["tokens_per_s_packed_over_padded"] == pytest.approx(
        cells["packed"]["tokens_per_s"] / cells["padded"]["tokens_per_s"])
