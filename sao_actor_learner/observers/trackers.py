"""Experiment trackers: TensorBoard, Weights & Biases, MLflow, fed from the metrics rows.

Every process that writes metrics rows (the learner's rank 0; the evaluator, as a node or in the
learner's process) has a `MetricsLogger`; it appends each row to metrics.jsonl, then hands the
row's numbers to each tracker of `--tracker` as `<kind>/<column>` (the JSONL's names:
`train/reward_mean`, `eval/eval_accuracy`) at the row's step (its `step`, else its
`policy_version`). Each tracker logs the run config (the whole `SAOConfig`) once, when it
starts. W&B and MLflow get one run per process and role (`<name>-learner`, `<name>-evaluator`),
grouped under the run's name (`--tracker_run_name`, default run_dir's last folder): separate
processes cannot share a W&B run. TensorBoard writes `<run_dir>/tb/<role>/`.

A tracker never stops training: each runs behind a `TrackerFeed`, a thread of its own that
starts the tracker, logs the config, then the rows queued for it. An exception from the
tracker (at start or on a row) is counted and logged (the 1st, 10th, 100th... failure: rate
limited), a row that finds the queue full is dropped and counted, and a tracker that hangs
holds up only its own thread. Before launch (`check_trackers`, run by preflight) each chosen
tracker's package must import (else a ConfigError naming the pip extra) and the tracker must be
able to start (MLflow: its store opens and the experiment exists or is made; W&B online: an API
key is configured).

Tracker packages are imported only when chosen (tensorboard's through torch, in the process
that writes). docs/DESIGN.md, "Experiment trackers".
"""
from __future__ import annotations

import abc
import dataclasses
import importlib
import json
import os
import queue
import sys
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from absl import logging

from sao_actor_learner.config import ConfigError, TrackerConfig

# Columns of a metrics row that are not scalars of it: the x-axis and the wall clock.
NOT_SCALARS = ("kind", "time", "step")


class Tracker(abc.ABC):
    """An experiment tracker for one process and role. Calls come from one thread."""

    @abc.abstractmethod
    def log_config(self, config: Mapping[str, Any]) -> None:
        """Records the run config (once, right after the tracker starts)."""

    @abc.abstractmethod
    def log_scalars(self, kind: str, scalars: Mapping[str, float], step: int) -> None:
        """Records `scalars` (metrics.jsonl column -> value) of a row of `kind` at `step`, each
        under the name `metric_name(kind, column)`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flushes and ends the tracker's run."""


def metric_name(kind: str, column: str) -> str:
    """A tracker's name for a metrics.jsonl column of rows of `kind`: `train/reward_mean`."""
    return f"{kind}/{column}"


def row_scalars(row: Mapping[str, Any]) -> Tuple[str, Dict[str, float], int]:
    """(kind, {column: number}, step) of a metrics row: the numeric columns (not bool, not the
    step or time) and the row's step (its `step`, else its `policy_version`, else 0)."""
    scalars = {k: v for k, v in row.items() if k not in NOT_SCALARS and
               isinstance(v, (int, float)) and not isinstance(v, bool)}
    step = row.get("step", row.get("policy_version", 0))
    return str(row.get("kind", "")), scalars, int(step) if isinstance(step, (int, float)) else 0


@dataclasses.dataclass(frozen=True)
class TrackerKind:
    """A tracker of `--tracker`: its importable package, the pip command that installs it, how
    it starts in a process (`start(settings, role)`) and what is checked before launch."""
    name: str
    package: str
    install: str
    start: Callable[["TrackerSettings", str], Tracker]
    check_before_launch: Callable[["TrackerSettings"], None]


@dataclasses.dataclass(frozen=True)
class TrackerSettings:
    """What a tracker needs to start: its config section, the run folder, the run config."""
    section: TrackerConfig
    run_dir: str
    run_config: Mapping[str, Any]

    @property
    def run_name(self) -> str:
        return (self.section.tracker_run_name or
                os.path.basename(os.path.normpath(os.path.abspath(self.run_dir))))


def tracker_settings(config, run_dir: Optional[str] = None) -> TrackerSettings:
    """The TrackerSettings of an SAOConfig (run_dir: the run folder, default config.run_dir)."""
    return TrackerSettings(config.section(TrackerConfig), run_dir or config.run_dir,
                           dataclasses.asdict(config))


