"""Weights & Biases as a tracker (`--tracker=wandb`, pip extra `[wandb]`).

Each process that writes metrics starts a W&B run `<name>-<role>` in group `<name>` (job type:
the role) under `--tracker_project`, with the run config as the W&B config and its files in
`<run_dir>/wandb/`. `--wandb_mode` (else $WANDB_MODE, else online) picks online, offline (no
network; `wandb sync <run_dir>/wandb/offline-run-*` uploads later) or disabled. Rows of each kind
are logged against their own x-axis `<kind>/step` (W&B's `define_metric`): the kinds' steps are
not one sequence (critic warm-up rows all sit at version 0, eval rows come from another
process), and W&B drops rows whose explicit step goes back. Console capture is off (each node
has its own log). `wandb` is imported only here, only when chosen.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from sao_actor_learner.config import ConfigError
from sao_actor_learner.observers.trackers import Tracker, TrackerSettings, metric_name


def resolved_mode(settings: TrackerSettings) -> str:
    return settings.section.wandb_mode or os.environ.get("WANDB_MODE", "") or "online"


class WandbTracker(Tracker):
    def __init__(self, settings: TrackerSettings, role: str):
        import wandb

        directory = os.path.abspath(settings.run_dir)
        os.makedirs(directory, exist_ok=True)
        self._run = wandb.init(
            project=settings.section.tracker_project, group=settings.run_name,
            name=f"{settings.run_name}-{role}", job_type=role, dir=directory,
            mode=resolved_mode(settings), reinit="create_new",
            settings=wandb.Settings(console="off"))
        self._kinds = set()

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def log_scalars(self, kind: str, scalars: Mapping[str, float], step: int) -> None:
        axis = metric_name(kind, "step")
        if kind not in self._kinds:
            self._run.define_metric(axis)
            self._run.define_metric(metric_name(kind, "*"), step_metric=axis)
            self._kinds.add(kind)
        self._run.log({axis: step, **{metric_name(kind, k): v for k, v in scalars.items()}})

    def close(self) -> None:
        self._run.finish()


def start(settings: TrackerSettings, role: str) -> Tracker:
    return WandbTracker(settings, role)


def check_before_launch(settings: TrackerSettings) -> None:
    """Online mode needs an API key (`wandb login` or $WANDB_API_KEY): without one every node's
    wandb.init would fail, so it is a config error here. Offline and disabled need nothing."""
    mode = resolved_mode(settings)
    if mode not in ("online", "offline", "disabled"):
        raise ConfigError(f"W&B mode {mode!r} (from $WANDB_MODE): must be online, offline or "
                          "disabled; set --wandb_mode")
    if mode != "online":
        return
    try:   # wandb's own lookup (session, $WANDB_API_KEY, ~/.netrc); internal, so guarded
        from wandb.sdk.internal.internal_api import Api
        key = Api().api_key
    except Exception:  # noqa: BLE001 - another wandb version: leave the check to wandb.init
        return
    if not key:
        raise ConfigError("--tracker=wandb in online mode needs a W&B API key: run `wandb "
                          "login` or set $WANDB_API_KEY, or log without network with "
                          "--wandb_mode=offline (then `wandb sync`)")
