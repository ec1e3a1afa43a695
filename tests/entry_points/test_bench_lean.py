"""The lean-profile benchmark's harness in --smoke mode: real runs of programs/sao.py (default and
--profile=lean, a few steps, local_mt), checkpoints scored afterwards; only the output's format
and consistency are checked, never a threshold or a timing."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_lean_profile_smoke_reports_every_variant_in_one_table(warm_start, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, os.path.join(REPO, "programs", "benchmarks",
                                                       "lean_profile.py"), "--smoke",
                          f"--run_root={tmp_path}", f"--init_checkpoint={warm_start}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    table = "\n".join(lines[:-1])
    assert result["benchmark"] == "lean_profile" and result["smoke"] is True
    assert set(result["summary"]) == set(result["runs"]) == {"default", "lean"}
    assert result["variants"]["lean"] == ["--profile=lean"]
    s = result["settings"]
    for name, runs in result["runs"].items():
        assert f"| {name} |" in table
        (run,) = runs
        assert run["variant"] == name and run["repeat"] == 0
        assert run["processes"] == 1                       # local_mt: one process
        assert run["cpu_s"] > 0 and run["steps_per_s"] > 0 and run["train_s"] > 0
        assert run["peak_rss_mb"] > 0
        versions = [c["version"] for c in run["curve"]]
        assert versions == list(range(0, s["max_steps"] + 1, s["checkpoint_every"]))
        assert all(0.0 <= c["accuracy"] <= 1.0 for c in run["curve"])
        assert run["final_accuracy"] == run["curve"][-1]["accuracy"]
        if run["time_to_threshold_s"] is not None:
            hit = next(c for c in run["curve"] if c["accuracy"] >= s["threshold"])
            assert run["steps_to_threshold"] == hit["version"]
        for key in ("wait_s_median", "estimate_s_median", "policy_step_s_median",
                    "critic_step_s_median", "publish_s_median", "learner_wait_frac_median"):
            assert run[key] is not None and run[key] >= 0, key
        agg = result["summary"][name]
        assert agg["steps_per_s"]["median"] == round(run["steps_per_s"], 4)
    # The lean run: the learner evaluated in its own process; default had an evaluator node.
    assert result["runs"]["lean"][0]["in_learner_eval_s"] > 0
    assert result["runs"]["default"][0]["in_learner_eval_s"] == 0
    assert result["summary"]["default"]["ratio_to_default"]["steps_per_s"] == 1.0
    assert "ratios to default" in table
