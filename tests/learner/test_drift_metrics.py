"""The drift metrics of a policy step (docs/METHOD.md section 11, "Drift metrics"): each formula
of learner/drift.py against a slow version written out token by token, with masked tokens and
padding present; the entropies of the policy step's own forward against materialised logits; the
whole-group numbers of a learner group; the alarms, counted deterministically; summary.json."""
import json
import math
import os
import sys

if "triton" not in sys.modules:  # the Triton interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sao_actor_learner.builder import assemble_learner, make_critic
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.distributions import sampling_logprobs
from sao_actor_learner.learner import distributed, drift
from sao_actor_learner.run import summarize
from sao_actor_learner.types import Rollout, collate

V = 16


# --- slow versions: loops over sequences and tokens -----------------------------------------
def clamp(x, bound=20.0):
    return min(max(x, -bound), bound)


def slow_ratio_metrics(logp, rollout_logp, mask):
    seqs, cur_nll, roll_nll = [], [], []
    for b in range(len(mask)):
        ds = []
        for t in range(len(mask[b])):
            if mask[b][t]:
                ds.append(clamp(float(logp[b][t]) - float(rollout_logp[b][t])))
                cur_nll.append(-float(logp[b][t]))
                roll_nll.append(-float(rollout_logp[b][t]))
        if ds:
            seqs.append(ds)
    tokens = [d for ds in seqs for d in ds]
    n = len(tokens)
    # ppl_current / ppl_rollout = exp(mean NLL_current) / exp(mean NLL_rollout), taken as one
    # exp (a token outside the nucleus has NLL 1e4: each exp alone would overflow).
    log_ppl_ratio = sum(cur_nll) / n - sum(roll_nll) / n
    return {
        "chi2_token": sum(math.exp(d) ** 2 for d in tokens) / n - 1.0,
        "chi2_seq": sum(math.exp(clamp(sum(ds))) ** 2 for ds in seqs) / len(seqs) - 1.0,
        "ppl_ratio": math.exp(log_ppl_ratio),
        "log_ppl_ratio": log_ppl_ratio,
        "ppl_ratio_seq_mean": sum(math.exp(-sum(ds) / len(ds)) for ds in seqs) / len(seqs),
    }


def slow_advantage_stats(adv, mask):
    a = [float(adv[b][t]) for b in range(len(mask)) for t in range(len(mask[b])) if mask[b][t]]
    mean = sum(a) / len(a)
    return {"advantage_mean": mean,
            "advantage_std": math.sqrt(sum((x - mean) ** 2 for x in a) / len(a)),
            "advantage_min": min(a), "advantage_max": max(a),
            "advantage_pos_frac": sum(x > 0 for x in a) / len(a)}


def slow_entropy(logp_rows):
    """-sum_v p log p of one distribution given as log-probs (-inf: outside the nucleus)."""
    return -sum(math.exp(lp) * lp for lp in logp_rows if lp != float("-inf"))


def batch_with_padding(seed=0, B=5, T=9):
    """Random [B, T] log-probs and advantages with a ragged mask: prompt zeros, an observation
    gap, right padding, and one row without any action token; garbage off the mask."""
    g = torch.Generator().manual_seed(seed)
    logp = -3.0 * torch.rand(B, T, generator=g, dtype=torch.float64)
    rollout_logp = logp + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.zeros(B, T)
    mask[0, 2:9] = 1
    mask[1, 3:5] = 1
    mask[1, 7:8] = 1          # an observation gap inside the rollout
    mask[2, 1:4] = 1          # right padding after 4
    mask[4, 2:6] = 1          # row 3: no action token
    return logp, rollout_logp, adv, mask


# --- the formulas ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ratio_metrics_equal_the_slow_version_with_masking_and_padding(seed):
    logp, rollout_logp, _, mask = batch_with_padding(seed)
    fast = drift.ratio_metrics(logp, rollout_logp, mask)
    slow = slow_ratio_metrics(logp.tolist(), rollout_logp.tolist(), mask.tolist())
    assert set(fast) == set(slow)
    for key in slow:
        assert fast[key] == pytest.approx(slow[key], rel=1e-9, abs=1e-12), key
    # Off the mask nothing counts: changing it changes nothing.
    off = ~mask.bool()
    assert drift.ratio_metrics(torch.where(off, logp + 7.0, logp), rollout_logp, mask) == fast


