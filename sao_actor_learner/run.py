"""Running a program for a user: config.json, launch, a progress line, summary.json."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, Optional

from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.config.drift import knob_record
from sao_actor_learner.observers import read_metrics, write_json_atomic
from sao_actor_learner.preflight import check_before_launch
from sao_actor_learner.split_launch import RemoteTraining, runs_remote_learner


def phase(config: SAOConfig, train, evals, pretrain) -> str:
    """What the run is doing while no step is logged, or after the last one (what a slow start
    is spent on); "" while it trains. From the metrics rows alone."""
    evaluates = config.evaluator in ("node", "in_learner")
    evaluated = {r["policy_version"] for r in evals}
    if pretrain and not any(r.get("kind") == "value_pretrain_done" for r in pretrain):
        return "value pretraining"
    if not train:
        if evaluates and 0 not in evaluated:
            return (f"loading; initial evaluation of version 0 on {config.eval_size} problems; "
                    "actors generating the first batch")
        return f"actors generating the first batch ({config.batch_size} rollouts)"
    if train[-1]["step"] >= config.max_steps and evaluates and \
            config.max_steps not in evaluated:
        return f"final evaluation on {config.eval_size} problems"
    return ""


def _progress_line(config: SAOConfig, run_dir: str, t0: float) -> str:
    train = read_metrics(run_dir, "train")
    evals = read_metrics(run_dir, "eval")
    step = train[-1]["step"] if train else 0
    width = 30
    done = int(width * step / config.max_steps)
    line = f"[{'#' * done}{'.' * (width - done)}] step {step}/{config.max_steps}"
    pretrain = read_metrics(run_dir, "value_pretrain") + read_metrics(run_dir,
                                                                      "value_pretrain_done")
    doing = phase(config, train, evals, pretrain)
    if doing:
        line += f" ({doing})"
    if train:
        last = train[-1]
        line += (f" reward {last.get('reward_mean', 0):.2f} stale {last.get('staleness_mean', 0):.2f}"
                 f" kl {last.get('kl_rollout', 0):.4f} ev {last.get('explained_variance', 0):.2f}")
    if evals:
        line += f" eval@{evals[-1]['policy_version']} {evals[-1]['eval_accuracy']:.3f}"
    return line + f" {time.time() - t0:.0f}s"


def show(line: str, shown: int) -> int:
    """Writes `line` over the progress line on screen (`shown` characters long, blanked where
    the new one is shorter); returns its length."""
    sys.stdout.write("\r" + line.ljust(shown))
    sys.stdout.flush()
    return len(line)


def summarize(config: SAOConfig, run_dir: str, wall_time_s: float,
              preflight: Optional[Dict] = None) -> Dict:
    train = read_metrics(run_dir, "train")
    evals = {r["policy_version"]: r["eval_accuracy"] for r in read_metrics(run_dir, "eval")}
    actors = []
    for i in range(config.first_actor_id, config.first_actor_id + config.num_actors):
        p = os.path.join(run_dir, f"actor_{i}_stats.json")
        if os.path.exists(p):
            with open(p) as f:
                actors.append(json.load(f))
    rejected: Dict[str, int] = {}
    for a in actors:
        for k, v in a.get("rejected", {}).items():
            rejected[k] = rejected.get(k, 0) + v
    env_counters: Dict[str, float] = {}  # episodes, turns, tool calls and tool errors
    for a in actors:
        for k, v in a.get("env_counters", {}).items():
            env_counters[k] = env_counters.get(k, 0) + v

    def mean(key):
        vals = [r[key] for r in train if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None

    summary = {
        "task": config.task,
        "steps": train[-1]["step"] if train else 0,
        "wall_time_s": wall_time_s,
        "initial_eval_accuracy": evals.get(0),
        "final_eval_accuracy": evals.get(config.max_steps),
        "eval_accuracy_by_version": {str(k): v for k, v in sorted(evals.items())},
        "rollouts_trained": train[-1]["rollouts_trained"] if train else 0,
        "dropped_stale": train[-1]["dropped_stale"] if train else 0,
        "staleness_max": max((r["staleness_max"] for r in train), default=0),
        "staleness_mean": mean("staleness_mean"),
        "kl_rollout_mean": mean("kl_rollout"),
        "dis_masked_frac_mean": mean("dis_masked_frac"),
        "reward_first": train[0]["reward_mean"] if train else None,
        "reward_last": train[-1]["reward_mean"] if train else None,
        "samples_per_s_mean": mean("samples_per_s"),
        "learner_wait_frac_mean": mean("learner_wait_frac"),
        "rollouts_generated": sum(a.get("rollouts_generated", 0) for a in actors),
        "rollouts_inserted": sum(a.get("rollouts_inserted", 0) for a in actors),
        "rollouts_rejected": rejected,
        "env_counters": env_counters,
        "max_staleness": config.max_staleness,
        "restarts": _restarts(run_dir),   # node -> restarts, from nodes.json
        "drift_alarms": _drift_alarms(train),
        # the drift knobs (config/drift.py) and the lags the actors drew, by lag
        "drift_knobs": {**knob_record(config), "forced_lag_hist": _lag_hist(actors)},
    }
    weights = [r["reward_preference_weight"] for r in train if "reward_preference_weight" in r]
    if weights:   # task=preference_drift: the drifting reward's weight over the run
        summary["reward_preference_weight"] = {"first": weights[0], "last": weights[-1],
                                               "min": min(weights), "max": max(weights)}
    critic_evals = read_metrics(run_dir, "critic_eval")
    if critic_evals:   # the critic's EV on its fixed held-out rollouts (value_pretraining.py)
        summary["critic_heldout_ev_start"] = critic_evals[0]["critic_heldout_ev"]
        summary["critic_heldout_ev_end"] = critic_evals[-1]["critic_heldout_ev"]
        summary["critic_heldout_ev_by_version"] = {
            str(r["policy_version"]): r["critic_heldout_ev"] for r in critic_evals}
    pretrain = read_metrics(run_dir, "value_pretrain_done")
    if pretrain:
        summary["value_pretrain"] = {k: v for k, v in pretrain[-1].items() if k != "kind"}
    summary["critic_explained_variance_mean"] = mean("explained_variance")
    if preflight:
        summary["preflight"] = preflight   # e.g. dataset rows and over-long prompts left out
    if summary["initial_eval_accuracy"] is not None and summary["final_eval_accuracy"] is not None:
        summary["eval_accuracy_gain"] = summary["final_eval_accuracy"] - summary["initial_eval_accuracy"]
    return summary


def _drift_alarms(train) -> Dict[str, int]:
    """alarm name -> policy steps that raised it: the drift_alarm_<name> counters (cumulative,
    learner/drift.DriftAlarms) of the newest train row that has them; {} when alarms are off."""
    for row in reversed(train):
        found = {k[len("drift_alarm_"):]: int(v) for k, v in row.items()
                 if k.startswith("drift_alarm_")}
        if found:
            return found
    return {}


def _lag_hist(actors) -> list:
    """The forced staleness lags all actors drew, counted by lag (actor stats files)."""
    hist: list = []
    for a in actors:
        for lag, n in enumerate(a.get("forced_lag_hist", [])):
            hist.extend([0] * (lag + 1 - len(hist)))
            hist[lag] += n
    return hist


def _restarts(run_dir: str) -> Dict[str, int]:
    """node name -> how often the launcher restarted it (nodes which were, only)."""
    try:
        with open(os.path.join(run_dir, "nodes.json")) as f:
            nodes = json.load(f)["nodes"]
    except (OSError, ValueError, KeyError):
        return {}
    return {n["name"]: len(n["restart_history"]) for n in nodes if n.get("restart_history")}


def run_program(config: SAOConfig, make_program, progress: bool = True,
                terminal_groups=("learner", "evaluator"), env: Optional[Dict[str, str]] = None,
                on_launch=None) -> Dict:
    """Launches `make_program(config)` and returns (and writes) the run summary.

    on_launch: called with the running `Launched` once every node has started (e.g. a soak
    test's fault injector, which restarts nodes through it); it runs in this thread and may
    return at once (start a thread) or run until done.
    """
    from sao_actor_learner import launch as lp
    from sao_actor_learner.builder import launch_options, prepare_run_dir
    from sao_actor_learner.credentials import check_launch_security

    preflight = check_before_launch(config)
    check_launch_security(config)   # beyond loopback: the auth token and TLS (credentials.py)
    run_dir = config.run_dir
    os.makedirs(run_dir, exist_ok=True)
    prepare_run_dir(config, run_dir)   # a fresh run clears checkpoints, journal, spools
    metrics = os.path.join(run_dir, "metrics.jsonl")
    for part in (metrics, metrics + ".1"):   # and its rotated part (observers/metrics.py)
        if os.path.exists(part) and not config.resume:
            os.remove(part)  # a fresh run; --resume appends
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        f.write(config.to_json())
    node_env = {"OMP_NUM_THREADS": str(config.threads_per_process), "TF_CPP_MIN_LOG_LEVEL": "2",
                "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                **(env or {})}
    if config.launch == "local_mp" and config.reverb_without_tensorflow:
        from sao_actor_learner.replay.client import lite_env

        node_env = {**lite_env(), **node_env}   # set before each node's interpreter starts
    t0 = time.time()
    program = make_program(config)
    remote = RemoteTraining(config) if runs_remote_learner(config) else None   # split_launch.py
    launched = lp.launch(program, launch_type=config.launch, run_dir=run_dir,
                         terminal_groups=None if remote else terminal_groups, env=node_env,
                         **launch_options(config))   # restarts, bind host, Ray
    shown = 0   # the progress line's length on screen
    try:
        if on_launch is not None:
            on_launch(launched)
        while True:
            if launched.wait(timeout=2.0 if remote is None else 0.25):   # remote: its last
                break                                                       # report is brief
            if remote is not None and remote.finished():
                launched.stop()   # the actors of a launch without the learner: it is done
            if progress:
                shown = show(_progress_line(config, run_dir, t0), shown)
    finally:
        launched.stop()
        if remote is not None:
            remote.close()
    if progress:
        shown = show(_progress_line(config, run_dir, t0), shown)
        sys.stdout.write("\n")
    summary = summarize(config, run_dir, time.time() - t0, preflight)
    write_json_atomic(os.path.join(run_dir, "summary.json"), summary)
    return summary
