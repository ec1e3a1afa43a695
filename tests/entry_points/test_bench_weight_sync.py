"""Smoke test of programs/benchmarks/weight_sync.py: a tiny model through the real variable
server (its own process, a second one for the previous two-hop path), a local client (shared
memory) and a remote one (gRPC) in their own processes, a bare gRPC server and a raw socket
receiver; checks that the JSON line ending the tables has every figure and that the figures are
consistent with each other. Never a threshold: the figures depend on the machine's load."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(180)

PATHS = ("shm", "memcpy", "ours", "raw", "two_hop", "bare_grpc", "bare_get")
ROW_KEYS = {"size", "params", "tensors", "dtype", "payload_bytes", "shm_ratio", "ratio",
            "ratio_without_serialize", "two_hop_ratio", "bare_grpc_ratio", "bare_get_ratio",
            "serialize_s", "publish_s", "held_after_publish_s", "local_client_counters",
            "server_shm_published", "server_peak_rss_mb", "client_peak_rss_mb",
            "local_client_peak_rss_mb", "raw_receiver_peak_rss_mb",
            "bare_grpc_server_peak_rss_mb"} | {
    f"{path}_{k}" for path in PATHS for k in ("gbps", "gbps_min", "gbps_max", "s")} | {
    f"{path}_{k}" for path in ("shm", "ours", "two_hop")
    for k in ("serialize_s", "publish_s", "held_after_publish_s")}


def test_weight_sync_benchmark_smoke():
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "programs", "benchmarks", "weight_sync.py"),
         "--sizes=300K,1M", "--repeats=2", "--warmup=1"],
        cwd=REPO, capture_output=True, text=True, timeout=170,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert any("shm/memcpy" in line for line in lines[:-1])        # the tables came first
    assert any("bare gRPC GB/s" in line for line in lines[:-1])
    assert figures["benchmark"] == "weight_sync" and figures["dtype"] == "bf16"
    assert figures["target_ratio"] == 0.5 and len(figures["rows"]) == 2
    for row, label in zip(figures["rows"], ("300K", "1M")):
        assert ROW_KEYS <= set(row) and row["size"] == label
        # bf16: 2 bytes a parameter plus the safetensors header.
        header_room = 64 * row["tensors"] + 4096
        assert 2 * row["params"] < row["payload_bytes"] < 2 * row["params"] + header_room
        for path in PATHS:
            assert 0 < row[f"{path}_gbps_min"] <= row[f"{path}_gbps"] <= row[f"{path}_gbps_max"]
            assert row[f"{path}_s"] == pytest.approx(row["payload_bytes"] / row[f"{path}_gbps"]
                                                     / 1e9)
        assert row["shm_ratio"] == pytest.approx(row["shm_gbps"] / row["memcpy_gbps"])
        assert row["ratio"] == pytest.approx(row["ours_gbps"] / row["raw_gbps"])
        for path in ("two_hop", "bare_grpc", "bare_get"):
            assert row[f"{path}_ratio"] == pytest.approx(row[f"{path}_gbps"] / row["raw_gbps"])
        assert row["ratio_without_serialize"] >= row["ratio"] * 0.999
        for path in ("shm", "ours", "two_hop"):
            assert row[f"{path}_s"] > row[f"{path}_serialize_s"] >= 0
            assert row[f"{path}_publish_s"] > 0
            assert -row[f"{path}_publish_s"] < row[f"{path}_held_after_publish_s"] < row[
                f"{path}_s"]
        assert row["publish_s"] == row["ours_publish_s"]
        # Every timed round reached the local actor through shared memory (the benchmark
        # refuses to go on otherwise); the server saw every shm publish as one.
        assert row["local_client_counters"] == {"shm_loads": 2}
        assert row["server_shm_published"] >= 2 * 3
        writer = row["shm_writer_counters"]
        assert writer["written"] == writer["created"] + writer.get("reused", 0) >= 2 * 3
        for rss in ("server_peak_rss_mb", "client_peak_rss_mb", "local_client_peak_rss_mb",
                    "raw_receiver_peak_rss_mb", "bare_grpc_server_peak_rss_mb"):
            assert 10 < row[rss] < 8000, (rss, row[rss])
    assert figures["min_ratio"] == min(r["ratio"] for r in figures["rows"])
    assert figures["min_shm_ratio"] == min(r["shm_ratio"] for r in figures["rows"])
    assert figures["remote_target_met"] == (figures["min_ratio"] >= 0.5)
    assert figures["shm_target_met"] == (figures["min_shm_ratio"] >= 0.5)
    assert figures["target_met"] == (figures["remote_target_met"] and figures["shm_target_met"])
    assert figures["rows"][1]["params"] > figures["rows"][0]["params"]
