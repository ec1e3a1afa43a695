"""`--resume` with other settings than the run in run_dir was launched with: what carries over,
what is refused before launch.

The run folder keeps the config it was launched with (`<run_dir>/config.json`, written by
run.run_program). A resumed launch is compared with it field by field:

  carried over   max_staleness: the variable server's admission counters (rollouts started,
                 slots released, the learner's credit) are counts of rollouts, whatever the
                 rule; the rule `started <= (v + eta + 1) * B + credit` is evaluated with the
                 new eta from the first call on. A smaller eta holds actors back until the
                 learner has used (trained, or dropped as now too stale, which raises the
                 credit) what is in flight; a larger one admits more at once. The learner's
                 staleness filter takes eta from the config too (its sampler state holds only
                 counters). A learner that stopped cleanly checkpointed last: nothing is redone.
                 After a crash the journalled steps are redone under the new bound, and a redone
                 version that differs from the one published before the crash is counted
                 (resume_publish_conflicts) until the next version replaces it.
                 max_steps, the evaluation cadence, checkpoint cadence and retention, restarts,
                 and other fields that no durable state depends on carry over as given.
  refused        the fields of REFUSED below (ConfigError naming each one, the value the run
                 used and what to do), and a model directory whose architecture differs from
                 the checkpoint the learner resumes from.

Why batch_size is refused: the admission capacity counts B rollouts per policy version since
version 0, and the counters the server restores were granted under the old B. After a halved B
the capacity at version v is (v + eta + 1) * B/2 + credit while the rollouts already started are
up to (v0 + eta + 1) * B: once the learner has used those, actors wait for versions that need
rollouts nobody may start (a deadlock for v0 > eta). The redone journal steps would also form
other batches than the published versions had. Rebasing the counters exactly needs the version
the learner resumes from, which only the learner knows (a damaged checkpoint falls back), so a
changed batch is refused instead.

Standard library only (the launcher runs it).
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

from sao_actor_learner.config import ConfigError, SAOConfig

# field -> why a resumed run cannot take another value.
REFUSED: Dict[str, str] = {
    "batch_size": "the variable server's admission counters and the learner's journalled steps "
                  "count rollouts in batches of the old size (a smaller batch can deadlock "
                  "admission)",
    "model": "the learner resumes the checkpoint's weights while the actors and the evaluator "
             "build their engines from --model: another model puts them in a restart loop (a "
             "directory that moved: leave a symlink at its old path)",
    "algorithm": "the checkpoint's optimiser, estimator and sampler state belong to the old "
                 "algorithm",
    "critic": "the checkpoint holds the old critic's weights and optimiser state",
    "learners": "each learner rank has its own journal and sampler state in the checkpoint",
    "lora_rank": "the checkpoint's adapters (and their optimiser state) have the old rank, or "
                 "there are none",
    "lora_alpha": "the checkpoint's merged weights were made with the old adapter scale",
    "lora_target_modules": "the checkpoint's adapters sit on the old modules",
}

# config.json keys that fix a model's parameter names and shapes.
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "intermediate_size",
                     "head_dim", "tie_word_embeddings")


def _same(field: str, old, new) -> bool:
    if field == "model":
        return os.path.realpath(old) == os.path.realpath(new) if old and new else old == new
    return old == new


def changed_fields(previous: SAOConfig, config: SAOConfig) -> List[Tuple[str, object, object]]:
    """(field, value the run used, value given now) of each REFUSED field that differs."""
    return [(f, getattr(previous, f), getattr(config, f)) for f in REFUSED
            if not _same(f, getattr(previous, f), getattr(config, f))]


def _architecture(model_dir: str) -> Optional[Dict]:
    """The ARCHITECTURE_KEYS of a model directory's config.json (None: none readable)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    return {k: cfg.get(k) for k in ARCHITECTURE_KEYS}


def newest_checkpoint(run_dir: str) -> Optional[str]:
    """The newest complete learner checkpoint folder of run_dir, or None."""
    from sao_actor_learner.learner.checkpoint_files import complete_checkpoints
    found = complete_checkpoints(os.path.join(run_dir, "checkpoints"))
    return found[0][1] if found else None


def check_resumed_settings(previous: SAOConfig, config: SAOConfig, run_dir: str) -> None:
    """Raises ConfigError when `config` (resume=True) changes a field the run in `run_dir`
    (launched with `previous`) cannot take over, or when --model's architecture differs from
    the newest learner checkpoint's; names every such field and what to do."""
    changes = changed_fields(previous, config)
    checkpoint = newest_checkpoint(run_dir)
    if changes:
        flags = ", ".join(f"--{f}={new!r} (the run used {old!r})" for f, old, new in changes)
        why = "; ".join(f"{f}: {REFUSED[f]}" for f, _, _ in changes)
        keep = " ".join(f"--{f}={old!r}" for f, old, _ in changes)
        fresh = (f"start a new run in another --run_dir with --model={checkpoint} (the newest "
                 "checkpoint's policy; the critic and optimisers start anew)" if checkpoint
                 else "start a new run in another --run_dir")
        raise ConfigError(
            f"resume=True cannot change {flags} of the run in {run_dir!r}: {why}. Resume with "
            f"{keep}, or {fresh}")
    if checkpoint is None:
        return
    resumed, given = _architecture(checkpoint), _architecture(config.model)
    if resumed is not None and given is not None and resumed != given:
        diff = ", ".join(f"{k} {resumed[k]!r} vs {given[k]!r}" for k in ARCHITECTURE_KEYS
                         if resumed[k] != given[k])
        raise ConfigError(
            f"resume=True: --model={config.model!r} is not the architecture of the checkpoint "
            f"the learner resumes from, {checkpoint!r} ({diff}): the actors would build "
            "engines that cannot load its weights. Restore the model directory the run was "
            f"launched with, or start a new run in another --run_dir with --model={checkpoint}")