# --- TensorBoard -----------------------------------------------------------------------------
class TensorBoardTracker(Tracker):
    """TensorBoard events in `<run_dir>/tb/<role>/` (observers/tensorboard.py: without loading
    TensorFlow in processes that have not)."""

    def __init__(self, log_dir: str):
        from sao_actor_learner.observers.tensorboard import SummaryWriter
        self._writer = SummaryWriter(log_dir)

    def log_config(self, config: Mapping[str, Any]) -> None:
        text = json.dumps(dict(config), indent=2, sort_keys=True, default=str)
        self._writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)
        self._writer.flush()

    def log_scalars(self, kind: str, scalars: Mapping[str, float], step: int) -> None:
        for column, value in scalars.items():
            self._writer.add_scalar(metric_name(kind, column), value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _start_tensorboard(settings: TrackerSettings, role: str) -> Tracker:
    return TensorBoardTracker(os.path.join(settings.run_dir, "tb", role))


def _check_tensorboard(settings: TrackerSettings) -> None:
    """Nothing to start before launch: the events go to a folder of the run."""


def _tracker_kinds() -> Dict[str, TrackerKind]:
    from sao_actor_learner.observers import mlflow_tracker, wandb_tracker
    return {
        # TensorBoard comes with TensorFlow (dm-reverb[tensorflow]); no extra of ours.
        "tensorboard": TrackerKind("tensorboard", "tensorboard", "pip install 'tensorboard<2.16'",
                                   _start_tensorboard, _check_tensorboard),
        "wandb": TrackerKind("wandb", "wandb", "pip install -e '.[wandb]'",
                             wandb_tracker.start, wandb_tracker.check_before_launch),
        "mlflow": TrackerKind("mlflow", "mlflow", "pip install -e '.[mlflow]'",
                              mlflow_tracker.start, mlflow_tracker.check_before_launch),
    }


def tracker_kind(name: str) -> TrackerKind:
    kinds = _tracker_kinds()
    if name not in kinds:
        raise ConfigError(f"tracker {name!r}: must be one of {', '.join(kinds)}")
    return kinds[name]


def import_tracker_package(kind: TrackerKind):
    """The tracker's package, imported; a ConfigError naming what to install when it is
    missing (the pip extra of this package, e.g. `.[wandb]`)."""
    try:
        return importlib.import_module(kind.package)
    except ImportError as e:
        raise ConfigError(
            f"--tracker={kind.name}: the {kind.package!r} package is not installed ({e}); "
            f"install it with `{kind.install}` (in the environment of {sys.executable}), or "
            f"drop {kind.name} from --tracker") from None


def check_trackers(config) -> None:
    """Before launch: every chosen tracker's package imports and the tracker can start
    (ConfigError naming what to change otherwise)."""
    settings = tracker_settings(config)
    for name in config.tracker:
        kind = tracker_kind(name)
        import_tracker_package(kind)
        try:
            kind.check_before_launch(settings)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to start is a config error here
            raise ConfigError(f"--tracker={name} fails to start: {type(e).__name__}: {e}") \
                from None


# --- feeding trackers without stopping training ----------------------------------------------
class TrackerFeed:
    """One tracker behind a queue and a thread of its own (see the module docstring).

    start: makes the tracker (called in the feed's thread). config: logged once after it starts.
    capacity: queued rows at most; more are dropped (and counted) while the tracker is behind.
    """

    def __init__(self, name: str, start: Callable[[], Tracker],
                 config: Optional[Mapping[str, Any]] = None, capacity: int = 10_000):
        self.name = name
        self.failures = 0       # exceptions raised by the tracker (start, config, rows, close)
        self.dropped = 0        # rows not logged: the queue was full, or the tracker never started
        self.logged = 0         # rows the tracker took without raising
        self._start = start
        self._config = config
        self._queue: "queue.Queue" = queue.Queue(maxsize=capacity)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"tracker-{name}", daemon=True)
        self._thread.start()

    def log_scalars(self, kind: str, scalars: Mapping[str, float], step: int) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait((kind, dict(scalars), step))
        except queue.Full:
            self.dropped += 1

    def close(self, timeout_s: float = 60.0) -> None:
        """Logs what is queued, ends the tracker's run, and waits for it (at most timeout_s)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logging.warning("tracker %s: still busy after %.0f s at close; leaving it",
                            self.name, timeout_s)
        log = logging.warning if self.failures or self.dropped else logging.info
        log("tracker %s: %d rows logged, %d failures, %d rows dropped", self.name, self.logged,
            self.failures, self.dropped)

    def _failed(self, what: str, error: BaseException) -> None:
        self.failures += 1
        n = self.failures
        if n == 1 or len(str(n)) != len(str(n - 1)):   # the 1st, 10th, 100th...
            logging.warning("tracker %s: %s failed (%d failures so far; training goes on): "
                            "%s: %s", self.name, what, n, type(error).__name__, error)

    def _run(self) -> None:
        try:
            tracker = self._start()
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            tracker = None
            self._failed("start", e)
        if tracker is not None and self._config is not None:
            try:
                tracker.log_config(self._config)
            except Exception as e:  # noqa: BLE001
                self._failed("logging the config", e)
        while True:
            item = self._queue.get()
            if item is None:
                break
            if tracker is None:
                self.dropped += 1
                continue
            try:
                tracker.log_scalars(*item)
                self.logged += 1
            except Exception as e:  # noqa: BLE001
                self._failed(f"logging {item[0]} step {item[2]}", e)
        if tracker is not None:
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001
                self._failed("close", e)


def make_tracker_feeds(config, run_dir: Optional[str], role: str) -> List[TrackerFeed]:
    """The feeds of `config.tracker` for a process writing metrics as `role` (learner,
    evaluator); each tracker starts in its feed's thread."""
    settings = tracker_settings(config, run_dir)
    feeds = []
    for name in config.tracker:
        kind = tracker_kind(name)
        feeds.append(TrackerFeed(name, lambda kind=kind: kind.start(settings, role),
                                 config=settings.run_config))
    return feeds


def make_metrics_logger(config, run_dir: Optional[str], role: str):
    """The MetricsLogger of a process writing metrics as `role`, feeding `config.tracker`."""
    from sao_actor_learner.observers.metrics import MetricsLogger
    run_dir = run_dir or config.run_dir
    return MetricsLogger(run_dir, role, trackers=make_tracker_feeds(config, run_dir, role))
