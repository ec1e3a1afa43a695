"""MLflow as a tracker (`--tracker=mlflow`, pip extra `[mlflow]`: mlflow-skinny).

Each process that writes metrics makes an MLflow run `<name>-<role>` (tags `sao.run`,
`sao.role`) in the experiment `--tracker_project`, at `--mlflow_tracking_uri` (else
$MLFLOW_TRACKING_URI, else a local file store in `<run_dir>/mlruns`). The run config goes in
as params (values cut at 500 characters) and whole as the artifact `config.json`; a row is one
`log_batch` of its metrics at the row's step. Only the client API is used (explicit run ids, no
global active run), so several runs live in one process (local_mt, the in-learner evaluator).

MLflow 3.x refuses the file store unless $MLFLOW_ALLOW_FILE_STORE is true (docs/FACTS.md); for
a file store URI it is set to true in this process when unset. `mlflow` is imported only here,
only when chosen.
"""
from __future__ import annotations

import json
import os
import pathlib
import time
import urllib.parse
from typing import Any, Mapping

from sao_actor_learner.observers.trackers import Tracker, TrackerSettings, metric_name

MAX_PARAM_CHARS = 500       # MLflow's smallest param-value limit (older servers)
PARAMS_PER_BATCH = 100      # MLflow's log_batch limit on params


def tracking_uri(settings: TrackerSettings) -> str:
    uri = settings.section.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri:
        return pathlib.Path(os.path.abspath(os.path.join(settings.run_dir, "mlruns"))).as_uri()
    return uri


def is_file_store(uri: str) -> bool:
    """A `file:` URI or a plain path (what MLflow opens as its file store)."""
    return urllib.parse.urlparse(uri).scheme in ("", "file") and uri != "databricks"


def _client(settings: TrackerSettings):
    uri = tracking_uri(settings)
    if is_file_store(uri):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=uri)


def experiment_id(client, name: str) -> str:
    """The id of experiment `name`, made when missing (another process may make it first)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # noqa: BLE001 - made meanwhile by another process: look it up again
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= MAX_PARAM_CHARS else text[:MAX_PARAM_CHARS - 3] + "..."


class MlflowTracker(Tracker):
    def __init__(self, settings: TrackerSettings, role: str):
        self._client = _client(settings)
        run = self._client.create_run(
            experiment_id(self._client, settings.section.tracker_project),
            run_name=f"{settings.run_name}-{role}",
            tags={"sao.run": settings.run_name, "sao.role": role,
                  "sao.run_dir": os.path.abspath(settings.run_dir)})
        self.run_id = run.info.run_id

    def log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        params = [Param(k, param_value(v)) for k, v in sorted(config.items())]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_BATCH])
        self._client.log_dict(self.run_id, dict(config), "config.json")

    def log_scalars(self, kind: str, scalars: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric
        now_ms = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[
            Metric(metric_name(kind, k), float(v), now_ms, int(step)) for k, v in scalars.items()])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def start(settings: TrackerSettings, role: str) -> Tracker:
    return MlflowTracker(settings, role)


def check_before_launch(settings: TrackerSettings) -> None:
    """The store opens and the experiment exists (made here when missing), so the nodes' runs
    can start; an unknown URI scheme or an unwritable store fails here, before launch."""
    experiment_id(_client(settings), settings.section.tracker_project)
