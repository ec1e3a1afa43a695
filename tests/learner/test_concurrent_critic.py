"""The critic off the policy's critical path (config critic_concurrent, learner/critic_worker.py):
the K critic steps run in a thread of their own during the policy step, and every learner step
ends with the parameters of the sequential order, bit for bit (CPU, one torch thread per side:
the same operators on the same inputs in the same order); the critic's thread really is another
one, pinned to --placement's critic cores; the metrics say how much of it was hidden; settings
that need the sequential order, and critic placements the machine lacks, fail before launch; a
resumed concurrent learner ends with an uninterrupted sequential learner's weights."""
import dataclasses
import json
import os
import sys
import threading

if "triton" not in sys.modules:  # the Triton interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sao_actor_learner.learner_builder import assemble_learner, make_critic, make_critic_update
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.config.sections import PROGRAM_GROUPS
from sao_actor_learner.launch.placement import (CPU_SET_ENV, GroupPlacement,
                                                check_placement, critic_placement,
                                                parse_placement, placement_env)
from sao_actor_learner.learner.critic_worker import CriticUpdate
from sao_actor_learner.types import collate
from test_checkpoint_integrity import (_learner, _Publisher, _StreamReader,  # noqa: F401
                                       setting, tiny_dir)
from test_packing import drifting, learner_for, params, rollouts, tiny_policy

torch.set_num_threads(1)
CORES = sorted(os.sched_getaffinity(0))
BASE = dict(task="arithmetic", run_dir="/tmp/unused")


def _critic_threads(learner):
    """Records the thread each critic update runs in."""
    seen = []
    real = learner.estimator.update

    def recording(batch, estimate):
        seen.append(threading.get_ident())
        return real(batch, estimate)

    learner.estimator.update = recording
    return seen


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),                                      # SAO: K=2, the estimate's forward kept
    ("qwen3", {"critic_minibatches": 2}),               # the first slice's forward kept
    ("qwen3", {"micro_batch_layout": "packed", "micro_batch_tokens": 40}),
    ("qwen2", {"policy_loss": "ppo_clip", "policy_minibatches": 2, "micro_batch_tokens": 30,
               "critic_reuse_estimate_forward": False}),
    ("llama", {"gradient_checkpointing": True, "critic_updates": 3}),
])
def test_three_concurrent_steps_give_the_sequential_parameters_bit_for_bit(arch, overrides):
    sequential = learner_for(arch, **overrides)
    concurrent = learner_for(arch, critic_concurrent=True, **overrides)
    threads = _critic_threads(concurrent)
    batches = [collate(drifting(sequential, rollouts(seed=20 + i))) for i in range(3)]
    before = params(sequential)
    rows = []
    for batch in batches:
        a, b = sequential.update(batch), concurrent.update(batch)
        for key in ("policy_loss", "value_loss", "value_loss_last", "explained_variance",
                    "critic_grad_norm", "policy_grad_norm", "advantage_mean"):
            assert a[key] == b[key], key
        rows.append(b)
    after_a, after_b = params(sequential), params(concurrent)
    for k in after_a:
        assert torch.equal(after_a[k], after_b[k]), k
    moved = [k for k in before if not torch.equal(before[k], after_b[k])]
    assert any(k.startswith("policy.") for k in moved)
    assert any(k.startswith("critic.") for k in moved)
    for opt_a, opt_b in ((sequential.estimator.optimizer, concurrent.estimator.optimizer),
                         (sequential.policy_trainer.optimizer,
                          concurrent.policy_trainer.optimizer)):
        for sa, sb in zip(opt_a.state.values(), opt_b.state.values()):
            assert all(torch.equal(sa[n], sb[n]) for n in ("exp_avg", "exp_avg_sq"))
    # Another thread each time (the same worker), never this one.
    assert len(threads) == 3 and len(set(threads)) == 1
    assert threads[0] != threading.get_ident()
    assert [r["critic_version"] for r in rows] == [0, 1, 2]
    assert all(r["critic_lag_steps"] == 0 and r["critic_concurrent"] == 1 for r in rows)
    assert all(0.0 <= r["critic_overlap_frac"] <= 1.0 and r["critic_wait_s"] >= 0 and
               r["critic_step_s"] > 0 for r in rows)


def test_in_sequence_the_critic_is_all_on_the_critical_path():
    learner = learner_for()
    threads = _critic_threads(learner)
    stats = learner.update(collate(drifting(learner, rollouts(seed=30))))
    assert threads == [threading.get_ident()]
    assert stats["critic_concurrent"] == 0 and stats["critic_overlap_frac"] == 0.0
    assert stats["critic_wait_s"] >= stats["critic_step_s"] > 0


