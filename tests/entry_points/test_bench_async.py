"""Smoke runs of the issue-8 benchmarks 2 and 5 on tiny settings: each program runs the real
program (real Reverb, gRPC, processes, tiny model) and ends with one JSON line whose keys and
values must make sense (no expected numbers: the figures depend on the machine)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_benchmark(name, args, timeout):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, os.path.join(REPO, "programs", "benchmarks", name),
                          *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1])


def test_async_vs_sync_reports_both_modes_and_their_ratios(warm_start, tmp_path):
    # local_mt keeps the smoke test quick (one process); the measurement runs local_mp.
    result, table = _run_benchmark("async_vs_sync.py", [
        "--regimes=2x4", "--repeats=1", "--max_steps=4", "--batch_size=8", "--eval_size=20",
        "--threshold=0.01", "--delay_mean_s=0.02", "--launch=local_mt",
        f"--init_checkpoint={warm_start}", f"--out_dir={tmp_path}"], timeout=240)
    assert result["benchmark"] == "async_vs_sync" and "async/sync" in table
    regime = result["regimes"]["2x4"]
    for mode in ("sync", "async"):
        (run,) = regime["runs"][mode]
        assert run["mode"] == mode
        assert run["steps_per_s"] > 0 and run["wall_s"] > 0
        assert abs(run["steps_per_s"] * run["wall_s"] - 4) < 1e-6
        # threshold 0.01 is passed at the first evaluated version after the warm start
        assert run["steps_to_threshold"] is not None and 1 <= run["steps_to_threshold"] <= 4
        assert 0 < run["time_to_threshold_s"] <= run["wall_s"]
        assert 0 < run["actor_generate_frac"] < 1
        assert regime[mode]["steps_per_s"]["median"] == run["steps_per_s"]
    sync, async_ = regime["runs"]["sync"][0], regime["runs"]["async"][0]
    assert sync["staleness_max"] == 0 and sync["staleness_mean"] == 0   # lock-step: on-policy
    assert async_["staleness_max"] <= 4
    assert abs(regime["steps_per_s_ratio"]
               - async_["steps_per_s"] / sync["steps_per_s"]) < 1e-9
    assert abs(regime["time_to_threshold_ratio"]
               - sync["time_to_threshold_s"] / async_["time_to_threshold_s"]) < 1e-9
    assert isinstance(regime["target_met"], bool)


def test_memory_reports_every_node_type_with_a_baseline_split(warm_start, tmp_path):
    result, table = _run_benchmark("memory.py", [
        f"--run_dir={tmp_path / 'run'}", f"--init_checkpoint={warm_start}",
        "--program_args=max_steps=3,eval_size=20,batch_size=8,actor_batch=4,num_actors=1"],
        timeout=300)
    assert result["benchmark"] == "memory" and result["steps"] == 3
    types = result["node_types"]
    assert set(types) == {"launcher", "replay", "variables", "learner", "actor", "evaluator"}
    assert types["actor"]["processes"] == 1
    for name, t in types.items():
        assert 10 < t["peak_rss_mib"] < 8000, (name, t)
        parts = t["parts_mib"]
        # the parts add up to the peak (run-time is the peak minus the baseline)
        assert abs(sum(parts.values()) - t["peak_rss_mib"]) < 1e-6, (name, parts)
        assert t["dominated_by"] == max(parts, key=parts.get)
        assert t["at_peak_anon_mib"] > 0 and t["at_peak_file_mib"] > 0
        assert name in table
    # The learner builds a model: its baseline has the transformers and weights stages; Reverb
    # (and with it TensorFlow) is mapped in the replay node and not in the variable server.
    assert {"model code", "weights"} <= set(types["learner"]["parts_mib"])
    assert "reverb" in types["replay"]["frameworks_mapped"]
    assert "tensorflow" not in types["variables"]["frameworks_mapped"]
    assert result["total_peak_rss_mib"] >= sum(t["peak_rss_mib"] for t in types.values())
