"""SAO's critic measured and fitted on fixed rollout sets (docs/METHOD.md section 6).

  fit.py          value pretraining as a fit: epochs of minibatches over a rollout budget, a
                  held-out stopping rule, the best parameters kept
  stats.py        explained variance (by position segment), the prompt-level ceiling, ridge
  rollout_set.py  a fixed set of one policy's rollouts: sampled once, saved, reused
  probe.py        the critic probe (programs/critic_probe.py)
  pretrain.py     the value-pretrained critic directory (programs/pretrain_critic.py)

No reverb, tensorflow or grpc here.
"""
