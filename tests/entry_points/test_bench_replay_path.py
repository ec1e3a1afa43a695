"""Smoke test of programs/benchmarks/replay_path.py: every path (raw, raw_packed, ours with the
signature checked, ours_unsigned) on tiny settings through a real Reverb server in its own process (each
path checks that its rollouts came back complete, in order and unchanged); checks the table came
first and the JSON line's figures are consistent. Never a speed threshold."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(300)
PATHS = ("raw", "raw_packed", "ours", "ours_unsigned")
RAW = ("raw", "raw_packed")


def test_replay_path_benchmark_smoke():
    n = 48
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "programs", "benchmarks", "replay_path.py"),
         f"--num_items={n}", "--repeats=2", "--min_len=100", "--max_len=300",
         "--max_sequence_length=512", "--vocab_size=1000", "--actor_batch=8", "--batch=16"],
        cwd=REPO, capture_output=True, text=True, timeout=280,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    header = [i for i, line in enumerate(lines) if line.startswith("path")
              and "write+read/s" in line]
    assert len(header) == 1, out.stdout
    rows = [line.split()[0] for line in lines[header[0] + 1:header[0] + 1 + len(PATHS)]]
    assert rows == list(PATHS), out.stdout      # one table row per path, in order
    assert not any(key.startswith(("ours_plain", "before", "ratio_before", "ratio_ours_plain"))
                   for key in figures)
    assert figures["benchmark"] == "replay_path" and figures["num_items"] == n
    assert 100 <= figures["mean_tokens"] <= 300 and figures["repeats"] == 2
    for path in PATHS:
        for key in ("write", "read", "write_read"):
            best = figures[f"{path}_{key}_per_s"]
            assert 0 < figures[f"{path}_{key}_per_s_min"] <= \
                figures[f"{path}_{key}_per_s_median"] <= best
            for raw in RAW:
                assert figures[f"ratio_{path}_over_{raw}_{key}"] == pytest.approx(
                    best / figures[f"{raw}_{key}_per_s"], abs=2e-3)
        # write+read over both phases is slower than either phase alone
        assert figures[f"{path}_write_read_per_s"] <= min(
            figures[f"{path}_write_per_s"], figures[f"{path}_read_per_s"]) + 1
    for key in ("write", "read", "write_read"):
        assert figures[f"ratio_ours_over_ours_unsigned_{key}"] == pytest.approx(
            figures[f"ours_{key}_per_s"] / figures[f"ours_unsigned_{key}_per_s"], abs=2e-3)
    best_raw = max(RAW, key=lambda raw: figures[f"{raw}_write_read_per_s"])
    assert figures["best_raw"] == best_raw
    assert figures["ratio_ours_over_best_raw_write_read"] == \
        figures[f"ratio_ours_over_{best_raw}_write_read"]
    assert figures["target_ratio"] == 0.7
    assert figures["target_met"] == (figures["ratio_ours_over_best_raw_write_read"] >= 0.7)
    assert figures["load_avg_1m_start"] >= 0 and figures["load_avg_1m_end"] >= 0
    # The signatures' cost against what the target leaves over the best raw loop.
    raw_us = 1e6 / figures[f"{best_raw}_write_read_per_s"]
    assert figures["hmac_sign_and_verify_us_per_item"] > 0
    assert figures["target_budget_us_per_item"] == pytest.approx(raw_us / 0.7 - raw_us, abs=0.2)
    assert "signing + verifying alone" in out.stdout
