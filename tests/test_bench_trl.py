"""Smoke test of benchmark 1 (programs/benchmarks/vs_trl.py): SAO and TRL's GRPOTrainer side by
side on tiny settings, real processes on both sides. Needs the TRL environment (`make trl-env`;
CI builds it in .ci/run): without it the test fails, it does not skip."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL_PYTHON = os.path.join(REPO, ".venv-trl", "bin", "python")
SIDE_KEYS = ("time_to_threshold_s", "time_to_threshold_incl_startup_s", "steps_to_threshold",
             "rollouts_per_s", "tokens_per_s", "initial_accuracy", "final_accuracy", "cpu_s",
             "startup_s", "steps", "step_s", "time_to_0.4_s", "steps_to_0.4")


def test_vs_trl_smoke_prints_a_table_and_one_json_line(warm_start, tmp_path):
    assert os.path.exists(TRL_PYTHON), (
        f"{TRL_PYTHON} is missing: build the TRL environment with `make trl-env` (CI runs it in "
        ".ci/run before `make test`)")
    threshold = 0.5
    cmd = [sys.executable, os.path.join(REPO, "programs", "benchmarks", "vs_trl.py"),
           f"--init_checkpoint={warm_start}", f"--run_root={tmp_path}", "--repeats=1",
           f"--threshold={threshold}", "--also_thresholds=0.4", "--eval_every=2", "--eval_size=40",
           "--rollouts_per_step=8", "--sao_max_steps=4", "--trl_group_sizes=2",
           "--trl_lrs=1e-4", "--trl_time_budget_s=3", "--trl_max_steps=6",
           "--sao_extra_flags=--actor_batch=4"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=170,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert "time to threshold (s, training)" in proc.stdout   # the table
    result = json.loads(lines[-1])                              # ... then exactly one JSON line
    assert not any(line.startswith("{") for line in lines[:-1])

    assert result["benchmark"] == "vs_trl" and result["threshold"] == threshold
    assert result["trl_tuned"] == {"group_size": 2, "learning_rate": 1e-4, "runs": []}
    assert isinstance(result["target_met"], bool)
    assert set(result["summary"]) == {"sao", "trl", "trl_same_prompts"}
    assert "time_to_0.4" in result["ratio_sao_over_trl"]["trl"]
    assert set(result["runs"]) == {"sao", "trl", "trl_same_prompts"}
    for side, runs in result["runs"].items():
        assert len(runs) == 1
        run = runs[0]
        for key in SIDE_KEYS:
            assert key in run, f"{side} lacks {key}"
        assert 0.0 <= run["final_accuracy"] <= 1.0
        assert run["rollouts_per_s"] > 0 and run["tokens_per_s"] >= run["rollouts_per_s"]
        assert run["cpu_s"] > 0 and run["startup_s"] > 0
        curve = run["eval_curve"]
        assert curve[0][0] == 0 and [c[0] for c in curve] == sorted(c[0] for c in curve)
        assert all(c[2] >= 0 for c in curve)
        if run["reached"]:   # the first evaluation at or above the threshold
            first = next(c for c in curve if c[1] >= threshold)
            assert run["steps_to_threshold"] == first[0]
            assert run["time_to_threshold_s"] == first[2]
            assert run["time_to_threshold_incl_startup_s"] >= run["time_to_threshold_s"]
        else:
            assert run["time_to_threshold_s"] is None
            assert all(c[1] < threshold for c in curve)
        if run["steps_to_0.4"] is not None:   # the lower threshold comes no later
            assert run["steps_to_threshold"] is None or \
                run["steps_to_0.4"] <= run["steps_to_threshold"]
    sao, trl = result["runs"]["sao"][0], result["runs"]["trl"][0]
    # Same warm start, same held-out prompts, same greedy scoring: the same step-0 accuracy.
    assert sao["initial_accuracy"] == trl["initial_accuracy"]
    assert sao["steps"] == 4 and sao["rollouts"] == 4 * 8
    assert trl["rollouts_per_step"] == 8 and trl["prompts_per_step"] == 4
    assert result["runs"]["trl_same_prompts"][0]["rollouts_per_step"] == 16
    assert trl["rollouts"] == trl["steps"] * 8
