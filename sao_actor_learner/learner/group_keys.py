"""Key exchange between the ranks of a learner group: no rollout is trained by two ranks.

Each rank draws its share of a batch from replay (at-least-once delivery: a rollout re-inserted
after a loss epoch can reach two ranks). `draw_exclusive` exchanges the keys of each draw: a key
two ranks drew stays with the lower rank, the other draws again, until no rank is short.
`share_consumed` gives every rank every rank's consumed keys after each step, so a duplicate is
skipped wherever it arrives later. With one process both are the plain draw and a no-op.
"""
from __future__ import annotations

import threading
from typing import List, Tuple

from sao_actor_learner.learner.distributed import Collective
from sao_actor_learner.learner.sampling import RolloutSampler
from sao_actor_learner.types import Rollout


def draw_exclusive(sampler: RolloutSampler, collective: Collective, want: int, version: int,
                   stop: threading.Event) -> Tuple[List[Rollout], float, int]:
    """This rank's `want` rollouts for `version`, none drawn by a lower rank too: (rollouts,
    seconds waited, dropped as stale now). Every rank must call it (a collective)."""
    rollouts, waited, dropped = sampler.sample(want, version, stop)
    while collective.world_size > 1:
        drawn = collective.gather_objects([r.key for r in rollouts])
        taken = {k for keys in drawn[:collective.rank] for k in keys}
        mine = [r for r in rollouts if r.key not in taken]
        short = collective.max([len(rollouts) - len(mine)])[0]
        if not short:
            break
        sampler.duplicates += len(rollouts) - len(mine)
        more, w, d = sampler.sample(want - len(mine), version, stop)
        rollouts, waited, dropped = mine + more, waited + w, dropped + d
    return rollouts, waited, dropped


def share_consumed(sampler: RolloutSampler, collective: Collective) -> None:
    """Every rank adds every rank's consumed keys (taken and dropped since the last exchange).
    Every rank must call it (a collective)."""
    if collective.world_size == 1:
        return
    for state in collective.gather_objects(sampler.consumed.state_dict()):
        sampler.consumed.merge(state)
