"""Experiment trackers (observers/trackers.py): TensorBoard, W&B (offline, no network) and
MLflow (a local file store) get every metrics row under the metrics.jsonl names and the run
config; several at once; one that raises never stops the metrics writer; a missing package or a
tracker that cannot start is a config error before launch that says what to do."""
import dataclasses
import glob
import json
import logging
import math
import os
import sys

import pytest

from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.observers import MetricsLogger, read_metrics
from sao_actor_learner.observers.trackers import (Tracker, TrackerFeed, check_trackers,
                                                  make_metrics_logger, make_tracker_feeds)
from sao_actor_learner.preflight import check_before_launch


@pytest.fixture(autouse=True)
def offline_trackers(monkeypatch, tmp_path):
    """No tracker reaches the network, and none writes outside tmp_path."""
    home = tmp_path / "home"
    home.mkdir()
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))   # no ~/.netrc W&B key, no ~/.config/wandb
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")   # no Sentry reports
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")


def config_for(tmp_path, **fields):
    return SAOConfig(run_dir=str(tmp_path / "run"), **fields)


# Rows as the learner and evaluator write them: the step is `step`, else `policy_version`;
# lists, bools, strings and non-finite numbers are not scalars.
ROWS = [
    {"kind": "critic_warmup", "policy_version": 0, "critic_warmup_step": 1, "value_loss": 0.75},
    {"kind": "critic_warmup", "policy_version": 0, "critic_warmup_step": 2, "value_loss": 0.5},
    {"kind": "eval", "step": 0, "policy_version": 0, "eval_accuracy": 0.25, "eval_size": 4},
    {"kind": "train", "step": 1, "policy_version": 1, "reward_mean": 0.125, "kl_rollout": 1e-3,
     "staleness_hist": [1, 2], "admission_control": True, "note": "x", "grad_norm": math.nan},
    {"kind": "train", "step": 2, "policy_version": 2, "reward_mean": 0.5, "kl_rollout": 2e-3,
     "staleness_hist": [3, 0], "admission_control": True, "note": "y", "grad_norm": 1.5},
    {"kind": "eval", "step": 2, "policy_version": 2, "eval_accuracy": 0.75, "eval_size": 4},
]


def expected_points(run_dir):
    """{tracker name: [(step, value)...]} derived from metrics.jsonl by the obvious rule."""
    points = {}
    for row in read_metrics(run_dir):
        step = row.get("step", row.get("policy_version"))
        for column, value in row.items():
            if column in ("kind", "time", "step") or isinstance(value, (bool, str, list)):
                continue
            points.setdefault(f"{row['kind']}/{column}", []).append((step, value))
    return points


def write_rows(logger):
    for row in ROWS:
        logger.write(dict(row))
    logger.close()


# --- config and preflight ------------------------------------------------------------------
def test_tracker_flag_is_a_list_and_unknown_or_repeated_names_are_config_errors(tmp_path):
    from absl import flags

    from sao_actor_learner.flags import config_from_flags, define_flags_from_dataclass
    values = flags.FlagValues()
    define_flags_from_dataclass(SAOConfig, flag_values=values)
    values(["sao", "--tracker=tensorboard,wandb,mlflow", f"--run_dir={tmp_path}"])
    assert config_from_flags(SAOConfig, values).tracker == ("tensorboard", "wandb", "mlflow")
    assert SAOConfig().tracker == ("tensorboard",)   # today's behaviour by default
    with pytest.raises(ConfigError, match="'neptune': must name trackers from tensorboard, "
                                          "wandb, mlflow"):
        config_for(tmp_path, tracker=("neptune",))
    with pytest.raises(ConfigError, match="names a tracker twice"):
        config_for(tmp_path, tracker=("mlflow", "mlflow"))
    with pytest.raises(ConfigError, match="wandb_mode='cloud'"):
        config_for(tmp_path, wandb_mode="cloud")


@pytest.mark.parametrize("name, package, install", [
    ("wandb", "wandb", "pip install -e '.[wandb]'"),
    ("mlflow", "mlflow", "pip install -e '.[mlflow]'"),
    ("tensorboard", "tensorboard", "pip install 'tensorboard<2.16'"),
])
def test_a_tracker_that_is_not_installed_fails_before_launch_naming_the_extra(
        tmp_path, monkeypatch, name, package, install):
    monkeypatch.setitem(sys.modules, package, None)   # `import package` raises ImportError
    config = config_for(tmp_path, tracker=("tensorboard", name) if name != "tensorboard"
                        else (name,), wandb_mode="offline")
    with pytest.raises(ConfigError) as error:
        check_before_launch(config)
    assert f"--tracker={name}" in str(error.value)
    assert f"install it with `{install}`" in str(error.value)
    assert not os.path.exists(config.run_dir)