def test_huge_log_ratios_are_clamped_per_token_and_per_sequence():
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]])
    logp = torch.tensor([[0.0, -1.0, -1.0, -1.0], [0.0, -1.0, 0.0, 0.0]])
    rollout_logp = torch.tensor([[0.0, -31.0, -16.0, -16.0], [0.0, -1e4, 0.0, 0.0]])
    fast = drift.ratio_metrics(logp, rollout_logp, mask)
    # token d: 20 (clamped from 30), 15, 15, 20 (clamped from 9999); sequence sums 50 -> 20, 20
    assert fast["chi2_token"] == pytest.approx((2 * math.exp(40) + 2 * math.exp(30)) / 4 - 1)
    assert fast["chi2_seq"] == pytest.approx(math.exp(40) - 1)
    assert fast["log_ppl_ratio"] == pytest.approx(-70.0 / 4)
    assert all(math.isfinite(v) for v in fast.values())


def test_identical_policies_have_no_drift_and_an_empty_mask_reports_none():
    logp, _, _, mask = batch_with_padding()
    same = drift.ratio_metrics(logp, logp, mask)
    assert same == pytest.approx({"chi2_token": 0.0, "chi2_seq": 0.0, "log_ppl_ratio": 0.0,
                                  "ppl_ratio": 1.0, "ppl_ratio_seq_mean": 1.0})
    empty = torch.zeros_like(mask)
    assert drift.ratio_metrics(logp, logp - 5, empty)["chi2_token"] == 0.0
    assert drift.advantage_stats(logp, empty)["advantage_std"] == 0.0
    assert drift.token_entropy_mean(logp, empty) == 0.0


@pytest.mark.parametrize("seed", [0, 3])
def test_advantage_stats_equal_the_slow_version(seed):
    _, _, adv, mask = batch_with_padding(seed)
    fast = drift.advantage_stats(adv, mask)
    slow = slow_advantage_stats(adv.tolist(), mask.tolist())
    assert fast == pytest.approx(slow, rel=1e-12)


def test_token_entropy_mean_is_the_mean_over_action_tokens_only():
    _, _, ent, mask = batch_with_padding(4)
    cells = [float(ent[b, t]) for b in range(ent.shape[0]) for t in range(ent.shape[1])
             if mask[b, t]]
    assert drift.token_entropy_mean(ent, mask) == pytest.approx(sum(cells) / len(cells))


