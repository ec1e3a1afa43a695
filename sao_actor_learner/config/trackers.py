"""The experiment trackers' section: which trackers get the metrics rows and where they log.

Standard library only, like the other sections (the launcher validates configs without
importing a tracker's package; preflight imports it, observers/trackers.py uses it).
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

from sao_actor_learner.config.sections import Fail, Section, option

# The trackers observers/trackers.py knows (TRACKER_KINDS there has their packages and extras).
TRACKERS = ("tensorboard", "wandb", "mlflow")
WANDB_MODES = ("online", "offline", "disabled")


@dataclasses.dataclass(frozen=True)
class TrackerConfig(Section):
    """Experiment trackers: every metrics row (train, eval, ...) also goes to each of them."""
    tracker: Tuple[str, ...] = option(
        ("tensorboard",), "Experiment trackers that get every metrics row as <kind>/<column> "
        "(the metrics.jsonl names, e.g. train/reward_mean, eval/eval_accuracy) and the run "
        "config, several at once: tensorboard (<run_dir>/tb), wandb (pip extra [wandb]), "
        "mlflow (pip extra [mlflow]); empty: metrics.jsonl only.")
    tracker_project: str = option("sao-actor-learner", "The W&B project and the MLflow "
                                  "experiment that the run's trackers log to.")
    tracker_run_name: str = option("", "The run's name in W&B and MLflow (each process that "
                                   "writes metrics logs a run <name>-<role>, e.g. -learner, "
                                   "-evaluator, grouped under <name>); empty: run_dir's last "
                                   "folder.")
    mlflow_tracking_uri: str = option("", "tracker mlflow: where runs go (a file: path, "
                                      "sqlite:///..., http://server); empty: "
                                      "$MLFLOW_TRACKING_URI, else a local file store in "
                                      "<run_dir>/mlruns.")
    wandb_mode: str = option("", "tracker wandb: online, offline (files in <run_dir>/wandb, no "
                             "network; `wandb sync` uploads them later) or disabled; empty: "
                             "$WANDB_MODE, else online.")

    def check(self, fail: Fail) -> None:
        for name in self.tracker:
            if name not in TRACKERS:
                fail(f"tracker contains {name!r}: must name trackers from "
                     f"{', '.join(TRACKERS)} (comma-separated; empty for metrics.jsonl only)")
        if len(set(self.tracker)) != len(self.tracker):
            fail(f"tracker={','.join(self.tracker)} names a tracker twice; name each once")
        if self.wandb_mode and self.wandb_mode not in WANDB_MODES:
            fail(f"wandb_mode={self.wandb_mode!r}: must be one of {', '.join(WANDB_MODES)} or "
                 "empty ($WANDB_MODE, else online)")
        if not self.tracker_project.strip():
            fail("tracker_project is empty: name the W&B project / MLflow experiment")
