"""Smoke test of programs/benchmarks/weight_sync.py: a tiny model through the real variable
server (its own process), a fetching client process, a bare gRPC server and a raw socket
receiver process; checks the JSON line that ends the table has every figure and that the
figures are consistent with each other."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(120)

ROW_KEYS = {"size", "params", "tensors", "dtype", "payload_bytes", "ours_gbps", "ours_gbps_min",
            "ours_gbps_max", "ours_s", "raw_gbps", "raw_gbps_min", "raw_gbps_max", "raw_s",
            "ratio", "ratio_without_serialize", "serialize_s", "publish_s", "held_after_publish_s",
            "server_peak_rss_mb", "client_peak_rss_mb", "raw_receiver_peak_rss_mb",
            "bare_grpc_gbps", "bare_grpc_gbps_min", "bare_grpc_gbps_max", "bare_grpc_ratio",
            "bare_grpc_server_peak_rss_mb"}


def test_weight_sync_benchmark_smoke():
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "programs", "benchmarks", "weight_sync.py"),
         "--sizes=300K,1M", "--repeats=2", "--warmup=1"],
        cwd=REPO, capture_output=True, text=True, timeout=110,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert any("bare gRPC GB/s" in line for line in lines[:-1])     # the table came first
    assert figures["benchmark"] == "weight_sync" and figures["dtype"] == "bf16"
    assert figures["target_ratio"] == 0.5 and len(figures["rows"]) == 2
    for row, label in zip(figures["rows"], ("300K", "1M")):
        assert ROW_KEYS <= set(row) and row["size"] == label
        # bf16: 2 bytes a parameter plus the safetensors header.
        header_room = 64 * row["tensors"] + 4096
        assert 2 * row["params"] < row["payload_bytes"] < 2 * row["params"] + header_room
        assert 0 < row["ours_gbps_min"] <= row["ours_gbps"] <= row["ours_gbps_max"]
        assert 0 < row["raw_gbps_min"] <= row["raw_gbps"] <= row["raw_gbps_max"]
        assert 0 < row["bare_grpc_gbps_min"] <= row["bare_grpc_gbps"] <= row["bare_grpc_gbps_max"]
        assert row["ratio"] == pytest.approx(row["ours_gbps"] / row["raw_gbps"])
        assert row["bare_grpc_ratio"] == pytest.approx(row["bare_grpc_gbps"] / row["raw_gbps"])
        assert row["ratio_without_serialize"] >= row["ratio"] * 0.999
        assert row["ours_s"] > row["serialize_s"] >= 0 and row["publish_s"] > 0
        assert -row["publish_s"] < row["held_after_publish_s"] < row["ours_s"]
        assert row["ours_s"] == pytest.approx(row["payload_bytes"] / row["ours_gbps"] / 1e9)
        for rss in ("server_peak_rss_mb", "client_peak_rss_mb", "raw_receiver_peak_rss_mb",
                    "bare_grpc_server_peak_rss_mb"):
            assert 10 < row[rss] < 8000, (rss, row[rss])
    assert figures["min_ratio"] == min(r["ratio"] for r in figures["rows"])
    assert figures["target_met"] == (figures["min_ratio"] >= 0.5)
    assert figures["rows"][1]["params"] > figures["rows"][0]["params"]
