"""vs_trl.py --mode=budget: equal wall-clock budgets, accuracy-vs-time curves.

The curve math (experiments/benchmarks/budget_curves.py) is checked against slow grid versions on
random step functions; the report (summary, targets, staleness table) on synthetic runs. The
smoke test runs the budget mode for real on tiny settings (TRL and SAO disaggregated: real
processes, the recorder node, the post-hoc evaluation) and checks only the output's format:
nothing about who is ahead.
"""
import json
import math
import os
import random
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from experiments.benchmarks import budget_curves as bc  # noqa: E402
from programs.benchmarks import vs_trl_budget as vb  # noqa: E402

TRL_PYTHON = os.path.join(REPO, ".venv-trl", "bin", "python")


def _random_curve(rng, budget):
    times = sorted(rng.uniform(0, budget * 1.3) for _ in range(rng.randint(1, 8)))
    return [(0.0, rng.random())] + [(t, rng.random()) for t in times]


def _slow_at(curve, t):
    best = None
    for ti, ai in curve:   # newest point at or before t, by a full scan
        if ti <= t and (best is None or ti >= best[0]):
            best = (ti, ai)
    return None if best is None else best[1]


def test_accuracy_at_time_to_and_mean_match_slow_grid_versions():
    rng = random.Random(0)
    budget = 10.0
    for _ in range(50):
        curve = _random_curve(rng, budget)
        rng.shuffle(curve)                       # order must not matter
        for t in (0.0, 0.5, 3.3, budget, budget * 2):
            assert bc.accuracy_at(curve, t) == _slow_at(curve, t)
        n = 4000                                 # midpoint rule on a fine grid
        slow_mean = sum(_slow_at(curve, (i + 0.5) * budget / n) or 0.0 for i in range(n)) / n
        assert bc.mean_accuracy(curve, budget) == pytest.approx(slow_mean, abs=5e-3)
        for a in (0.2, 0.5, 0.9):
            hits = [t for t, acc in curve if acc >= a and t <= budget]
            assert bc.time_to(curve, a, budget) == (min(hits) if hits else None)


def _slow_held(curve, a, budget, hold):
    points = sorted(p for p in curve if p[0] <= budget)
    for i in range(len(points)):
        window = points[i:i + hold]             # fewer where the budget ends first
        if min(acc for _, acc in window) >= a:
            return points[i][0]
    return None


def test_held_time_to_matches_a_slow_version_and_ignores_a_lucky_evaluation():
    rng = random.Random(1)
    for _ in range(50):
        curve = _random_curve(rng, 10.0)
        rng.shuffle(curve)
        for a in (0.2, 0.5, 0.9):
            for hold in (1, 2, 3):
                assert bc.held_time_to(curve, a, 10.0, hold) == _slow_held(curve, a, 10.0, hold)
        assert bc.held_time_to(curve, 0.5, 10.0, 1) == bc.time_to(curve, 0.5, 10.0)
    spike = [(0.0, 0.4), (5.0, 0.75), (10.0, 0.5), (15.0, 0.55), (20.0, 0.62), (25.0, 0.61),
             (30.0, 0.7)]
    assert bc.time_to(spike, 0.6) == 5.0
    assert bc.held_time_to(spike, 0.6, hold=3) == 20.0
    assert bc.held_time_to(spike, 0.6, budget_s=26.0, hold=3) == 20.0   # the budget ends it
    assert bc.held_time_to(spike, 0.8, hold=3) is None
    with pytest.raises(ValueError, match="hold"):
        bc.held_time_to(spike, 0.6, hold=0)


def test_mean_accuracy_edges():
    assert bc.mean_accuracy([(0.0, 0.5)], 10.0) == 0.5
    assert bc.mean_accuracy([(0.0, 0.0), (5.0, 1.0)], 10.0) == 0.5
    assert bc.mean_accuracy([(0.0, 0.2), (20.0, 1.0)], 10.0) == pytest.approx(0.2)  # after B
    with pytest.raises(ValueError, match="budget_s"):
        bc.mean_accuracy([(0.0, 0.5)], 0.0)