def test_a_tracker_that_cannot_start_fails_before_launch(tmp_path):
    with pytest.raises(ConfigError, match="wandb in online mode needs a W&B API key.*"
                                          "--wandb_mode=offline"):
        check_trackers(config_for(tmp_path, tracker=("wandb",)))   # no key anywhere (fixture)
    with pytest.raises(ConfigError, match="--tracker=mlflow fails to start"):
        check_trackers(config_for(tmp_path, tracker=("mlflow",),
                                  mlflow_tracking_uri="nosuchstore://nowhere"))
    check_trackers(config_for(tmp_path, tracker=("wandb", "mlflow"), wandb_mode="offline"))


# --- each tracker gets the JSONL's names, steps and values, and the config --------------------
def test_mlflow_local_file_store_holds_the_jsonl_metrics_and_the_config(tmp_path):
    from mlflow.tracking import MlflowClient
    config = config_for(tmp_path, tracker=("mlflow",), tracker_run_name="exp1", seed=7)
    write_rows(make_metrics_logger(config, None, "learner"))
    expected = expected_points(config.run_dir)
    assert "train/reward_mean" in expected and "train/note" not in expected

    store = "file://" + os.path.abspath(os.path.join(config.run_dir, "mlruns"))
    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("sao-actor-learner")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "exp1-learner" and run.info.status == "FINISHED"
    assert run.data.tags["sao.role"] == "learner" and run.data.tags["sao.run"] == "exp1"
    assert set(run.data.metrics) == set(expected)
    for name, points in expected.items():
        history = client.get_metric_history(run.info.run_id, name)
        assert [(m.step, m.value) for m in history] == points, name
    params = run.data.params
    assert set(params) == {f.name for f in dataclasses.fields(SAOConfig)}
    assert params["seed"] == "7" and json.loads(params["tracker"]) == ["mlflow"]
    logged = json.load(open(os.path.join(
        client.download_artifacts(run.info.run_id, "config.json", str(tmp_path)))))
    assert logged == json.loads(config.to_json())


