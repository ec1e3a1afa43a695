"""Benchmark 1 (programs/benchmarks/vs_trl.py): SAO and TRL's GRPOTrainer side by side.

The unit tests feed the report code (ratios, target, table, JSON) synthetic runs that reach the
threshold at step 0, later or never. The smoke test runs both sides for real on tiny settings
(real processes) and checks only the output's format: what it asserts holds whether each side
reaches a threshold at step 0, later or never. It needs the TRL environment (`make trl-env`;
CI builds it in .ci/run): without it the smoke test fails, it does not skip."""
import itertools
import json
import os
import subprocess
import sys

import pytest

import hf_fixtures as fx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from programs.benchmarks import vs_trl  # noqa: E402  (defines no flags on import)

TRL_PYTHON = os.path.join(REPO, ".venv-trl", "bin", "python")
SIDE_KEYS = ("time_to_threshold_s", "time_to_threshold_incl_startup_s", "steps_to_threshold",
             "rollouts_per_s", "tokens_per_s", "initial_accuracy", "final_accuracy", "cpu_s",
             "startup_s", "steps", "step_s", "time_to_0.4_s", "steps_to_0.4")
RATIO_KEYS = {"value", "bound", "reason"}


# --- _ratio, target_met, summarize, table: synthetic runs --------------------------------------
def test_ratio_reports_zero_missing_and_normal_denominators_without_raising():
    assert vs_trl._ratio(2.0, 8.0, 60.0) == {"value": 0.25, "bound": None, "reason": None}
    # TRL reached the threshold at 0 s (its step-0 evaluation): no finite ratio, a reason.
    zero = vs_trl._ratio(3.0, 0.0, 60.0)
    assert zero["value"] is None and zero["bound"] is None and "at 0 s" in zero["reason"]
    both_zero = vs_trl._ratio(0.0, 0.0, 60.0)
    assert both_zero["value"] is None and "both sides" in both_zero["reason"]
    assert vs_trl._ratio(0.0, 5.0, 60.0)["value"] == 0.0       # SAO at 0 s, TRL later
    # TRL did not reach it (None): an upper bound from its budget, or none without one.
    missing = vs_trl._ratio(6.0, None, 60.0)
    assert missing["value"] is None and missing["bound"] == "< 0.100"
    assert "within 60 s" in missing["reason"]
    for budget in (0.0, None):
        no_budget = vs_trl._ratio(6.0, None, budget)
        assert no_budget["value"] is None and no_budget["bound"] is None and no_budget["reason"]
    # SAO did not reach it.
    assert vs_trl._ratio(None, 4.0, 60.0)["reason"] == "SAO did not reach the threshold"
    assert vs_trl._ratio(None, None, 60.0)["reason"] == "neither side reached the threshold"
    assert vs_trl._ratio(None, 0.0, 60.0)["value"] is None
    for r in (zero, both_zero, missing):
        assert set(r) == RATIO_KEYS and vs_trl._ratio_text(r)


def test_target_met_never_divides():
    assert vs_trl.target_met(1.0, 3.0, 60.0) and not vs_trl.target_met(1.1, 3.0, 60.0)
    assert not vs_trl.target_met(1.0, 0.0, 60.0)          # TRL at 0 s, SAO later
    assert vs_trl.target_met(0.0, 0.0, 60.0)              # vacuous (target_note says so)
    assert vs_trl.target_met(20.0, None, 60.0) and not vs_trl.target_met(21.0, None, 60.0)
    assert not vs_trl.target_met(None, 3.0, 60.0) and not vs_trl.target_met(None, None, 60.0)


def _run(side, reach):
    """A synthetic side result whose curve first meets 0.5 (and 0.4) at step 0, 2, or never."""
    acc = {"step0": [0.6, 0.7, 0.8], "later": [0.3, 0.55, 0.45], "never": [0.3, 0.35, 0.2]}[reach]
    curve = [{"step": 2 * i, "accuracy": a, "train_clock_s": 1.5 * i,
              "since_launch_s": 10.0 + 1.5 * i, "rollouts": 16 * i} for i, a in enumerate(acc)]
    return vs_trl._side_result(side, f"{side}_0", curve, 0.5, ["0.4"], steps=4, train_s=3.0,
                               rollouts=32, tokens=100, proc={"wall_s": 20.0, "cpu_s": 9.0},
                               startup_s=10.0, extra={})


