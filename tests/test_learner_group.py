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
], ids=["ddp", "ddp-micro-critic_free", "fsdp2"])
def test_a_two_rank_step_equals_the_single_process_whole_batch_step(overrides, tmp_path):
    group = run_group(overrides, tmp_path)
    single = t.learner_for(**{k: v for k, v in overrides.items() if k != "learner_strategy"},
                           batch_size=8, actor_batch=8)
    stats = single.update(collate(lg.group_batch(single)))
    for name, tensor in single.policy.state_dict().items():
        diff = float((group["policy"][name].double() - tensor.double()).norm())
        assert diff <= 1e-5 * float(tensor.double().norm()) + 1e-12, (name, diff)
    if single.estimator.has_critic:
        for name, tensor in single.estimator.critic.state_dict().items():
            diff = float((group["critic"][name].double() - tensor.double()).norm())
            assert diff <= 1e-5 * float(tensor.double().norm()) + 1e-12, (name, diff)
    for key in ("policy_loss", "masked_frac", "kl_rollout", "ess", "value_loss",
                "explained_variance", "advantage_mean"):
        if key in stats:
            assert group["stats"][key] == pytest.approx(stats[key], rel=1e-5, abs=1e-7), key
