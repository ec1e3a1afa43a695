"""A learner-group rank for tests (module level so spawned processes can import it): it joins
the group, runs one update on its share of a fixed batch, and rank 0 saves the parameters."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run_rank(rank, world_size, address, overrides, out_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)
    from sao_actor_learner.learner import distributed
    from sao_actor_learner.models.value import base_model_of
    from sao_actor_learner.types import collate
    import test_learner_scale as t

    from sao_actor_learner.builder import assemble_learner, make_critic
    from sao_actor_learner.config import SAOConfig

    backend = os.environ.get("LEARNER_GROUP_BACKEND", "")     # "" gloo on CPU; nccl on GPUs
    collective = distributed.init_process_group(rank, world_size, address, timeout_s=120,
                                                backend=backend)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    rs = group_batch(t.learner_for(**overrides))        # before any sharding: plain log-probs
    config = SAOConfig(**{"batch_size": 8, "actor_batch": 8, "max_steps": 3, "learners": 2,
                          **overrides})
    policy = t.tiny_policy(0).to(device)
    critic = make_critic(config, policy, collective)   # before the policy is sharded
    from sao_actor_learner.models import lora                 # after the critic's copy
    lora.prepare_learner_policy(policy, lora.LoraSpec.from_config(config), None)
    distributed.prepare_module(policy, config.learner_strategy, collective,
                               layers=base_model_of(policy).layers)
    learner = assemble_learner(config, policy, critic, collective=collective)
    stats = learner.update(collate(rs[rank::world_size]))
    published = distributed.sync_weights(learner.policy)()   # what rank 0 publishes
    policy = distributed.full_state_dict(learner.policy)     # on CPU
    critic = distributed.full_state_dict(learner.estimator.critic) \
        if learner.estimator.has_critic else {}
    if rank == 0:
        torch.save({"policy": policy, "critic": critic, "stats": stats,
                    "published": published}, out_path)
    collective.barrier()


def group_batch(learner):
    """The fixed batch both the group and the single-process reference train on."""
    import numpy as np
    import test_learner_scale as t
    rs = t.on_policy(learner, t.rollouts(8, seed=5, lengths=(3, 12)))
    for r in rs:
        r.rollout_logp = (r.rollout_logp + 0.2 * r.action_mask * np.sin(np.arange(r.length))
                          ).astype(np.float32)
    return rs