@pytest.mark.parametrize("sao_reach,trl_reach",
                         list(itertools.product(("step0", "later", "never"), repeat=2)))
def test_report_of_any_outcome_is_a_table_and_strict_json(sao_reach, trl_reach):
    sides = {"sao": [_run("sao", sao_reach)], "trl": [_run("trl", trl_reach)],
             "trl_same_prompts": [_run("trl", trl_reach)]}
    result = vs_trl.summarize(sides, budget=3.0, also_thresholds=["0.4"])
    assert isinstance(result["target_met"], bool)
    for ratios in result["ratios"].values():
        assert set(ratios) == {"time_to_threshold", "time_to_threshold_incl_startup",
                               "time_to_0.4"}
        for r in ratios.values():
            assert set(r) == RATIO_KEYS
            assert r["value"] is None or isinstance(r["value"], float)
            assert (r["value"] is None) == (r["reason"] is not None)
    main = result["ratios"]["trl"]["time_to_threshold"]
    if sao_reach != "never" and trl_reach == "later":
        assert main["value"] == (0.0 if sao_reach == "step0" else 1.0)
    else:
        assert main["value"] is None
    assert (result["target_note"] is not None) == (trl_reach == "step0")
    text = vs_trl.table(result, {"sao": "SAO", "trl": "TRL 4x2", "trl_same_prompts": "TRL 8x2"},
                        3.0, ["0.4"])
    assert "time to threshold (s, training)" in text and "SAO / TRL 4x2:" in text
    assert not any(line.startswith("{") for line in text.splitlines())
    json.dumps(result, allow_nan=False)   # strict JSON: no inf or nan anywhere


# --- the whole benchmark on tiny settings -------------------------------------------------------
def _check_optional(value, kind, what):
    assert value is None or (isinstance(value, kind) and value >= 0), f"{what}: {value!r}"


def _check_format(result, threshold):
    """What any vs_trl run prints, whatever each side reached."""
    assert result["benchmark"] == "vs_trl" and result["threshold"] == threshold
    assert result["trl_tuned"] == {"group_size": 2, "learning_rate": 1e-4, "runs": []}
    assert isinstance(result["target_met"], bool)
    assert result["target_note"] is None or isinstance(result["target_note"], str)
    assert set(result["summary"]) == {"sao", "trl", "trl_same_prompts"}
    assert set(result["ratio_sao_over_trl"]) == {"trl", "trl_same_prompts"}
    for ratios in result["ratio_sao_over_trl"].values():
        assert set(ratios) == {"time_to_threshold", "time_to_threshold_incl_startup",
                               "time_to_0.4"}
        for r in ratios.values():
            assert set(r) == RATIO_KEYS
            assert r["value"] is None or isinstance(r["value"], (int, float))
    assert set(result["runs"]) == {"sao", "trl", "trl_same_prompts"}
    for side, runs in result["runs"].items():
        assert len(runs) == 1
        run = runs[0]
        for key in SIDE_KEYS:
            assert key in run, f"{side} lacks {key}"
        # Thresholds: present and typed; reached or not is the run's business.
        assert isinstance(run["reached"], bool)
        _check_optional(run["time_to_threshold_s"], (int, float), f"{side} time_to_threshold_s")
        _check_optional(run["time_to_0.4_s"], (int, float), f"{side} time_to_0.4_s")
        _check_optional(run["steps_to_threshold"], int, f"{side} steps_to_threshold")
        _check_optional(run["steps_to_0.4"], int, f"{side} steps_to_0.4")
        assert (run["time_to_threshold_s"] is None) == (not run["reached"])
        assert 0.0 <= run["final_accuracy"] <= 1.0 and 0.0 <= run["initial_accuracy"] <= 1.0
        assert run["rollouts_per_s"] > 0 and run["tokens_per_s"] >= run["rollouts_per_s"]
        assert run["cpu_s"] > 0 and run["startup_s"] > 0
        curve = run["eval_curve"]
        assert curve[0][0] == 0 and [c[0] for c in curve] == sorted(c[0] for c in curve)
        assert all(c[2] >= 0 and 0.0 <= c[1] <= 1.0 for c in curve)


