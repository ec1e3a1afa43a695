"""The sweeps as presets of the one study entry point (`programs/study.py --preset=NAME`).

  staleness_sweep       methods x staleness x batch shapes x seeds (staleness.py)
  value_pretrain_sweep  SAO runs that differ only in value_pretrain_rollouts (value_pretrain.py)
  online_shift_sweep    the reward rule flips every --shift_every versions (online_shift.py)

Each writes what its own program used to (results.csv, its plots, recovery.csv) into --out_dir,
with the grid and run size of --size (smoke or full). `refused_flags` says which flags given on
the command line a preset (or a study, `sweep=None`) does not read, so they fail before
anything runs instead of being ignored.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Collection, Dict, List, Optional, Tuple

from experiments.sweep_presets import online_shift, staleness, value_pretrain
from sao_actor_learner.config import SAOConfig

# SAOConfig fields every study and sweep cell sets: programs/study.py defines no flag for them.
ALWAYS_CELL_FIELDS = ("algorithm", "policy_loss", "batch_size", "group_size", "forced_staleness",
                      "seed", "run_dir")
# SAOConfig fields every study cell sets besides those (sweeps.Cell.config).
STUDY_CELL_FIELDS = ("max_staleness",)
# Flags only the sweep presets read; flags only the studies read.
SWEEP_FLAGS = ("size", "methods", "shapes", "staleness", "staleness_mode", "pretrain_rollouts",
               "method", "shape", "window", "recover_fraction")
STUDY_FLAGS = ("dataset_dir", "dataset_model", "workers")


@dataclasses.dataclass(frozen=True)
class SweepPreset:
    """One sweep: its default --out_dir, the sizes --size picks (flags set unless given), the
    SAOConfig fields its cells set, the sweep flags it reads, and `run(flag_values, run_fn)`,
    which raises ConfigError before any cell runs and runs each cell with run_fn(config)."""
    name: str
    out_dir: str
    sizes: Dict[str, Dict[str, object]]
    cell_fields: Tuple[str, ...]
    own_flags: Tuple[str, ...]
    run: Callable[[object, Callable[[SAOConfig], Dict]], None]


SWEEPS: Dict[str, SweepPreset] = {
    name: SweepPreset(name, module.OUT_DIR, module.SIZES, module.CELL_FIELDS, module.OWN_FLAGS,
                      module.run)
    for name, module in (("staleness_sweep", staleness),
                         ("value_pretrain_sweep", value_pretrain),
                         ("online_shift_sweep", online_shift))}


def refused_flags(sweep: Optional[SweepPreset], given: Collection[str]) -> List[str]:
    """The flags in `given` (those on the command line) that `sweep` (None: the studies) does
    not read, sorted."""
    if sweep is None:
        refused = set(SWEEP_FLAGS) | set(STUDY_CELL_FIELDS)
    else:
        refused = (set(STUDY_FLAGS) | (set(SWEEP_FLAGS) - set(sweep.own_flags) - {"size"})
                   | (set(sweep.cell_fields) - set(ALWAYS_CELL_FIELDS)))
    return sorted(refused & set(given))
