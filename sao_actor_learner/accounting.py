"""Where every rollout of a run went, from what the run left on disk (issue 7).

After a run has stopped, `rollout_accounting(run_dir)` counts, each from its own durable
record:

  completed         rollouts the actors finished generating (their spool ledgers)
  inserted          confirmed in replay by an actor (spool ledgers)
  rejected          refused by the writer's validation, by reason (spool ledgers)
  pending_in_spools completed, not yet confirmed (re-inserted by a resumed run)
  replay_inserts    inserts replay counted (its checkpoint's rate-limiter statistics)
  replay_samples    rollouts replay handed out (samples / samples_per_insert: an
                    acknowledged table samples each rollout ACK_TIMES_SAMPLED (4) times;
                    replay/tables.py)
  queued_in_replay  still in the table at the end (its checkpoint)
  trained           trained on by a policy step (the learner's newest checkpoint)
  value_pretraining consumed by critic-only value pretraining
  dropped_stale     dropped by the learner as staler than max_staleness
  learner_buffered  taken from replay by the learner's reader but never used (lost)
  in_learner_journal sampled after the newest learner checkpoint (redone on resume)

and from them (replay's own books always balance: replay_inserts = replay_samples +
queued_in_replay)

  duplicates      = replay_inserts - inserted, if > 0 (an actor killed between replay's
                    confirmation and its ledger line inserts that rollout again)
  lost_in_replay  = inserted - replay_inserts, if > 0 (replay restored a checkpoint older than
                    inserts it had confirmed)
  consumed        = trained + value_pretraining + dropped_stale + in_learner_journal
  lost_in_transit = replay_samples - consumed - learner_buffered, if > 0 (taken from replay by
                    a learner killed before its journal had them)
  trained_twice   = consumed + learner_buffered - replay_samples, if > 0 (replay restored a
                    checkpoint older than samples it had handed out, and handed them out again)
  lost            = lost_in_replay + lost_in_transit + learner_buffered

`lost` is 0 when every rollout replay confirmed was trained on, dropped by a rule, or is still
queued: the point of the spool, the journal and the replay checkpoints. A replay node killed
with SIGKILL returns to its last periodic checkpoint (lost_in_replay, trained_twice); one
restarted cooperatively while actors and the learner keep running checkpoints while they still
insert and sample, so the same can happen for what lands during the checkpoint's write. A
program stop is exact (actors and learner stop before replay writes its last checkpoint).

Needs Reverb (the replay checkpoint is read by restoring it into a throw-away server).
"""
from __future__ import annotations

import collections
import glob
import os
from typing import Dict, Optional


def rollout_accounting(run_dir: str, replay_checkpoint_dir: Optional[str] = None) -> Dict:
    """The counts above for the run in `run_dir` (stopped)."""
    from sao_actor_learner.actors.spool import read_ledger
    from sao_actor_learner.learner import journal as journal_lib

    out: Dict = {"completed": 0, "inserted": 0, "rejected": collections.Counter(),
                 "pending_in_spools": 0}
    for directory in sorted(glob.glob(os.path.join(run_dir, "spool", "actor_*"))):
        counts = read_ledger(directory)
        out["completed"] += counts["completed"]
        out["inserted"] += counts["inserted"]
        out["rejected"].update(counts["rejected"])
        out["pending_in_spools"] += counts["pending"]
    out["rejected"] = dict(out["rejected"])

    root = os.path.join(run_dir, "checkpoints")
    point = journal_lib.ResumePoint(root)
    state = {}
    if point.checkpoint is not None:
        import torch
        state = torch.load(os.path.join(point.checkpoint, journal_lib.LEARNER_STATE_FILE),
                           weights_only=False)
    out["learner_version"] = int(state.get("version", 0))
    out["trained"] = int(state.get("rollouts_trained", 0))
    out["value_pretraining"] = int(state.get("pretrain_consumed", 0))
    out["dropped_stale"] = int(state.get("dropped_stale", 0))
    out["learner_buffered"] = int(state.get("reader_buffered", 0))
    out["in_learner_journal"] = sum(len(r) for r in point.replay)

    capacity = 1   # Reverb restores the checkpoint's own limiter; the config's avoids a warning
    try:
        from sao_actor_learner.config import SAOConfig
        with open(os.path.join(run_dir, "config.json")) as f:
            capacity = SAOConfig.from_json(f.read()).effective_queue_capacity
    except (OSError, ValueError, TypeError):
        pass
    replay = _replay_counts(replay_checkpoint_dir or os.path.join(root, "replay"), capacity)
    out.update(replay)
    if replay.get("replay_inserts") is not None:
        out["duplicates"] = max(0, replay["replay_inserts"] - out["inserted"])
        out["lost_in_replay"] = max(0, out["inserted"] - replay["replay_inserts"])
        consumed = (out["trained"] + out["value_pretraining"] + out["dropped_stale"]
                    + out["in_learner_journal"])
        taken = replay["replay_samples"]
        out["lost_in_transit"] = max(0, taken - consumed - out["learner_buffered"])
        out["trained_twice"] = max(0, consumed + out["learner_buffered"] - taken)
        out["lost"] = out["lost_in_replay"] + out["lost_in_transit"] + out["learner_buffered"]
    return out


def _replay_counts(checkpoint_dir: str, capacity: int) -> Dict:
    """Inserts, samples and queue size held by the newest replay checkpoint in the folder."""
    if not os.path.isdir(checkpoint_dir) or not os.listdir(checkpoint_dir):
        return {"replay_inserts": None, "replay_samples": None, "queued_in_replay": 0}
    from sao_actor_learner.replay import DEFAULT_TABLE, ReplayServer
    from sao_actor_learner.replay.tables import table_info

    server = ReplayServer(capacity, checkpoint_dir=checkpoint_dir).start()
    try:
        info = table_info(server.client(), DEFAULT_TABLE)
        rl = info.rate_limiter_info
        per_rollout = max(1, int(round(rl.samples_per_insert)))   # 4: an acknowledged table
        return {"replay_inserts": int(rl.insert_stats.completed),
                "replay_samples": int(rl.sample_stats.completed) // per_rollout,
                "queued_in_replay": int(info.current_size)}
    finally:
        server._shutdown()
