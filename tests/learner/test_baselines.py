"""GRPO, the critic-free baseline, the policy-loss choice, actor delays / groups / forced
staleness, the online-shift task, the config checks, and two whole programs that prove the
staleness bound under injected delays and the exact staleness of forced-staleness mode."""
import os
import statistics
import subprocess
import sys
import threading

if "triton" not in sys.modules:  # as in test_learner.py: the Triton interpreter must be chosen
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads (learner -> kernels)

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sao_actor_learner import core
from sao_actor_learner.actors.actor import Actor
from sao_actor_learner.actors.delays import make_delay_sampler, sample_delays
from sao_actor_learner.builder import assemble_learner, make_program
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.learner import baselines, grpo
from sao_actor_learner.models.value import ValueModel
from sao_actor_learner.observers import read_metrics
from sao_actor_learner.run import run_program
from sao_actor_learner.tasks.online_shift import OnlineShiftTask, answer_in_phase, phase_of
from sao_actor_learner.types import Rollout, collate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
V = 16


# --- advantage estimators against slow references ---------------------------------------------
def slow_group_advantages(rewards, group_ids, scale_by_std, eps=1e-6):
    out = []
    for i, g in enumerate(group_ids):
        members = [rewards[j] for j, h in enumerate(group_ids) if h == g]
        mean = sum(members) / len(members)
        a = rewards[i] - mean
        if scale_by_std and len(members) > 1:
            a /= statistics.stdev(members) + eps
        out.append(a)
    return out


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_group_normalized_advantages_match_slow_reference(scale_by_std):
    rng = np.random.default_rng(0)
    group_ids = [3, 1, 3, 2, 1, 3, 2, 1, 9, 3]  # interleaved groups, a singleton, uneven sizes
    rewards = rng.normal(size=len(group_ids)).tolist()
    adv, means = grpo.group_normalized_advantages(torch.tensor(rewards, dtype=torch.float64),
                                                   group_ids, scale_by_std)
    ref = slow_group_advantages(rewards, group_ids, scale_by_std)
    np.testing.assert_allclose(adv.numpy(), ref, rtol=1e-6, atol=1e-5)
    assert adv[group_ids.index(9)] == 0.0
    np.testing.assert_allclose(means[0], np.mean([rewards[i] for i in (0, 2, 5, 9)]))
    same, _ = grpo.group_normalized_advantages(torch.ones(4), [0, 0, 0, 0])
    assert torch.all(same == 0)  # equal rewards: nothing to learn


def slow_running_mean(batches, decay):
    mean, out = None, []
    for rewards in batches:
        b = sum(rewards) / len(rewards) if mean is None else mean
        out.append([b] * len(rewards))
        m = sum(rewards) / len(rewards)
        mean = m if mean is None else decay * mean + (1 - decay) * m
    return out


def slow_per_prompt(batches, decay):
    table, fallback, out = {}, None, []
    for keys, rewards in batches:
        fb = sum(rewards) / len(rewards) if fallback is None else fallback
        out.append([table.get(k, fb) for k in keys])
        for k, r in zip(keys, rewards):
            table[k] = r if k not in table else decay * table[k] + (1 - decay) * r
        m = sum(rewards) / len(rewards)
        fallback = m if fallback is None else decay * fallback + (1 - decay) * m
    return out


def test_baseline_trackers_match_slow_references():
    rng = np.random.default_rng(1)
    batches = [(list(rng.integers(0, 5, size=6)), rng.random(6).tolist()) for _ in range(8)]
    running = baselines.RunningMeanBaseline(0.8)
    per_prompt = baselines.PerPromptBaseline(0.8)
    ref_running = slow_running_mean([r for _, r in batches], 0.8)
    ref_prompt = slow_per_prompt(batches, 0.8)
    for (keys, rewards), want_running, want_prompt in zip(batches, ref_running, ref_prompt):
        np.testing.assert_allclose(running.values(keys, rewards), want_running)
        np.testing.assert_allclose(per_prompt.values(keys, rewards), want_prompt)
        running.update(keys, rewards)
        per_prompt.update(keys, rewards)