def read_wandb_run(path):
    """(run record, config {key: value}, history rows) of an offline run's .wandb file."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore
    store = datastore.DataStore()
    store.open_for_scan(path)
    run, config, history = None, {}, []
    while (data := store.scan_data()) is not None:
        record = pb.Record()
        record.ParseFromString(data)
        which = record.WhichOneof("record_type")
        if which == "run":
            run = record.run
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif which == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif which == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                            for i in record.history.item})
    return run, config, history


def test_wandb_offline_run_holds_the_jsonl_metrics_and_the_config(tmp_path):
    config = config_for(tmp_path, tracker=("wandb",), wandb_mode="offline",
                        tracker_run_name="exp2")
    write_rows(make_metrics_logger(config, None, "evaluator"))
    import wandb
    wandb.teardown()   # finish() returns before wandb-core has written the whole file
    (path,) = glob.glob(os.path.join(config.run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    run, logged_config, history = read_wandb_run(path)
    assert (run.display_name, run.run_group, run.job_type, run.project) == (
        "exp2-evaluator", "exp2", "evaluator", "sao-actor-learner")
    logged_config.pop("_wandb", None)
    assert logged_config == json.loads(config.to_json())
    points = {}
    for row in history:   # each row: one metrics row, its x-axis <kind>/step
        (axis,) = [k for k in row if k.endswith("/step")]
        for name, value in row.items():
            if not name.startswith("_") and name != axis:
                points.setdefault(name, []).append((row[axis], value))
    assert points == expected_points(config.run_dir)


# --- several at once; failures never stop the writer ------------------------------------------
class RaisingTracker(Tracker):
    def __init__(self):
        self.calls = 0
        self.closed = False

    def log_config(self, config):
        pass

    def log_scalars(self, kind, scalars, step):
        self.calls += 1
        raise RuntimeError("tracker server unreachable")

    def close(self):
        self.closed = True


def test_several_trackers_at_once_and_a_failing_one_never_stops_the_writer(tmp_path, caplog):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    config = config_for(tmp_path, tracker=("tensorboard", "mlflow", "wandb"),
                        wandb_mode="offline")
    raising = RaisingTracker()
    raising_feed = TrackerFeed("raising", lambda: raising)
    never_starts = TrackerFeed("never_starts", lambda: 1 / 0)
    feeds = make_tracker_feeds(config, None, "learner")
    logger = MetricsLogger(config.run_dir, "learner",
                           trackers=[raising_feed, never_starts] + feeds)
    caplog.set_level(logging.WARNING)
    rows = ROWS * 5   # 30 rows: failures 1, 10 and 30 of the raising tracker
    for row in rows:
        logger.write(dict(row))
    logger.close()

    assert len(read_metrics(config.run_dir)) == len(rows)      # the writer went on
    assert raising.calls == raising_feed.failures == len(rows) and raising.closed
    assert never_starts.failures == 1 and never_starts.dropped == len(rows)
    assert all(f.failures == f.dropped == 0 and f.logged == len(rows) for f in feeds)
    warnings = [r.getMessage() for r in caplog.records if "tracker raising" in r.getMessage()]
    assert len(warnings) == 3 and "1 failures so far" in warnings[0] and \
        "10 failures so far" in warnings[1], warnings   # rate-limited: 1st, 10th, (100th)
    assert "RuntimeError: tracker server unreachable" in warnings[0]
    assert warnings[2] == "tracker raising: 0 rows logged, 30 failures, 0 rows dropped"

    expected = expected_points(config.run_dir)
    events = EventAccumulator(os.path.join(config.run_dir, "tb", "learner"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(expected)
    (config_text,) = events.Tensors("config/text_summary")   # the config, once
    assert json.loads(config_text.tensor_proto.string_val[0].decode()) == json.loads(
        config.to_json())
    for name, points in expected.items():
        scalars = events.Scalars(name)
        assert [e.step for e in scalars] == [step for step, _ in points], name
        assert [e.value for e in scalars] == pytest.approx([v for _, v in points]), name
    client = MlflowClient(tracking_uri="file://" + os.path.join(config.run_dir, "mlruns"))
    (run,) = client.search_runs([client.get_experiment_by_name(
        config.tracker_project).experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(
        run.info.run_id, "eval/eval_accuracy")] == expected["eval/eval_accuracy"]
    assert glob.glob(os.path.join(config.run_dir, "wandb", "offline-run-*", "run-*.wandb"))


def test_no_trackers_writes_metrics_jsonl_only(tmp_path):
    config = config_for(tmp_path, tracker=())
    write_rows(make_metrics_logger(config, None, "learner"))
    assert len(read_metrics(config.run_dir)) == len(ROWS)
    assert sorted(os.listdir(config.run_dir)) == ["metrics.jsonl"]


# --- a whole program -----------------------------------------------------------------------
def test_a_program_logs_its_train_and_heldout_curves_to_mlflow_and_tensorboard(warm_start,
                                                                             tmp_path):
    from mlflow.tracking import MlflowClient

    from sao_actor_learner.builder import make_program
    from sao_actor_learner.run import run_program
    config = SAOConfig(init_checkpoint=warm_start, run_dir=str(tmp_path / "run"), max_steps=2,
                       batch_size=8, num_actors=1, actor_batch=4, eval_every=0, eval_size=20,
                       launch="local_mt", tracker=("tensorboard", "mlflow"))
    run_program(config, make_program, progress=False)
    expected = expected_points(config.run_dir)
    client = MlflowClient(tracking_uri="file://" + os.path.join(config.run_dir, "mlruns"))
    runs = client.search_runs([client.get_experiment_by_name(
        config.tracker_project).experiment_id])
    by_role = {r.data.tags["sao.role"]: r for r in runs}
    assert sorted(by_role) == ["evaluator", "learner"]
    assert all(r.info.status == "FINISHED" for r in runs)
    learner, evaluator = by_role["learner"], by_role["evaluator"]
    assert [(m.step, m.value) for m in client.get_metric_history(
        learner.info.run_id, "train/reward_mean")] == expected["train/reward_mean"]
    assert [(m.step, m.value) for m in client.get_metric_history(
        evaluator.info.run_id, "eval/eval_accuracy")] == expected["eval/eval_accuracy"]
    assert [s for s, _ in expected["eval/eval_accuracy"]] == [0, 2]   # the held-out curve
    assert learner.data.params["max_steps"] == "2"
    assert sorted(os.listdir(os.path.join(config.run_dir, "tb"))) == ["evaluator", "learner"]