def test_the_critic_thread_is_pinned_to_its_cores_and_the_learner_thread_is_not():
    core = CORES[-1]
    learner = learner_for(critic_concurrent=True, placement=(f"critic:cpu{core}",))
    assert learner.critic_update.cores == (core,) and learner.critic_update.threads == 1
    learner.update(collate(drifting(learner, rollouts(seed=31))))
    assert learner.critic_update.thread_affinity == {core}
    assert sorted(os.sched_getaffinity(0)) == CORES          # this thread: as before
    assert torch.get_num_threads() == 1
    learner.critic_update.close()
    assert learner.critic_update._thread is None


def test_an_error_in_the_critic_thread_reaches_the_learner():
    learner = learner_for(critic_concurrent=True)

    def failing(batch, estimate):
        raise RuntimeError("critic exploded")

    learner.estimator.update = failing
    with pytest.raises(RuntimeError, match="critic exploded"):
        learner.update(collate(rollouts(seed=32)))


def test_a_concurrent_update_needs_a_separate_critic_and_one_start_per_join():
    shared = learner_for(critic="shared_trunk")
    with pytest.raises(ValueError, match="needs a separate critic"):
        CriticUpdate(shared.estimator, concurrent=True)
    with pytest.raises(ValueError, match="without critic_concurrent"):
        CriticUpdate(learner_for().estimator, cores=(0,))
    runner = CriticUpdate(learner_for().estimator)
    with pytest.raises(RuntimeError, match="no critic update was started"):
        runner.join()


# Bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,says", [
    ({"critic": "shared_trunk"}, "critic_concurrent=True with critic='shared_trunk'"),
    ({"learners": 2}, "critic_concurrent=True with learners=2"),
    ({"algorithm": "critic_free"}, "critic_concurrent=True with algorithm='critic_free'"),
    ({"placement": ("critic:cpu999",)}, r"placement critic:cpu999: core\(s\) \[999\]"),
    ({"placement": ("critic:gpu0-1",)}, "critic"),
])
def test_settings_that_need_the_sequential_order_fail_before_launch(overrides, says):
    with pytest.raises(ConfigError, match=says):
        SAOConfig(critic_concurrent=True, **{**BASE, **overrides}).validate()


def test_a_critic_placement_without_the_concurrent_critic_or_a_gpu_is_refused():
    with pytest.raises(ConfigError, match="add --critic_concurrent=true"):
        SAOConfig(placement=(f"critic:cpu{CORES[0]}",), **BASE).validate()
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None and not os.path.exists("/dev/nvidia0"):
        with pytest.raises(ConfigError, match=r"placement critic:gpu0: GPU\(s\) \[0\] do not "
                                              "exist here"):
            SAOConfig(critic_concurrent=True, placement=("critic:gpu0",), **BASE).validate()
    with pytest.raises(ValueError, match="the critic runs on one GPU"):
        critic_placement(["critic:gpu0-1"], PROGRAM_GROUPS)
    SAOConfig(critic_concurrent=True, placement=(f"critic:cpu{CORES[0]}",), **BASE).validate()


def test_the_critic_entry_is_no_node_and_its_gpu_joins_the_learners():
    entries = ["actor:cpu0", "learner:cpu1", "learner:gpu4-5", "critic:cpu2-3", "critic:gpu6"]
    env = placement_env(parse_placement(entries, PROGRAM_GROUPS + ("critic",)))
    assert set(env) == {"actor", "learner"}
    assert env["learner"] == {CPU_SET_ENV: "1", "OMP_NUM_THREADS": "1",
                              "CUDA_VISIBLE_DEVICES": "4,5,6"}
    assert critic_placement(entries, PROGRAM_GROUPS) == ((2, 3), 2)   # cuda:2 in the learner
    assert critic_placement(["learner:gpu4-5", "critic:gpu4"], PROGRAM_GROUPS) == ((), 0)
    assert critic_placement(["critic:gpu1"], PROGRAM_GROUPS) == ((), 1)   # all GPUs visible
    assert critic_placement(["learner:cpu0"], PROGRAM_GROUPS) == ((), None)
    with pytest.raises(ValueError, match="GROUP one of"):
        parse_placement(["critic:cpu0"], PROGRAM_GROUPS)    # not a node group


def test_a_placed_node_revalidating_its_config_accepts_cores_outside_its_own(monkeypatch):
    """A pinned learner (learner:cpu0) re-validating its config (config.replace) must not
    refuse critic:cpu1 or actor:cpu1 because it now runs on core 0 alone: the launcher
    checked them against the machine."""
    monkeypatch.setenv(CPU_SET_ENV, "0")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    check_placement({"learner": GroupPlacement(cpus=(0,)), "actor": GroupPlacement(cpus=(1,)),
                     "critic": GroupPlacement(cpus=(1,))})
    monkeypatch.delenv(CPU_SET_ENV)
    with pytest.raises(ValueError, match=r"critic:cpu1: core\(s\) \[1\] are not available"):
        check_placement({"critic": GroupPlacement(cpus=(1,))})


