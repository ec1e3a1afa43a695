"""The sweep presets of programs/study.py end to end at --size=smoke: staleness sweep
(resumable), value-pretraining sweep and online shift. Real programs in subprocesses: real Reverb, gRPC and a tiny HF model,
every node a thread (the smoke presets use local_mt to keep start-up to one process)."""
import csv
import os
import subprocess
import sys

import pytest

from experiments import sweeps
from sao_actor_learner.observers import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(preset, warm_start, out_dir, *args):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "programs", "study.py"), f"--preset={preset}",
         "--size=smoke",
         f"--init_checkpoint={warm_start}", f"--out_dir={out_dir}", "--progress", *args],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def rows_of(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def assert_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC, f"{path} is not a PNG"


def test_staleness_sweep_smoke_and_resume(warm_start, tmp_path):
    out = tmp_path / "sweep"
    stdout = run("staleness_sweep", warm_start, out)
    assert "skipped: grpo 4x1" in stdout
    rows = rows_of(out / "results.csv")
    assert [c for c in rows[0]] == list(sweeps.RESULT_COLUMNS)
    # sao x {4x1, 2x2} + grpo x {2x2}, each at k = 0 and 1
    assert sorted((r["method"], r["batch_shape"], r["max_staleness"]) for r in rows) == sorted(
        (m, s, k) for m, s in (("sao", "4x1"), ("sao", "2x2"), ("grpo", "2x2")) for k in "01")
    for r in rows:
        assert r["status"] == "ok" and r["steps"] == "3" and r["collapsed"] in ("yes", "no")
        k = int(r["max_staleness"])
        train = read_metrics(r["run_dir"], "train")
        # forced mode: every step trained exactly min(version, k) stale
        assert [t["staleness_max"] for t in train] == [min(v, k) for v in range(3)]
        assert float(r["mean_staleness"]) == pytest.approx(sum(min(v, k) for v in range(3)) / 3,
                                                         rel=1e-5)
        assert r["algorithm"] == ("grpo" if r["method"] == "grpo" else "sao")
        for key in ("final_reward", "final_eval_accuracy", "mean_kl", "mean_masked_frac",
                    "mean_ess"):
            float(r[key])
    assert_png(out / "reward_vs_step.png")
    assert_png(out / "drift_vs_staleness.png")
    before = {r["run_dir"]: os.path.getmtime(os.path.join(r["run_dir"], "summary.json"))
              for r in rows}
    again = run("staleness_sweep", warm_start, out)
    assert again.count("done earlier, skipped") == len(rows)
    assert rows_of(out / "results.csv") == rows
    for run_dir, mtime in before.items():
        assert os.path.getmtime(os.path.join(run_dir, "summary.json")) == mtime


def test_value_pretrain_sweep_smoke(warm_start, tmp_path):
    out = tmp_path / "vp"
    run("value_pretrain_sweep", warm_start, out)
    rows = rows_of(out / "results.csv")
    assert sorted(r["value_pretrain_rollouts"] for r in rows) == ["0", "24"]
    for r in rows:
        done = read_metrics(r["run_dir"], "value_pretrain_done")
        assert len(done) == (r["value_pretrain_rollouts"] == "24")
        if done:   # the fit's evaluations (one per epoch, the first before any step)
            assert done[0]["rollouts"] == 24
            assert len(read_metrics(r["run_dir"], "value_pretrain")) == done[0]["evaluations"]
        assert (r["pretrain_final_ev"] != "") == (r["value_pretrain_rollouts"] == "24")
        float(r["early_ev"])
    assert_png(out / "value_pretrain.png")


def test_online_shift_smoke(warm_start, tmp_path):
    out = tmp_path / "shift"
    stdout = run("online_shift_sweep", warm_start, out)
    assert "steps to recover" in stdout
    rows = rows_of(out / "results.csv")
    assert sorted((r["method"], r["batch_shape"]) for r in rows) == [
        ("grpo", "2x2"), ("sao", "2x2"), ("sao", "4x1")]
    shifts = rows_of(out / "recovery.csv")
    assert len(shifts) == len(rows)  # max_steps 4, shift every 2: one shift per run
    assert all(s["shift_step"] == "2" and s["to_phase"] == "1" for s in shifts)
    for r in rows:
        with open(os.path.join(r["run_dir"], "config.json")) as f:
            assert '"task": "online_shift"' in f.read()
    assert_png(out / "online_shift.png")


def test_recovery_counts_steps_until_the_moving_average_is_back():
    from experiments.sweep_presets.online_shift import recovery
    rewards = {s: r for s, r in enumerate(
        [0.8, 0.8, 0.8, 0.8, 0.2, 0.4, 0.75, 0.8, 0.3, 0.3, 0.3, 0.3], start=1)}
    evals = {0: 0.5, 2: 0.9, 4: 0.3, 6: 0.85, 8: 0.2, 10: 0.2, 12: 0.1}
    got = recovery(rewards, shift_every=4, max_steps=12, window=1, fraction=0.9,
                   eval_by_step=evals)
    assert [g["steps_to_recover"] for g in got] == [3, None]  # 0.75 >= 0.72 at step 7
    assert got[0]["pre_level"] == pytest.approx(0.8) and got[0]["dip"] == pytest.approx(0.2)
    assert got[0]["dip_step"] == 5
    late = {**rewards, 5: 0.8, 6: 0.2}  # the fall comes late (stale rollouts): from it
    assert recovery(late, 4, 12, 1, 0.9)[0]["steps_to_recover"] == 3
    assert recovery({1: 0.5, 2: 0.5, 3: 0.49, 4: 0.5}, 2, 4, 1, 0.9)[0]["steps_to_recover"] == 0
    assert got[0]["phase_mean_reward"] == pytest.approx((0.2 + 0.4 + 0.75 + 0.8) / 4)
    # eval: 0.9 before the shift at 4, 0.3 at it, 0.85 >= 0.81 two versions later
    assert (got[0]["eval_pre"], got[0]["eval_at_shift"], got[0]["eval_steps_to_recover"]) == \
        (0.9, 0.3, 2)
    assert got[1]["eval_steps_to_recover"] is None  # 0.85 before 8; 0.2, 0.2 after
