"""programs/tune_staleness.py end to end on a tiny config (the real program, threads), and the
bad input of it and programs/plan_staleness.py: each fails before anything runs, naming the flag.
No expected numbers: the figures depend on the machine."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--task=arithmetic", "--max_steps=4", "--batch_size=8", "--actor_batch=4",
        "--num_actors=1", "--eval_size=20", "--eval_every=2", "--launch=local_mt",
        "--limits=1", "--repeats=1", "--progress=false"]


def _run(program, args, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, os.path.join(REPO, "programs", program), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_tuner_measures_lockstep_and_a_limit_and_recommends_one(warm_start, tmp_path):
    args = TINY + [f"--init_checkpoint={warm_start}", f"--out_dir={tmp_path}",
                   f"--report={tmp_path}/out/tiny_"]
    out = _run("tune_staleness.py", args)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tool"] == "tune_staleness" and result["limits"] == [0, 1]
    assert result["recommended_limit"] in (0, 1) and result["why"] and result["rule"]
    for name in ("report.md", "tuner.png", "staleness.png", "result.json"):
        assert os.path.getsize(tmp_path / "out" / f"tiny_{name}") > 0
    report = (tmp_path / "out" / "tiny_report.md").read_text()
    assert f"recommended limit {result['recommended_limit']}" in report
    assert "0 (lock-step)" in report and "**Rule**" in report
    lock, one = result["summary"]["0"], result["summary"]["1"]
    assert lock["staleness_hist"] == [32] and lock["staleness_rollout_mean"] == 0
    assert len(one["staleness_hist"]) <= 2 and sum(one["staleness_hist"]) == 32
    for row in (lock, one):
        assert row["rollouts_per_s"] > 0 and row["tokens_per_s"] > row["rollouts_per_s"]
        assert 0 < row["learner_busy_frac"] and 0 <= row["admission_wait_frac"] < 1
        assert row["kl"] is not None and row["ess"] is not None and row["repeats"] == 1
        assert row["final_accuracy"] is not None
        assert row["planned_rollouts_per_s"] > 0      # the planner, from the lock-step run
    assert set(result["verdicts"]) == {"0", "1"}
    # the same command again reads the finished runs instead of running them
    again = _run("tune_staleness.py", args + ["--progress=true"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("done earlier, read") == 2
    assert json.loads(again.stdout.strip().splitlines()[-1])["summary"] == result["summary"]
    # the planner fits its costs and lengths to the lock-step run and takes its loop
    plan = _run("plan_staleness.py", [f"--from_run={tmp_path}/runs/eta0_r0", "--limits=0,1",
                                      "--seeds=1"], timeout=120)
    assert plan.returncode == 0, plan.stderr[-3000:]
    line = json.loads(plan.stdout.strip().splitlines()[-1])
    assert line["assumptions"][0].startswith("loop: batch 8, 1 actors x 4 prompts")
    assert any("[fitted]" in a for a in line["assumptions"])
    assert [r["max_staleness"] for r in line["curve"]] == [0, 1]


def test_the_tuner_refuses_a_grid_with_no_limit(tmp_path):
    out = _run("tune_staleness.py", ["--limits=", f"--out_dir={tmp_path}"], timeout=120)
    assert out.returncode != 0 and "--limits is empty" in out.stderr
    assert not os.path.exists(tmp_path / "runs")


def test_the_planner_prints_the_curve_and_refuses_a_distribution_without_a_mean(tmp_path):
    out = _run("plan_staleness.py", ["--lengths=lognormal:50,0.5", "--gen_step_s=0.01",
                                     "--learner_step_s=0.5", "--publish_s=0.1",
                                     "--limits=0,2", "--max_steps=20", "--seeds=1",
                                     f"--report={tmp_path}/p_"], timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["max_staleness"] for r in line["curve"]] == [0, 2]
    assert line["curve"][1]["rollouts_per_s"] >= line["curve"][0]["rollouts_per_s"]
    assert any("gen_step_s=0.01 [flag]" in a for a in line["assumptions"])
    assert (tmp_path / "p_plan.md").exists() and (tmp_path / "p_plan.png").exists()
    for flag, match in (("--lengths=pareto:50,0.9", "--lengths='pareto:50,0.9': a Pareto "
                         "shape <= 1 has no finite mean"),
                        (f"--lengths=file:{tmp_path}/none.json", "--lengths=file:")):
        bad = _run("plan_staleness.py", [flag, "--gen_step_s=0.01"], timeout=120)
        assert bad.returncode != 0 and match in bad.stderr, bad.stderr[-2000:]
