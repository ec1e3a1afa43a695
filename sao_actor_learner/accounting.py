"""Where every rollout of a run went, by key, from what the run left on disk.

Every rollout an actor completes gets a key (actor_id, seq) in its spool (actors/spool.py); the
learner records the keys it consumed for good (trained, dropped as too stale, refused as from
the future) in its checkpoints (learner/consumed.py) and journals what it sampled after its
newest checkpoint (learner/journal.py). After a run has stopped, `rollout_accounting(run_dir)`
puts the two sides together:

  completed          keys the actors completed (their spool ledgers)
  refused            rollouts the actors' check refused before spooling, by reason
  sent_once          keys handed to replay at least once
  resent             sends beyond the first (actors' stats: loss epochs, restarts)
  acknowledged       keys the actors forgot because the learner consumed them
  held               keys still in the spools (sent again by a resumed run)
  consumed           keys the learner consumed for good (its newest checkpoint)
  in_learner_journal keys sampled after that checkpoint (redone by a resumed run)
  trained, dropped_stale, value_pretraining   the learner's counters
  duplicates         copies the learner skipped because their key was consumed already

and from them

  lost          keys completed that nobody holds: not consumed, not journalled, not in a spool
  forgot_early  keys an actor forgot that the learner never consumed (an acknowledgement bug)
  consumed_twice  training-and-dropping events beyond one per consumed key

`lost`, `forgot_early` and `consumed_twice` are 0 in a correct run, whatever was killed when.
Needs no Reverb.
"""
from __future__ import annotations

import collections
import json
import os
import re
from typing import Dict, List


def _numbered(folder: str, pattern: str) -> List[int]:
    """The numbers of the entries of `folder` whose whole name matches `pattern` (one group),
    ascending. The folder is listed, never globbed: it comes from a user's --run_dir, whose
    "[", "*" or "?" a glob would read as wildcards."""
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for m in map(re.compile(pattern).fullmatch, names) if m)


def rollout_accounting(run_dir: str) -> Dict:
    """The counts above for the run in `run_dir` (stopped)."""
    from sao_actor_learner.actors.spool import read_ledger
    from sao_actor_learner.learner import journal as journal_lib
    from sao_actor_learner.learner.consumed import ConsumedKeys

    completed, acked, held = set(), set(), set()
    refused: collections.Counter = collections.Counter()
    sent_once = resent = 0
    spool = os.path.join(run_dir, "spool")
    for actor in _numbered(spool, r"actor_(\d+)"):
        directory = os.path.join(spool, f"actor_{actor}")
        state = read_ledger(directory)
        completed |= {(actor, s) for s in state["completed"]}
        acked |= {(actor, s) for s in state["acked"]}
        held |= {(actor, s) for s in state["held"]}
        refused.update(state["refused"])
        sent_once += state["sent_once"]
        stats = os.path.join(run_dir, f"actor_{actor}_stats.json")
        if os.path.exists(stats):
            with open(stats) as f:
                resent += int(json.load(f).get("rollouts_resent", 0))

    root = os.path.join(run_dir, "checkpoints")
    point = journal_lib.ResumePoint(root)
    state: Dict = {}
    if point.checkpoint is not None:
        from sao_actor_learner.learner.checkpointing import read_learner_state
        state = read_learner_state(os.path.join(point.checkpoint,
                                                journal_lib.LEARNER_STATE_FILE))
    sampler = (state.get("samplers") or [{}])[0]   # rank 0's: its consumed keys are the group's
    consumed_keys = ConsumedKeys()
    consumed_keys.load_state_dict(sampler.get("consumed", {}))
    journalled = {r.key for record in point.replay for r in record}
    for rank in _numbered(root, r"journal_rank(\d+)"):
        journalled |= {r.key for record in journal_lib.ResumePoint(root, rank).replay
                       for r in record}
    totals = state.get("group_totals", {})
    trained = int(state.get("rollouts_trained", 0))
    dropped = int(totals.get("dropped", 0))
    pretrain = int(state.get("consumed_without_version", 0))
    refused_future = int(totals.get("from_future", 0))
    consumed = {k for k in completed | acked if consumed_keys.contains(k)}
    lost = completed - consumed - journalled - held
    return {
        "completed": len(completed), "refused": dict(refused), "sent_once": sent_once,
        "resent": resent, "acknowledged": len(acked), "held": len(held),
        "consumed": len(consumed), "in_learner_journal": len(journalled - consumed),
        "learner_version": int(state.get("version", 0)), "trained": trained,
        "dropped_stale": dropped, "value_pretraining": pretrain,
        "refused_from_future": refused_future,
        "duplicates": int(totals.get("duplicates", 0)),
        "lost": len(lost), "lost_keys": sorted(lost)[:20],
        "forgot_early": len(acked - consumed),
        "consumed_twice": max(0, trained + dropped + pretrain + refused_future - len(consumed)),
    }