def test_dropout_is_refused_before_launch_and_when_the_learner_is_built(tmp_path):
    from sao_actor_learner.preflight import check_no_dropout
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"attention_dropout": 0.1,
                                                   "hidden_dropout": 0.0}))
    config = SAOConfig(critic_concurrent=True, model=str(model), **BASE)
    with pytest.raises(ConfigError, match=r"--critic_concurrent=true with --model=.*"
                                          r"attention_dropout=0.1"):
        check_no_dropout(config)
    (model / "config.json").write_text(json.dumps({"attention_dropout": 0.0}))
    check_no_dropout(config)
    learner = learner_for()
    policy = tiny_policy("llama")
    policy.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="critic_concurrent=True with dropout in the networks "
                                         r"\(attention_dropout=0.1"):
        make_critic_update(SAOConfig(critic_concurrent=True, **BASE), learner.estimator, policy)


# Resume ----------------------------------------------------------------------------------------
def test_a_resumed_concurrent_learner_ends_with_the_uninterrupted_sequential_weights(
        setting, tmp_path):
    """test_checkpoint_integrity's setting: 6 steps, a checkpoint every 2; the concurrent run
    "crashes" after step 3 and resumes from step 2 with the journal."""
    config, stream = setting
    concurrent = dataclasses.replace(config, critic_concurrent=True)
    a, _ = _learner(config, str(tmp_path / "a"), _StreamReader(stream), _Publisher())
    a.run()                                    # sequential, uninterrupted
    run_b = str(tmp_path / "b")
    reader_b = _StreamReader(stream)
    b, _ = _learner(concurrent, run_b, reader_b, _Publisher())
    b.publish()
    for _ in range(3):
        b.step()                               # checkpoint at 2, step 3 journalled; "crash"
    del b
    c, _ = _learner(concurrent, run_b, _StreamReader(stream, reader_b.position), _Publisher())
    assert (c.version, c.resumed_from) == (2, 2) and c.critic_update.concurrent
    c.run()
    assert c.version == a.version == 6
    for name, tensor in a.policy.state_dict().items():
        assert torch.equal(tensor, c.policy.state_dict()[name]), name
    for (name, p), q in zip(a.estimator.critic.named_parameters(),
                            c.estimator.critic.parameters()):
        assert torch.equal(p, q), name


# The benchmark ---------------------------------------------------------------------------------
def test_the_learner_step_benchmark_compares_the_critic_in_sequence_and_concurrent(tmp_path):
    """Format only: both cells, the critic's parts, the ratio row (no timing asserted)."""
    from test_packing import run_learner_step_benchmark
    result = run_learner_step_benchmark(
        tmp_path, "--critic_concurrent=off,on",
        f"--placement=learner:cpu{CORES[0]},critic:cpu{CORES[-1]}")
    cells = {c["critic_concurrent"]: c for c in result["cells"]}
    assert set(cells) == {"off", "on"}, result
    for c in cells.values():
        assert c["policy_loss_finite"] and c["critic_step_s"] > 0
        assert 0.0 <= c["critic_overlap_frac"] <= 1.0
    assert cells["off"]["critic_overlap_frac"] == 0.0
    [ratio] = result["concurrent_ratios"]
    assert ratio["speedup_off_over_on"] == pytest.approx(cells["off"]["step_s"] /
                                                         cells["on"]["step_s"])


def test_the_learner_state_waits_for_a_pending_critic_update():
    """A checkpoint never reads a critic in the middle of its steps (a step that failed after
    starting the critic leaves one pending)."""
    config = SAOConfig(batch_size=6, actor_batch=6, max_steps=3, critic_concurrent=True)
    policy = tiny_policy("llama")
    learner = assemble_learner(config, policy, make_critic(config, policy), _StreamReader([]))
    batch = collate(drifting(learner, rollouts(seed=33)))
    estimate = learner.estimator.estimate(batch)
    learner.critic_update.start(batch, estimate)
    assert learner.critic_update.pending
    reference = learner_for()
    reference.estimator.update(batch, reference.estimator.estimate(batch))
    state = learner.learner_state()
    assert not learner.critic_update.pending
    for (name, p), q in zip(reference.estimator.critic.named_parameters(),
                            learner.estimator.critic.parameters()):
        assert torch.equal(p, q), name
    assert int(state["estimator"]["critic_opt"]["state"][0]["step"]) == 2
    learner.critic_update.close()