def test_prompt_key_is_the_tokens_before_the_first_action():
    r = Rollout(tokens=[1, 5, 6, 2, 3], action_mask=[0, 0, 0, 1, 1], rollout_logp=[0.0] * 5,
                versions=[-1, -1, -1, 0, 0], rewards=[0, 0, 0, 0, 1.0], prompt_id=4)
    assert baselines.prompt_key(r) == np.array([1, 5, 6], np.int32).tobytes()


# --- learners on a tiny real model -------------------------------------------------------------
def tiny_policy(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def rollouts_for(learner, groups, G, version=0, seed=0, noise=0.0):
    """`groups` groups of G rollouts (shared prompt per group) with rollout_logp from the
    current policy (plus `noise`: a behaviour policy that differs)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = list(rng.integers(1, V, size=3))
        for i in range(G):
            action = list(rng.integers(1, V, size=int(rng.integers(2, 5))))
            tokens = prompt + action
            out.append(Rollout(tokens=tokens, action_mask=[0] * 3 + [1] * len(action),
                               rollout_logp=np.zeros(len(tokens)),
                               versions=[-1] * 3 + [version] * len(action),
                               rewards=[0.0] * (len(tokens) - 1) + [float(rng.integers(0, 2))],
                               prompt_id=100 * seed + g))
    with torch.no_grad():
        logp = learner.policy_trainer.logprobs(collate(out))
    for i, r in enumerate(out):
        jitter = noise * rng.normal(size=r.length)
        r.rollout_logp = ((logp[i, :r.length].numpy() + jitter) * r.action_mask).astype(np.float32)
    return out


def grpo_learner(source=None, **overrides):
    config = SAOConfig(**{"algorithm": "grpo", "group_size": 4, "batch_size": 8, "actor_batch": 4,
                          "max_steps": 5, "policy_loss": "ppo_clip", "fused_logprobs": False,
                          **overrides})
    return assemble_learner(config, tiny_policy(), source=source)


def test_grpo_update_trains_the_policy_without_a_critic():
    learner = grpo_learner(policy_minibatches=2)
    assert not learner.estimator.has_critic
    batch = collate(rollouts_for(learner, 2, 4))
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    stats = learner.update(batch)
    assert any(not torch.equal(v, before[k]) for k, v in learner.policy.state_dict().items())
    assert stats["policy_minibatches"] == 2
    assert stats["kl_rollout"] == pytest.approx(0.0, abs=1e-6)  # first minibatch on-policy
    assert stats["ppo_ratio_max"] > 1.0  # the second minibatch sees the moved policy
    for key in ("value_loss", "explained_variance", "clip_frac", "masked_frac", "ess"):
        assert key in stats
    est = learner.estimator.estimate(batch)
    for g in range(2):  # advantages are centred within each group
        rows = est.advantages[4 * g:4 * g + 4]
        mask = batch.action_mask[4 * g:4 * g + 4]
        per_rollout = rows.sum(1) / mask.sum(1)
        assert float(per_rollout.sum()) == pytest.approx(0.0, abs=1e-5)


class FakeReader(core.RolloutSource):
    """Hands out queued rollouts in order, like the FIFO replay table."""

    def __init__(self, rollouts):
        self.items = list(rollouts)

    def sample(self, n, timeout_s):
        got, self.items = self.items[:n], self.items[n:]
        return got

    def queue_size(self):
        return len(self.items)


def test_grpo_sampling_assembles_whole_groups_and_drops_stale_ones():
    learner = grpo_learner(max_staleness=1, source=FakeReader([]))
    learner.version = 3
    fresh = rollouts_for(learner, 3, 4, version=2, seed=1)
    stale = rollouts_for(learner, 1, 4, version=1, seed=2)  # staleness 2 > 1
    a, b, c = fresh[0:4], fresh[4:8], fresh[8:12]
    # Two actors' groups arrive interleaved, with a stale group in between.
    order = [a[0], b[0], a[1], stale[0], b[1], a[2], stale[1], b[2], a[3], stale[2], stale[3],
             b[3], c[0], c[1], c[2], c[3]]
    learner.source.items = order
    got, _, dropped = learner.sampler.sample(8, learner.version, threading.Event())
    assert dropped == 4 and learner.dropped_stale == 4
    groups = [tuple(r.group_id for r in got[i:i + 4]) for i in (0, 4)]
    assert all(len(set(g)) == 1 for g in groups)  # whole groups, contiguous
    assert {g[0] for g in groups} == {a[0].group_id, b[0].group_id}
    d = rollouts_for(learner, 1, 4, version=3, seed=3)
    learner.source.items += d
    got, _, dropped = learner.sampler.sample(8, learner.version, threading.Event())
    # group c waited in the assembler
    assert [r.group_id for r in got] == [c[0].group_id] * 4 + [d[0].group_id] * 4
    assert dropped == 0


def test_group_assembler_keeps_partial_groups_until_complete_or_stale():
    asm = grpo.GroupAssembler(3)
    mk = lambda gid, v: Rollout(tokens=[1, 2], action_mask=[0, 1], rollout_logp=[0, 0],
                                versions=[-1, v], rewards=[0, 1], prompt_id=gid)
    asm.add([mk(1, 0), mk(2, 5), mk(1, 0)])
    assert asm.num_complete == 0 and asm.num_buffered == 3
    asm.add([mk(1, 0), mk(2, 5)])
    assert asm.num_complete == 1 and asm.pop_complete(5)[0][0].group_id == 1
    assert asm.drop_stale(lambda r: r.min_version() < 6) == 2  # the partial group 2
    assert asm.num_buffered == 0


def test_critic_free_learner_uses_the_tracked_baseline():
    config = SAOConfig(algorithm="critic_free", baseline="per_prompt", batch_size=4,
                       actor_batch=4, normalize_advantages=False, fused_logprobs=False)
    learner = assemble_learner(config, tiny_policy())
    batch = collate(rollouts_for(learner, 4, 1))
    rewards = batch.rewards.sum(1)
    est = learner.estimator.estimate(batch)  # first batch: the batch mean is the baseline
    np.testing.assert_allclose(est.baseline.numpy(), np.full(4, rewards.mean().item()))
    per_token = est.advantages.sum(1) / batch.action_mask.sum(1)
    np.testing.assert_allclose(per_token.numpy(), (rewards - rewards.mean()).numpy(), atol=1e-6)
    est2 = learner.estimator.estimate(batch)  # same prompts again: their own tracked values
    np.testing.assert_allclose(est2.baseline.numpy(), rewards.numpy(), atol=1e-6)
    stats = learner.update(batch)
    assert stats["masked_frac"] == 0.0 and "explained_variance" in stats


@pytest.mark.parametrize("loss", ["dis", "ppo_clip", "tis", "icepop", "none", "ppo_clip_decoupled",
                                  "gspo_decoupled"])
def test_sao_learner_trains_with_every_policy_loss(loss):
    config = SAOConfig(batch_size=4, actor_batch=4, max_steps=5, policy_loss=loss,
                       fused_logprobs=False, policy_minibatches=2)
    policy = tiny_policy()
    critic = ValueModel.from_policy(policy)
    critic.freeze(config.critic_frozen_patterns)
    learner = assemble_learner(config, policy, critic)
    batch = collate(rollouts_for(learner, 4, 1, noise=1.0))  # off-policy: corrections act
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    stats = learner.update(batch)
    assert np.isfinite(stats["policy_loss"]) and stats["kl_rollout"] > 0
    assert stats["policy_minibatches"] == 2 and "value_loss" in stats
    assert any(not torch.equal(v, before[k]) for k, v in policy.state_dict().items())
    if loss in ("dis", "icepop"):
        assert stats["masked_frac"] > 0


# --- actors: groups, delays, forced staleness ---------------------------------------------------
class CountingTask(core.Task):
    def __init__(self):
        self.n = 0

    def sample_prompt(self, rng):
        self.n += 1
        return core.Prompt(prompt_id=self.n, token_ids=(1, 2))

    def eval_prompts(self):
        return []

    def make_environment(self, prompt):
        raise NotImplementedError

    def is_correct(self, prompt, completion_tokens):
        return False


def test_actor_group_mode_repeats_each_prompt_g_times(tmp_path):
    from sao_actor_learner.actors.spool import RolloutSpool

    from types import SimpleNamespace

    spool = RolloutSpool(str(tmp_path / "spool"))
    engine = SimpleNamespace(weight_sync_mode="off")   # prompts_for generates nothing
    actor = Actor(0, CountingTask(), engine=engine, variables=None, sink=None, decode=None,
                  params=None, spool=spool, actor_batch=8, group_size=4)
    ids = [p.prompt_id for p in actor.prompts_for(8)]
    assert ids == [1, 1, 1, 1, 2, 2, 2, 2]
    assert [p.prompt_id for p in actor.prompts_for(6)] == [3, 3, 3, 3, 4, 4]  # short last group
    spool.close()


def test_actor_inserts_delayed_rollouts_in_ready_order():
    """The delivery thread (actors/delivery.py) sends a batch's rollouts when their delays have
    passed, soonest first, and reports each delay delivered. tests/actors/test_actor_pipeline.py runs it
    inside a whole actor."""
    import time
    from types import SimpleNamespace

    from sao_actor_learner.actors.delivery import DelayedDelivery

    seen, delivered = [], []

    def send(rollouts):
        seen.extend((r.name, time.monotonic() - t0) for r in rollouts)

    delays = np.array([0.06, 0.0, 0.03])
    delivery = DelayedDelivery(send, lambda n: delays[:n], max_waiting=3,
                               stop=threading.Event(),
                               on_delivered=lambda r, d: delivered.append((r.name, d)))
    t0 = time.monotonic()
    delivery.schedule([SimpleNamespace(name=x) for x in "abc"])
    delivery.close(drain=True)
    assert [x for x, _ in seen] == ["b", "c", "a"]
    assert [t >= d for (_, t), d in zip(seen, (0.0, 0.03, 0.06))] == [True] * 3
    assert delivered == [("b", 0.0), ("c", 0.03), ("a", 0.06)]
    assert sum(d for _, d in delivered) == pytest.approx(0.09)
    assert delivery.waiting == 0


def test_delayed_delivery_bounds_waiting_stops_promptly_and_reraises_send_errors():
    """At most max_waiting rollouts wait (wait_for_room blocks until stop); a stop leaves the
    waiting ones unsent; an error of the send function comes back to the caller."""
    import time
    from types import SimpleNamespace

    from sao_actor_learner.actors.delivery import DelayedDelivery

    sent, stop = [], threading.Event()
    delivery = DelayedDelivery(sent.extend, lambda n: np.full(n, 600.0), max_waiting=2,
                               stop=stop)
    with pytest.raises(ValueError, match="max_waiting=0"):
        DelayedDelivery(sent.extend, lambda n: np.zeros(n), max_waiting=0, stop=stop)
    delivery.schedule([SimpleNamespace(name=x) for x in "ab"])
    delivery.wait_for_room(0)                      # room for nothing more: returns at once
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (delivery.wait_for_room(1), done.set()),
                              daemon=True)
    waiter.start()
    assert not done.wait(0.3)                      # 2 waiting, 1 more would exceed 2
    stop.set()
    delivery.notify()
    waiter.join(timeout=60)
    assert done.is_set()
    delivery.close(drain=True)                     # stopped: does not wait the 600 s
    assert sent == [] and delivery.waiting == 2

    def broken(rollouts):
        raise OSError("replay is gone")

    failing = DelayedDelivery(broken, lambda n: np.zeros(n), max_waiting=4,
                              stop=threading.Event())
    failing.schedule([SimpleNamespace(name="c")])
    deadline = time.monotonic() + 60
    while True:                                    # until the thread has failed
        try:
            failing.wait_for_room(0)
        except RuntimeError as e:
            assert "replay is gone" in str(e)
            break
        assert time.monotonic() < deadline, "the send error never came back"
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="delivery thread failed"):
        failing.schedule([SimpleNamespace(name="d")])
    with pytest.raises(RuntimeError, match="replay is gone"):
        failing.close(drain=True)


def test_delay_distributions():
    rng = np.random.default_rng(0)
    assert np.all(sample_delays("fixed", 5, rng, 0.2) == 0.2)
    u = sample_delays("uniform", 20000, rng, 0.2)
    assert u.min() >= 0 and u.max() <= 0.4 and u.mean() == pytest.approx(0.2, rel=0.03)
    h = sample_delays("heavy_tailed", 200000, rng, 0.2, max_s=1e9, tail=2.5)
    assert h.mean() == pytest.approx(0.2, rel=0.05) and np.median(h) < 0.15  # skewed
    assert sample_delays("heavy_tailed", 1000, rng, 0.2, max_s=0.5).max() <= 0.5
    assert make_delay_sampler("none", 0.0, 1.0, 1.5, rng) is None
    with pytest.raises(ValueError, match="heavy"):
        sample_delays("heavy", 1, rng, 0.1)


# --- the online-shift task -----------------------------------------------------------------------
def test_online_shift_reward_flips_with_the_policy_version():
    version = {"v": 0}
    task = OnlineShiftTask(shift_every=5, version_source=lambda: version["v"], num_eval=20)
    prompt = task.make_prompt(37, 45, 0)
    assert [phase_of(v, 5) for v in (0, 4, 5, 9, 10)] == [0, 0, 1, 1, 0]
    assert answer_in_phase(prompt, 0) == "82" and answer_in_phase(prompt, 1) == "72"
    carry, no_carry = (task.tokenizer.encode(s, add_bos=False) + [task.tokenizer.eos_id]
                       for s in ("82", "72"))
    env = task.make_environment(prompt)
    assert env.step(carry).reward == 1.0
    version["v"] = 7
    assert task.make_environment(prompt).step(no_carry).reward == 1.0
    assert task.make_environment(prompt).step(carry).reward == 0.0
    assert env.phase == 0  # an episode keeps the phase it started in
    assert task.is_correct(prompt, no_carry) and not task.is_correct(prompt, carry)


# --- config checks, before launch --------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (dict(algorithm="grpo"), "group_size=1 with algorithm='grpo'"),
    (dict(algorithm="grpo", group_size=8, batch_size=12), "not a multiple of group_size"),
    (dict(group_size=4, batch_size=8, actor_batch=6), "actor_batch=6 is not a multiple"),
    (dict(queue_capacity=16, batch_size=32), "deadlock"),
    (dict(ppo_clip_low=1.0), "ppo_clip_low=1.0: must be in (0, 1)"),
    (dict(ppo_clip_high=0.0), "ppo_clip_high=0.0"),
    (dict(eps_high=-1.0), "eps_high=-1.0"),
    (dict(tis_cap=0.0), "tis_cap=0.0"),
    (dict(icepop_low=1.5), "icepop_low=1.5"),
    (dict(max_staleness=-2), "max_staleness=-2: must be >= 0"),
    (dict(forced_staleness=-2), "forced_staleness=-2: staleness cannot be negative"),
    (dict(forced_staleness=3, max_staleness=2), "raise max_staleness"),
    (dict(forced_staleness=1, admission_control=False), "needs admission_control=True"),
    (dict(algorithm="critic_free", value_pretrain_rollouts=50), "has no critic"),
    (dict(value_pretrain_rollouts=5), "value_pretrain_rollouts=5: too few"),
    (dict(value_pretrain_heldout=1.0), "value_pretrain_heldout=1.0"),
    (dict(critic_minibatches=0), "critic_minibatches"),
    (dict(actor_delay="uniform"), "set actor_delay_mean_s > 0"),
    (dict(actor_delay="heavy_tailed", actor_delay_mean_s=0.1, actor_delay_tail=1.0),
     "actor_delay_tail=1.0"),
    (dict(policy_minibatches=5, batch_size=8, group_size=2, actor_batch=8), "policy_minibatches=5"),
    (dict(algorithm="ppo"), "algorithm='ppo'"),
])
def test_bad_flag_combinations_name_what_to_change(overrides, message):
    with pytest.raises(ConfigError) as e:
        SAOConfig(**overrides)
    assert message in str(e.value)


def test_grpo_with_one_rollout_per_prompt_fails_before_launch(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "programs", "sao.py"),
                           "--algorithm=grpo", "--group_size=1", f"--run_dir={run_dir}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "set --group_size>=2" in proc.stderr + proc.stdout
    assert not run_dir.exists()


# --- whole programs -------------------------------------------------------------------------------
def program_config(warm_start, run_dir, **overrides):
    base = dict(init_checkpoint=warm_start, run_dir=str(run_dir), max_steps=5, batch_size=8,
                num_actors=2, actor_batch=4, eval_every=0, eval_size=20, launch="local_mp")
    base.update(overrides)
    return SAOConfig(**base)


def test_staleness_bound_holds_under_injected_heavy_tailed_delays(warm_start, tmp_path):
    """Actors without admission race ahead and their rollouts arrive late (heavy tails): none
    staler than max_staleness is trained on, and every drop is counted."""
    config = program_config(warm_start, tmp_path / "run", max_staleness=1, admission_control=False,
                            queue_capacity=32, actor_batch=8, actor_delay="heavy_tailed",
                            actor_delay_mean_s=0.05, actor_delay_max_s=0.5, max_steps=5)
    summary = run_program(config, make_program, progress=False)
    train = read_metrics(config.run_dir, "train")
    assert [r["step"] for r in train] == list(range(1, config.max_steps + 1))
    assert all(r["staleness_max"] <= 1 for r in train)
    assert summary["dropped_stale"] > 0
    assert sum(r["dropped_stale_step"] for r in train) == summary["dropped_stale"]
    assert summary["rollouts_trained"] == config.max_steps * config.batch_size
    # Nothing vanished: inserted = trained + dropped + still queued or buffered at the end.
    assert summary["rollouts_inserted"] >= summary["rollouts_trained"] + summary["dropped_stale"]


def test_forced_staleness_makes_every_grpo_rollout_exactly_k_stale(warm_start, tmp_path):
    k = 2
    config = program_config(warm_start, tmp_path / "run", algorithm="grpo", group_size=4,
                            policy_loss="dis", forced_staleness=k, max_staleness=k, max_steps=6,
                            actor_delay="uniform", actor_delay_mean_s=0.01)
    summary = run_program(config, make_program, progress=False)
    train = read_metrics(config.run_dir, "train")
    assert [r["step"] for r in train] == list(range(1, config.max_steps + 1))
    for r in train:
        trained_at = r["step"] - 1          # the version the batch was trained at
        want = min(trained_at, k)           # the first k versions cannot be k behind yet
        assert r["staleness_max"] == want and r["staleness_mean"] == pytest.approx(want)
    assert summary["dropped_stale"] == 0
