"""Smoke run of programs/benchmarks/interruptible.py (--smoke: the real program on tiny settings,
one process): the table and the JSON line have every mode and figure, with values that make
sense whatever the machine's speed (no expected numbers)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_interruptible_reports_every_mode(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, os.path.join(REPO, "programs", "benchmarks",
                                                       "interruptible.py"),
                          "--smoke", f"--out_dir={tmp_path}"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    result, table = json.loads(lines[-1]), "\n".join(lines[:-1])
    assert result["benchmark"] == "interruptible" and result["smoke"] is True
    assert set(result["modes"]) == {"off", "keep", "abort"}
    for mode, res in result["modes"].items():
        assert f"{mode:>5} " in table
        (run,) = res["runs"]
        assert run["mode"] == mode and run["wall_s"] > 0
        assert run["rollouts_per_s"] > 0 and run["tokens_per_s"] > 0
        assert run["sampled_tokens_per_s"] >= run["tokens_per_s"]
        for key in ("regenerated_frac", "switched_frac", "learner_wait_frac"):
            assert 0.0 <= run[key] <= 1.0, (mode, key, run[key])
        assert 0 <= run["rollout_staleness_mean"] <= run["rollout_staleness_max"] <= 4
        assert run["token_staleness_mean"] >= 0
        assert sum(run["rollout_staleness_hist"]) == 3 * 4    # 3 steps x batch 4 trained
        assert sum(run["token_lag_hist"]) == run["engine_counters"]["tokens"]
        assert res["rollouts_per_s"]["median"] == run["rollouts_per_s"]
    for mode in ("off", "keep"):        # neither throws tokens away
        assert result["modes"][mode]["runs"][0]["regenerated_frac"] == 0.0
    off = result["modes"]["off"]["runs"][0]
    assert off["switched_frac"] == 0.0 and off["token_lag_hist"][1:] == [0] * \
        (len(off["token_lag_hist"]) - 1)