def _run_vs_trl(args):
    cmd = [sys.executable, os.path.join(REPO, "programs", "benchmarks", "vs_trl.py"), *args]
    # The timeout only catches a hang: a loaded machine is slow, not wrong.
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert "time to threshold (s, training)" in proc.stdout   # the table
    result = json.loads(lines[-1])                              # ... then exactly one JSON line
    assert not any(line.startswith("{") for line in lines[:-1])
    return result


def test_vs_trl_smoke_prints_a_table_and_one_json_line(warm_start, tmp_path):
    assert os.path.exists(TRL_PYTHON), (
        f"{TRL_PYTHON} is missing: build the TRL environment with `make trl-env` (CI runs it in "
        ".ci/run before `make test`)")
    threshold = 0.5
    result = _run_vs_trl([
        f"--init_checkpoint={warm_start}", f"--run_root={tmp_path}", "--repeats=1",
        f"--threshold={threshold}", "--also_thresholds=0.4", "--eval_every=2", "--eval_size=40",
        "--rollouts_per_step=8", "--sao_max_steps=4", "--trl_group_sizes=2",
        "--trl_lrs=1e-4", "--trl_time_budget_s=3", "--trl_max_steps=6",
        "--sao_extra_flags=--actor_batch=4,--value_pretrain_rollouts=0",
        "--stall_timeout_s=400",
        "--subprocess_timeout_s=500"])
    assert result["workload"] == "arithmetic"
    _check_format(result, threshold)
    sao, trl = result["runs"]["sao"][0], result["runs"]["trl"][0]
    # Same warm start, same held-out prompts, same greedy scoring: the same step-0 accuracy.
    assert sao["initial_accuracy"] == trl["initial_accuracy"]
    assert sao["steps"] == 4 and sao["rollouts"] == 4 * 8
    assert trl["rollouts_per_step"] == 8 and trl["prompts_per_step"] == 4
    assert result["runs"]["trl_same_prompts"][0]["rollouts_per_step"] == 16
    assert trl["rollouts"] == trl["steps"] * 8


def test_vs_trl_dataset_workload_smoke_prints_a_table_and_one_json_line(tmp_path):
    """The dataset workload (a tiny random Qwen3 with a BPE tokenizer and chat template, GSM-style
    parquet rows, the gsm8k reward) through both sides: the same format, nothing about learning."""
    assert os.path.exists(TRL_PYTHON), f"{TRL_PYTHON} is missing: `make trl-env`"
    model = fx.tiny_qwen3(str(tmp_path / "model"))
    train = fx.write_parquet(str(tmp_path / "train.parquet"), fx.gsm_rows(64))
    test = fx.write_parquet(str(tmp_path / "test.parquet"), fx.gsm_rows(12, start=500))
    threshold = 0.5
    result = _run_vs_trl([
        "--workload=dataset", f"--init_checkpoint={model}", f"--train_files={train}",
        f"--eval_files={test}", f"--run_root={tmp_path / 'runs'}", "--repeats=1",
        f"--threshold={threshold}", "--also_thresholds=0.4", "--eval_every=2", "--eval_size=12",
        "--max_new_tokens=16", "--rollouts_per_step=8", "--sao_max_steps=2",
        "--trl_group_sizes=2", "--trl_lrs=1e-4", "--trl_time_budget_s=3", "--trl_max_steps=3",
        "--sao_extra_flags=--actor_batch=4,--value_pretrain_rollouts=0",
        "--stall_timeout_s=400",
        "--subprocess_timeout_s=500"])
    _check_format(result, threshold)
    assert result["workload"] == "dataset" and result["max_new_tokens"] == 16
    assert "--lr_schedule=cosine" in result["sao_flags"]     # make run-dataset's recipe
    sao, trl = result["runs"]["sao"][0], result["runs"]["trl"][0]
    assert sao["steps"] == 2 and sao["rollouts"] == 2 * 8
    assert trl["rollouts_per_step"] == 8 and trl["rollouts"] == trl["steps"] * 8
