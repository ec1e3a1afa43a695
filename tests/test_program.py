"""The whole program: real processes, a real Reverb server, real gRPC, a real (tiny) model."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sao_actor_learner.builder import make_program
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.observers import read_metrics
from sao_actor_learner.run import run_program

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED_KEYS = ("step", "policy_version", "reward_mean", "staleness_mean", "staleness_max",
                 "dis_masked_frac", "kl_rollout", "value_loss", "explained_variance",
                 "samples_per_s", "learner_wait_frac", "queue_size", "dropped_stale")


def small_config(warm_start, run_dir, **overrides):
    base = dict(init_checkpoint=warm_start, run_dir=str(run_dir), max_steps=6, batch_size=8,
                num_actors=2, actor_batch=4, max_staleness=1, eval_every=3, eval_size=50,
                launch="local_mp")
    base.update(overrides)
    return SAOConfig(**base)


def check_run(config, summary):
    train = read_metrics(config.run_dir, "train")
    assert [r["step"] for r in train] == list(range(1, config.max_steps + 1))
    for row in train:
        for key in REQUIRED_KEYS:
            assert key in row, f"metrics.jsonl row lacks {key}"
        # The bound: nothing staler than max_staleness is ever trained on.
        assert row["staleness_max"] <= config.max_staleness
        assert sum(row["staleness_hist"]) == row["batch_size"] == config.batch_size
    assert summary["steps"] == config.max_steps
    assert summary["rollouts_trained"] == config.max_steps * config.batch_size
    assert summary["initial_eval_accuracy"] is not None
    assert summary["final_eval_accuracy"] is not None
    with open(os.path.join(config.run_dir, "summary.json")) as f:
        assert json.load(f) == summary
    with open(os.path.join(config.run_dir, "config.json")) as f:
        assert SAOConfig.from_json(f.read()) == config
    return train


def test_local_mp_run_with_admission_control(warm_start, tmp_path):
    config = small_config(warm_start, tmp_path / "run")
    summary = run_program(config, make_program, progress=False)
    check_run(config, summary)
    with open(os.path.join(config.run_dir, "nodes.json")) as f:
        nodes = json.load(f)["nodes"]
    pids = {n["pid"] for n in nodes}
    assert len(pids) == len(nodes) == 3 + config.num_actors + 1 and os.getpid() not in pids
    assert all(n["status"] == "finished" for n in nodes)
    assert summary["rollouts_inserted"] >= summary["rollouts_trained"]
    assert os.listdir(os.path.join(config.run_dir, "tb"))
    assert os.path.exists(os.path.join(config.run_dir, "checkpoints", "step_000006", "config.json"))
    # Actors on the learner's host map versions from shared memory: the first load of any actor
    # happens while the learner waits for rollouts, so its file is there. (An actor that starts
    # after the learner finished finds the directory gone and fetches over gRPC.)
    transports = []
    for i in range(config.num_actors):
        with open(os.path.join(config.run_dir, f"actor_{i}_stats.json")) as f:
            transports.append(json.load(f)["weight_transport_counters"])
    assert sum(t.get("shm_loads", 0) for t in transports) >= 1, transports


def test_staleness_limit_drops_and_counts_without_admission_control(warm_start, tmp_path):
    # Without admission control actors race ahead and fill the queue with version-0 rollouts:
    # once the learner moves on they are too stale for max_staleness=0 and must be dropped.
    config = small_config(warm_start, tmp_path / "run", max_staleness=0, admission_control=False,
                          queue_capacity=32, actor_batch=8, max_steps=4, eval_every=0)
    summary = run_program(config, make_program, progress=False)
    train = check_run(config, summary)
    assert summary["dropped_stale"] > 0
    assert train[-1]["dropped_stale"] == summary["dropped_stale"]
    assert all(r["staleness_max"] == 0 for r in train)


def test_local_mt_runs_the_same_program_in_threads(warm_start, tmp_path):
    config = small_config(warm_start, tmp_path / "run", launch="local_mt", max_steps=3,
                          eval_every=0)
    summary = run_program(config, make_program, progress=False)
    check_run(config, summary)


@pytest.mark.parametrize("flag, message", [
    ("--max_staleness=-1", "max_staleness=-1: must be >= 0"),
    ("--queue_capacity=4", "deadlock"),
    ("--eps_low=1.5", "eps_low=1.5"),
    ("--launch=cluster", "launch='cluster'"),
    ("--weight_sync_mode=pause", "weight_sync_mode='pause'"),
    ("--weight_transport=tcp", "weight_transport='tcp': must be one of auto, grpc, shm"),
    ("--vllm_weight_sync_mode=abort", "--vllm_weight_sync_mode was renamed --weight_sync_mode"),
])
def test_invalid_config_fails_before_launch(tmp_path, flag, message):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "programs", "sao.py"), flag,
                           f"--run_dir={run_dir}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
    assert not run_dir.exists()  # nothing was launched or written


def test_missing_checkpoint_fails_before_launch(tmp_path):
    config = SAOConfig(init_checkpoint=str(tmp_path / "nothing"), run_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="make warm-start"):
        run_program(config, make_program, progress=False)
    assert not (tmp_path / "run").exists()


def test_bad_rollouts_are_rejected_counted_and_do_not_reach_the_learner(warm_start, tmp_path):
    from program_fixtures import make_program_with_corrupting_actors

    config = small_config(warm_start, tmp_path / "run", max_steps=4, eval_every=0)
    summary = run_program(config, make_program_with_corrupting_actors, progress=False)
    train = check_run(config, summary)
    rejected = summary["rollouts_rejected"]
    assert rejected.get("nonfinite_logp", 0) > 0 and rejected.get("token_out_of_range", 0) > 0
    for row in train:
        assert np.isfinite([row["policy_loss"], row["value_loss"], row["kl_rollout"]]).all()


def test_items_forged_into_a_running_program_are_refused_counted_and_never_trained(warm_start,
                                                                                    tmp_path):
    """Anyone who reaches the replay port can insert items. Actor 0 inserts rollouts signed
    with another secret, unsigned ones, ones signed with its own key but claiming actor 1 (an
    actor holds its own key only) and raw non-rollouts into the running program's table
    before its first real rollout (one actor: all of them are ahead of every real item in the
    FIFO). The learner's reader refuses each with its reason, the learner trains only the
    actor's real keys, and the run finishes."""
    from program_fixtures import FORGERIES, FORGERY_REASONS, make_program_with_forging_actor

    config = small_config(warm_start, tmp_path / "run", num_actors=1, max_steps=3,
                          eval_every=0)
    summary = run_program(config, make_program_with_forging_actor, progress=False)
    train = check_run(config, summary)
    expected = {}
    for kind, n in FORGERIES.items():
        expected[FORGERY_REASONS[kind]] = expected.get(FORGERY_REASONS[kind], 0) + n
    # All forgeries precede the first real rollout, so the first step has read all of them.
    for row in train:
        refused = {k[len("refused_"):]: v for k, v in row.items()
                   if k.startswith("refused_") and k != "refused_total" and v}
        assert refused == expected, row
        assert row["refused_total"] == sum(FORGERIES.values())
    # Nothing forged was trained: every trained rollout is one of the actor's own keys (a
    # trained forged key would be a training event without a consumed actor key).
    from sao_actor_learner.accounting import rollout_accounting

    accounting = rollout_accounting(config.run_dir)
    trained = config.max_steps * config.batch_size
    assert accounting["trained"] == summary["rollouts_trained"] == trained
    assert accounting["consumed_twice"] == 0 and accounting["lost"] == 0, accounting
    assert accounting["consumed"] == accounting["trained"] + accounting["dropped_stale"]