@pytest.mark.parametrize("seed", [0, 5])
def test_outside_band_frac_equals_the_slow_count(seed):
    logp, rollout_logp, _, mask = batch_with_padding(seed)
    low, high = 0.7, 1.4
    cells = [math.exp(clamp(float(logp[b, t]) - float(rollout_logp[b, t])))
             for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    slow = sum(w < low or w > high for w in cells) / len(cells)
    assert 0.0 < slow < 1.0
    assert drift.outside_band_frac(logp, rollout_logp, mask, low, high) == pytest.approx(slow)
    assert drift.outside_band_frac(logp, rollout_logp, torch.zeros_like(mask), low, high) == 0.0
    stats = drift.drift_stats(logp, rollout_logp, logp, mask, band=(low, high))
    assert stats["ratio_outside_band_frac"] == pytest.approx(slow)
    assert "ratio_outside_band_frac" not in drift.drift_stats(logp, rollout_logp, logp, mask)


def test_version_spans_and_staleness_stats_equal_the_slow_version():
    versions = torch.tensor([[-1, 3, 3, 4, 6, -1], [-1, -1, 5, -1, 5, 5],
                             [-1, -1, -1, -1, -1, -1], [-1, 2, 9, -1, -1, -1]])
    mask = (versions >= 0).long()
    mask[3, 2] = 0   # a masked-out token's version does not count
    slow = []
    for b in range(versions.shape[0]):
        vs = [int(versions[b, t]) for t in range(versions.shape[1]) if mask[b, t]]
        slow.append(max(vs) - min(vs) if vs else 0)
    spans = drift.version_spans(versions, mask)
    assert spans == slow == [3, 0, 0, 0]
    stale = [7 - 3, 7 - 5, 0, 7 - 2]
    stats = drift.staleness_stats(stale, spans)
    assert stats == {"staleness_rollout_mean": sum(stale) / 4, "staleness_span_mean": 3 / 4,
                     "staleness_span_max": 3}


def test_alarms_count_each_threshold_crossing_per_step():
    alarms = drift.DriftAlarms(min_ess=0.3, max_kl=0.1, max_chi2=1.0)
    assert alarms.check({"ess": 1.0, "kl_rollout": 0.0, "chi2_token": 0.0}) == []
    # One token with ratio e^3 among nine on-policy ones: ess (sum r)^2 / (n sum r^2) = 0.21.
    r = torch.tensor([math.exp(3.0)] + [1.0] * 9, dtype=torch.float64)
    ess = float(r.sum() ** 2 / (r.numel() * (r ** 2).sum()))
    assert ess < 0.3
    messages = alarms.check({"ess": ess, "kl_rollout": 0.05, "chi2_token": 0.5})
    assert len(messages) == 1 and messages[0].startswith("ess_low")
    alarms.check({"ess": ess, "kl_rollout": 0.2, "chi2_token": float("nan")})
    assert alarms.counters() == {"drift_alarm_ess_low": 2, "drift_alarm_kl_high": 1,
                                 "drift_alarm_chi2_high": 0}
    again = drift.DriftAlarms()
    again.load_state_dict(alarms.state_dict())
    assert again.counters() == alarms.counters()


@pytest.mark.parametrize("field,value", [("alarm_min_ess", 0.0), ("alarm_min_ess", 1.5),
                                         ("alarm_max_kl", 0.0), ("alarm_max_chi2", -1.0)])
def test_alarm_thresholds_out_of_range_fail_the_config(field, value):
    with pytest.raises(ConfigError, match=field):
        SAOConfig(**{field: value})


# --- wired into the learner --------------------------------------------------------------------
def tiny_policy(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def make_learner(**overrides):
    config = SAOConfig(**{"batch_size": 4, "actor_batch": 4, "max_steps": 5, **overrides})
    policy = tiny_policy()
    return assemble_learner(config, policy, make_critic(config, policy), None,
                            serialize=lambda sd: b"")


def rollouts(learner, shift=0.0, seed=0):
    """Four rollouts with an observation token inside, scored on-policy; `shift` is added to
    the behaviour log-prob of the first action token of rollout 0 (ratio e^-shift there)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(4):
        n = 3 + i
        tokens = list(rng.integers(1, V, size=2 + n + 2))
        mask = [0, 0] + [1] * n + [0] + [1]
        out.append(Rollout(tokens=tokens, action_mask=mask, rollout_logp=[0.0] * len(tokens),
                           versions=[v if m else -1 for v, m in zip([0, 0] + [1] * n + [0, 2],
                                                                    mask)],
                           rewards=[0.0] * (len(tokens) - 1) + [float(i % 2)], prompt_id=i))
    with torch.no_grad():
        logp = learner.policy_trainer.logprobs(collate(out))
    for i, r in enumerate(out):
        lp = logp[i, :r.length].numpy() * np.array(r.action_mask)
        if i == 0:
            lp[2] += shift
        r.rollout_logp = lp.astype(np.float32)
    return out


def slow_step_entropy(learner, batch):
    """Mean over action tokens of the entropy of the sampling distribution, from the logits."""
    with torch.no_grad():
        logits = learner.policy(input_ids=batch.tokens,
                                attention_mask=batch.attention_mask).logits.float()
    values = []
    for b in range(batch.size):
        for t in range(1, batch.tokens.shape[1]):
            if batch.action_mask[b, t]:
                lp = sampling_logprobs(logits[b, t - 1][None], learner.policy_trainer.temperature,
                                       learner.policy_trainer.top_p)[0]
                values.append(slow_entropy(lp.tolist()))
    return sum(values) / len(values)


@pytest.mark.parametrize("overrides", [
    {}, {"fused_logprobs": False}, {"top_p": 0.8}, {"micro_batch_tokens": 20},
    {"critic": "shared_trunk"}, {"policy_loss": "ppo_clip", "temperature": 0.7}],
    ids=["fused", "plain", "nucleus", "micro", "shared_trunk", "ppo_clip-temperature"])
def test_the_policy_step_logs_the_drift_metrics_of_its_own_log_probs(overrides):
    learner = make_learner(**overrides)
    rs = rollouts(learner, shift=0.5)
    batch = collate(rs)
    with torch.no_grad():
        logp = learner.policy_trainer.logprobs(batch)      # the parameters before the step
    entropy = slow_step_entropy(learner, batch)
    stats = learner.update(batch)
    expected = slow_ratio_metrics(logp.tolist(), batch.rollout_logp.tolist(),
                                  batch.action_mask.tolist())
    for key in expected:
        assert stats[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert stats["token_entropy_mean"] == pytest.approx(entropy, rel=1e-5)
    for key in ("advantage_std", "advantage_min", "advantage_max", "advantage_pos_frac"):
        assert key in stats
    assert 0.0 < stats["advantage_pos_frac"] < 1.0
    assert stats["drift_alarm_ess_low"] == 0
    # the token of rollout 0 shifted by 0.5 has ratio e^-0.5 < 1 - eps_low: outside DIS's band
    # whatever the loss, and for DIS the band's fraction is its masked fraction
    n = float(batch.action_mask.sum())
    assert stats["ratio_outside_band_frac"] == pytest.approx(1.0 / n)
    if overrides.get("policy_loss", "dis") == "dis":
        assert stats["ratio_outside_band_frac"] == pytest.approx(stats["masked_frac"])


def test_token_entropy_off_leaves_the_metric_out():
    learner = make_learner(token_entropy=False, drift_alarms=False)
    stats = learner.update(collate(rollouts(learner)))
    assert "token_entropy_mean" not in stats and "chi2_token" in stats
    assert not any(k.startswith("drift_alarm_") for k in stats)


def test_a_batch_with_ess_below_the_threshold_raises_the_alarm_every_step():
    learner = make_learner()
    rs = rollouts(learner, shift=-4.0)    # one token with ratio e^4 among 21 on-policy ones
    first = learner.update(collate(rs))
    assert first["ess"] < 0.3
    assert first["drift_alarm_ess_low"] == 1
    assert first["drift_alarm_kl_high"] == 1 and first["drift_alarm_chi2_high"] == 1
    second = learner.update(collate(rs))
    assert second["drift_alarm_ess_low"] == 2
    state = learner.policy_trainer.state_dict()
    resumed = make_learner()
    resumed.policy_trainer.load_state_dict(state)
    assert resumed.policy_trainer.alarms.counters()["drift_alarm_ess_low"] == 2


class _TwoRanks(distributed.Collective):
    """Rank 0 of a two-rank group whose rank 1 sends `other` (only gather_objects is used)."""
    world_size = 2

    def __init__(self, other):
        self.other = other

    def gather_objects(self, obj):
        return [obj, self.other]


def test_in_a_learner_group_the_metrics_are_those_of_the_whole_batch():
    learner = make_learner()
    trainer = learner.policy_trainer
    rs = rollouts(learner, shift=0.7)
    adv = [torch.randn(r.length, generator=torch.Generator().manual_seed(i))
           for i, r in enumerate(rs)]

    def parts(rows):
        b = collate([rs[i] for i in rows])
        a = torch.zeros(b.tokens.shape)
        for j, i in enumerate(rows):
            a[j, :rs[i].length] = adv[i]
        with torch.no_grad():
            logp, _, ent = trainer.forward_and_entropy(b)
        return b, logp, a, ent

    b, lp, a, e = parts([0, 1, 2, 3])
    whole = trainer.whole_batch_stats(b, lp, a, None, e)
    b1, lp1, a1, e1 = parts([2, 3])       # the longer rows: rank 1's batch is wider
    other = {"logp": lp1, "rollout_logp": b1.rollout_logp.float(), "advantages": a1,
             "mask": b1.action_mask.float(), "entropy": e1}
    trainer.collective = _TwoRanks(other)
    b0, lp0, a0, e0 = parts([0, 1])
    group = trainer.whole_batch_stats(b0, lp0, a0, None, e0)
    for key in ("chi2_token", "chi2_seq", "ppl_ratio", "ppl_ratio_seq_mean", "log_ppl_ratio",
                "token_entropy_mean", "advantage_mean", "advantage_std", "advantage_min",
                "advantage_max", "advantage_pos_frac", "ess", "kl_rollout"):
        assert group[key] == pytest.approx(whole[key], rel=1e-6, abs=1e-9), key


def test_batch_stats_report_the_staleness_spans():
    learner = make_learner()
    rs = rollouts(learner)     # versions: 1 on the first turn, 2 on the last token
    stats = learner._batch_stats(collate(rs), rs, 3)
    assert stats["staleness_span_max"] == 1 and stats["staleness_span_mean"] == 1.0
    assert stats["staleness_rollout_mean"] == 2.0 and stats["staleness_max"] == 2


def test_summary_counts_the_alarms_of_the_run(tmp_path):
    config = SAOConfig(run_dir=str(tmp_path), max_steps=2)
    rows = [{"kind": "train", "step": s, "rollouts_trained": 4 * s, "dropped_stale": 0,
             "staleness_max": 0, "reward_mean": 0.5, "drift_alarm_ess_low": s - 1,
             "drift_alarm_kl_high": 0, "drift_alarm_chi2_high": 1} for s in (1, 2)]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    summary = summarize(config, str(tmp_path), 1.0)
    assert summary["drift_alarms"] == {"ess_low": 1, "kl_high": 0, "chi2_high": 1}
