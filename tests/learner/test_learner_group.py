"""A data-parallel learner group on torch.distributed (gloo, 2 CPU ranks): a DDP step and an
FSDP2 step give the parameters of the single-process whole-batch step on the same rollouts."""
import multiprocessing
import os
import socket
import sys

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import learner_group_fixtures as lg
import test_learner_scale as t
from sao_actor_learner.learner import distributed
from sao_actor_learner.models.checkpoint import sync_state_dict
from sao_actor_learner.types import collate


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(overrides, tmp_path, world_size=2):
    port = free_port()
    store = distributed.serve_store("127.0.0.1", port, timeout_s=120)
    out = str(tmp_path / "rank0.pt")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=lg.run_rank,
                         args=(r, world_size, f"127.0.0.1:{port}", overrides, out))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    del store
    assert [p.exitcode for p in procs] == [0] * world_size
    return torch.load(out, weights_only=False)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("overrides", [
    dict(learner_strategy="ddp"),
    dict(learner_strategy="ddp", micro_batch_tokens=30, algorithm="critic_free"),
    dict(learner_strategy="fsdp2"),
    dict(learner_strategy="ddp", critic="shared_trunk"),
    dict(learner_strategy="fsdp2", critic="shared_trunk"),
    dict(learner_strategy="ddp", lora_rank=4, policy_lr=1e-2),
], ids=["ddp", "ddp-micro-critic_free", "fsdp2", "ddp-shared_trunk", "fsdp2-shared_trunk",
        "ddp-lora"])
def test_a_two_rank_step_equals_the_single_process_whole_batch_step(overrides, tmp_path):
    group = run_group(overrides, tmp_path)
    single = t.learner_for(**{k: v for k, v in overrides.items() if k != "learner_strategy"},
                           batch_size=8, actor_batch=8)
    stats = single.update(collate(lg.group_batch(single)))
    for name, tensor in distributed.full_state_dict(single.policy).items():   # LoRA: merged
        diff = float((group["policy"][name].double() - tensor.double()).norm())
        assert diff <= 1e-5 * float(tensor.double().norm()) + 1e-12, (name, diff)
    published = sync_state_dict(single.policy)   # what a version publishes (FSDP2: gathered)
    assert set(group["published"]) == set(published)
    for name, tensor in published.items():
        diff = float((group["published"][name].double() - tensor.double()).norm())
        assert diff <= 1e-5 * float(tensor.double().norm()) + 1e-12, (name, diff)
    if single.estimator.has_critic:
        for name, tensor in single.estimator.critic.state_dict().items():
            diff = float((group["critic"][name].double() - tensor.double()).norm())
            assert diff <= 1e-5 * float(tensor.double().norm()) + 1e-12, (name, diff)
    for key in ("policy_loss", "masked_frac", "kl_rollout", "ess", "value_loss",
                "explained_variance", "advantage_mean", "chi2_token", "chi2_seq", "ppl_ratio",
                "token_entropy_mean", "advantage_std", "advantage_pos_frac"):
        if key in stats:
            assert group["stats"][key] == pytest.approx(stats[key], rel=1e-5, abs=1e-7), key


@pytest.mark.timeout(600)
def test_a_program_with_two_learner_ranks_trains_and_survives_kill_9_of_a_rank(warm_start,
                                                                               tmp_path):
    """local_mp, the whole SAO program with --learners=2: versions 1..12 in order, the staleness
    bound held, and after a SIGKILL of rank 1 the whole group restarts from its checkpoint and
    redoes the lost steps; no rollout is lost or trained twice."""
    import signal

    import fault_fixtures as ff
    from sao_actor_learner.accounting import rollout_accounting
    from sao_actor_learner.builder import make_program
    from sao_actor_learner.config import SAOConfig
    from sao_actor_learner.observers import read_metrics
    from sao_actor_learner.run import run_program

    config = SAOConfig(init_checkpoint=warm_start, run_dir=str(tmp_path / "run"), max_steps=12,
                       batch_size=8, num_actors=2, actor_batch=4, max_staleness=2, learners=2,
                       eval_every=0, eval_size=8, checkpoint_every=4,
                       restart_groups=("actor", "evaluator", "learner"), restart_backoff_s=0.2)
    run_dir = config.run_dir
    killed = {}

    def step():
        train = read_metrics(run_dir, "train")
        return train[-1]["step"] if train else 0

    def kill_rank_1(launched):
        ff.wait_for(lambda: (s := step()) > 4 and s % 4 and s < 12, timeout=300,
                    what="a step past a checkpoint", poll=0.005)
        killed["pid"] = ff.nodes_json(run_dir)["learner_1"]["pid"]
        killed["at"] = step()
        os.kill(killed["pid"], signal.SIGKILL)

    summary = run_program(config, make_program, progress=False, on_launch=kill_rank_1)
    nodes = ff.nodes_json(run_dir)
    assert nodes["learner_1"]["restarts"] == nodes["learner_0"]["restarts"] == 1, nodes
    assert nodes["learner_1"]["restart_history"][0]["pid"] == killed["pid"]
    train = read_metrics(run_dir, "train")
    assert sorted({r["step"] for r in train}) == list(range(1, 13))
    for row in train:
        assert row["policy_version"] == row["step"] and row["learners"] == 2
        assert row["staleness_max"] <= config.max_staleness
        assert row["batch_size"] == config.batch_size
    resumed = [r for r in train if "resumed_from" in r]
    assert resumed and resumed[0]["resumed_from"] % 4 == 0 and \
        resumed[0]["resumed_from"] < killed["at"]
    assert resumed[-1]["resume_publish_conflicts"] == 0
    acc = rollout_accounting(run_dir)
    assert acc["learner_version"] == 12 and acc["trained"] == 12 * config.batch_size
    assert acc["lost"] == 0 and acc["consumed_twice"] == 0 and acc["forgot_early"] == 0, acc
    assert summary["rollouts_trained"] == 12 * config.batch_size


def test_a_one_host_group_keeps_gloo_on_the_loopback_interface():
    """gloo ranks listen on the address the host name resolves to unless told an interface: a
    group whose store is on loopback pins them to the loopback interface (a user's own
    GLOO_SOCKET_IFNAME, or a multi-host group, is left to gloo)."""
    from sao_actor_learner.learner.distributed import gloo_interface
    assert gloo_interface("127.0.0.1", {}).startswith("lo")     # Linux "lo", BSD "lo0"
    assert gloo_interface("localhost", {}) == gloo_interface("127.0.0.1", {})
    assert gloo_interface("10.1.2.3", {}) == ""
    assert gloo_interface("127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth0"}) == ""