def test_spread_counts_not_reached_as_infinite():
    assert bc.spread([1.0, 3.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert bc.spread([1.0, None, None])["median"] is None     # most did not get there
    assert bc.spread([1.0, 2.0, None]) == {"median": 2.0, "min": 1.0, "max": None, "n": 3}


def test_median_curve_on_a_grid():
    curves = [[(0.0, 0.1), (2.0, 0.5)], [(0.0, 0.3), (1.0, 0.4)], [(1.5, 0.9)]]
    band = bc.median_curve(curves, [0.0, 1.0, 2.0])
    assert band["median"] == pytest.approx([0.2, 0.25, 0.5])
    assert band["min"] == [0.1, 0.1, 0.4]
    assert band["max"] == [0.3, 0.4, 0.9]


def _run(curve, rps, **extra):
    return {"curve": curve, "rollouts_per_s": rps, "tokens_per_s": 3 * rps, "startup_s": 5.0,
            "cpu_s": 100.0, "steps": 10, "value_pretrain_s": 0.0, "learner_wait_frac": 0.2,
            "staleness_mean": 1.0, "kl_rollout": 0.01, "masked_frac": 0.0, **extra}


def test_summary_targets_and_staleness_table_of_synthetic_runs():
    trl = [_run([(0.0, 0.4), (200.0, 0.55), (500.0, 0.62)], 2.0),
           _run([(0.0, 0.4), (250.0, 0.58)], 2.0)]
    sao = [_run([(0.0, 0.4), (100.0, 0.6), (400.0, 0.7)], 4.0),
           _run([(0.0, 0.4), (150.0, 0.61)], 4.0)]
    result = vb.summarize_budget({"trl": trl, "sao_disaggregated": sao}, 600.0, [300.0, 600.0],
                                 [0.6])
    s = result["summary"]
    assert s["trl"]["accuracy_at_300s"] == {"median": 0.565, "min": 0.55, "max": 0.58, "n": 2}
    assert s["sao_disaggregated"]["time_to_0.6_s"]["median"] == 125.0
    assert s["trl"]["time_to_0.6_s"] == {"median": None, "min": 500.0, "max": None, "n": 2}
    t = result["targets"]
    assert t["accuracy_at_300s_ge_trl"] == {"met": True, "by": 0.04}
    assert t["time_to_0.6_le_half_trl"] == {"met": True, "ratio": None}   # TRL: median not reached
    assert t["startup_le_1.5x_trl"] == {"met": True, "ratio": 1.0}
    assert s["sao_disaggregated"]["held_time_to_0.6_s"]["median"] == 125.0
    assert t["held_time_to_0.6_le_half_trl"] == {"met": True, "ratio": None}
    text = vb.table_text(result)
    assert "accuracy_at_600s" in text and "not reached" in text and "target" in text
    two = _run(sao[0]["curve"], 7.0, num_actors=2, actor_admission_wait_s=120.0,
               actor_weight_load_s=12.0)
    rows = vb.sweep_rows({"lockstep": sao[0], "2": two}, 600.0, 0.6)
    assert [r["setting"] for r in rows] == ["lockstep", "2"]
    assert [r["throughput_vs_lockstep"] for r in rows] == [1.0, 1.75]
    assert rows[0]["time_to_0.6_s"] == 100.0 and rows[0]["accuracy_at_budget"] == 0.7
    assert rows[0]["actor_admission_wait_frac"] is None   # a stored run without actor figures
    assert rows[1]["actor_admission_wait_frac"] == 0.1    # 120 s of 2 actors x 600 s
    assert rows[1]["actor_weight_load_frac"] == 0.01


def test_resummarize_recomputes_a_stored_result_with_other_thresholds(tmp_path):
    trl = [_run([(0.0, 0.4), (200.0, 0.55), (500.0, 0.62)], 2.0)]
    sao = [_run([(0.0, 0.4), (100.0, 0.6), (400.0, 0.7)], 4.0)]
    stored = {"budget_s": 600.0, "runs": {"trl": trl, "sao_disaggregated": sao},
              "sweep_runs": {"lockstep": sao[0]}, "summary": {}, "targets": {}}
    path = tmp_path / "budget.json"
    path.write_text(json.dumps(stored))
    result = vb.resummarize(str(path), [300.0], [0.5, 0.7], 0.7)
    again = json.loads(path.read_text())
    assert again["summary"] == result["summary"]
    assert again["runs"] == json.loads(json.dumps(stored["runs"]))   # the runs as they were
    assert again["summary"]["trl"]["time_to_0.5_s"]["median"] == 200.0
    assert again["summary"]["sao_disaggregated"]["held_time_to_0.7_s"]["median"] == 400.0
    assert again["staleness_sweep"][0]["time_to_0.7_s"] == 400.0
    assert (tmp_path / "budget.png").stat().st_size > 0


def test_budget_mode_smoke_prints_a_table_a_plot_and_one_json_line(warm_start, tmp_path):
    assert os.path.exists(TRL_PYTHON), f"{TRL_PYTHON} is missing: `make trl-env`"
    out = tmp_path / "out" / "budget"
    cmd = [sys.executable, os.path.join(REPO, "programs", "benchmarks", "vs_trl.py"),
           "--mode=budget", f"--init_checkpoint={warm_start}", f"--run_root={tmp_path / 'runs'}",
           "--repeats=1", "--budget_s=6", "--report_at_s=3,6", "--budget_thresholds=0.3,0.9",
           "--budget_eval_every=2", "--eval_size=20", "--rollouts_per_step=8",
           "--sao_max_steps=200", "--trl_group_sizes=2", "--trl_lrs=1e-4", "--trl_threads=1",
           "--trl_max_steps=400", "--sao_layouts=disaggregated",
           "--sao_policy_lrs=1e-5,1e-4", "--tune_budget_s=3",        # SAO's lr tuned too
           "--staleness_sweep=2", "--sweep_budget_s=4",
           "--sao_extra_flags=--actor_batch=4", "--stall_timeout_s=400",
           "--sao_critic_model=",   # not this checkout's own checkpoints/critic_dataset
           "--subprocess_timeout_s=500", f"--out={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert not any(line.startswith("{") for line in lines[:-1])
    assert "mean_accuracy" in proc.stdout and "accuracy_at_6s" in proc.stdout   # the table
    assert result["mode"] == "budget" and result["budget_s"] == 6
    assert result["trl_tuned"]["threads"] == 1 and result["trl_tuned"]["group_size"] == 2
    assert set(result["summary"]) == {"trl", "sao_disaggregated"}
    for side, metrics in result["summary"].items():
        for key in ("accuracy_at_3s", "accuracy_at_6s", "mean_accuracy", "time_to_0.3_s",
                    "time_to_0.9_s", "rollouts_per_s", "tokens_per_s", "startup_s", "cpu_s"):
            assert set(metrics[key]) == {"median", "min", "max", "n"}, (side, key)
        acc = metrics["accuracy_at_6s"]["median"]
        assert acc is not None and 0.0 <= acc <= 1.0
        assert 0.0 <= metrics["mean_accuracy"]["median"] <= 1.0
        assert metrics["startup_s"]["median"] > 0 and metrics["cpu_s"]["median"] > 0
    assert [r["policy_lr"] for r in result["sao_tuned"]["runs"]] == [1e-5, 1e-4]
    # The invocation's start-up cache starts empty: its first SAO run (a tuning run) is cold.
    assert result["sao_tuned"]["startup_runs"][0]["startup_cache"] == "cold"
    assert result["sao_cold_startup_s"] == result["sao_tuned"]["startup_runs"][0]["startup_s"]
    assert result["sao_tuned"]["policy_lr"] in (1e-5, 1e-4)
    [row] = result["staleness_sweep"]
    assert row["setting"] == "2" and row["throughput_vs_lockstep"] is None   # no lock-step run
    assert 0.0 <= row["actor_admission_wait_frac"] <= 1.0
    assert 0.0 <= row["actor_weight_load_frac"] <= 1.0
    saved = json.loads((tmp_path / "out" / "budget.json").read_text())
    sao = saved["runs"]["sao_disaggregated"][0]
    assert sao["curve"][0] == [0.0, saved["runs"]["trl"][0]["curve"][0][1]]   # same warm start
    assert all(0.0 <= t <= 6.0 + 1e-6 for t, _ in sao["curve"])
    assert "--placement=actor:cpu0,learner:cpu1" in sao["flags"]
    assert sao["policy_lr"] == result["sao_tuned"]["policy_lr"]   # the tuned rate is used
    assert saved["sweep_runs"]["2"]["policy_lr"] == sao["policy_lr"]
    assert all(0.0 <= t <= 4.0 + 1e-6 for t, _ in saved["sweep_runs"]["2"]["curve"])
    assert (tmp_path / "out" / "budget.png").stat().st_size > 1000
    assert not math.isnan(sao["rollouts_per_s"]) and sao["steps"] >= 1


def test_evaluate_versions_refuses_a_run_that_recorded_nothing(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "programs"))
    import evaluate_versions
    from sao_actor_learner.config import SAOConfig

    with pytest.raises(FileNotFoundError, match="must be a run folder"):
        evaluate_versions.evaluate_versions(str(tmp_path))
    (tmp_path / "config.json").write_text(SAOConfig(task="arithmetic").to_json())
    with pytest.raises(ValueError, match="--evaluator=node; record with --evaluator=record"):
        evaluate_versions.evaluate_versions(str(tmp_path))


def test_the_recorder_keeps_due_versions_whole(tmp_path):
    from sao_actor_learner.actors.version_recorder import VersionRecorder, read_index

    class Versions:   # a VariableSource that publishes 0..7, then stays at 7
        def __init__(self):
            self.v = -1

        def update(self):
            self.v = min(self.v + 1, 7)

        def get_variables(self):
            return self.v, b"weights-%d" % self.v

    rec = VersionRecorder(Versions(), str(tmp_path), eval_every=3, max_steps=7, poll_s=0.0)
    rec.run()   # ends once max_steps is recorded
    assert rec.recorded == [0, 3, 6, 7]
    index = read_index(str(tmp_path))
    assert [r["version"] for r in index] == [0, 3, 6, 7]
    assert (tmp_path / "policy_versions" / "v000006.safetensors").read_bytes() == b"weights-6"
    assert not list((tmp_path / "policy_versions").glob("*.tmp"))
