"""Runs a study's unfinished cells several at a time, each in a Python process of its own.

`programs/study.py --workers=N`: a program run in local_mt mode keeps about one core busy (its
nodes are threads under one GIL), so on a 2-core machine two cells side by side finish the grid
in about half the time. Every cell is one fresh interpreter (`python -m experiments.studies.pool
CONFIG_JSON_PATH`, see `main`) that runs `run.run_program` on the config and exits, so runs never
share a process, a port or a torch thread pool. What a cell prints goes to
`<log_dir>/<cell>.log`, beside the config it ran (`<cell>.config.json`).

This module only runs cells; it decides nothing. study.py then builds every study's tables from
the finished folders exactly as after a one-at-a-time run (sweeps.finished_summary), and runs
again, one at a time, any cell that failed here.
"""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import threading
import time
from typing import Dict, Sequence, TextIO

from sao_actor_learner.config import SAOConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_in_processes(configs: Sequence[SAOConfig], workers: int, log_dir: str,
                     out: TextIO = sys.stdout, progress: bool = True) -> Dict[str, int]:
    """Runs every config (distinct run_dirs; the caller leaves out finished ones) with at most
    `workers` at once; returns {run_dir: exit status}."""
    if workers < 1:
        raise ValueError(f"workers={workers}: must be >= 1")
    dirs = [c.run_dir for c in configs]
    if len(set(dirs)) != len(dirs):
        raise ValueError("two configs share a run_dir: each cell must run once")
    os.makedirs(log_dir, exist_ok=True)
    lock, done, t0 = threading.Lock(), [0], time.time()

    def one(config: SAOConfig) -> int:
        name = os.path.basename(os.path.normpath(config.run_dir))
        config_path = os.path.join(log_dir, f"{name}.config.json")
        with open(config_path, "w") as f:
            f.write(config.to_json())
        with open(os.path.join(log_dir, f"{name}.log"), "w") as log:
            rc = subprocess.call([sys.executable, "-m", "experiments.studies.pool", config_path],
                                 cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        with lock:
            done[0] += 1
            if progress:
                status = "ok" if rc == 0 else f"failed (exit {rc}; log {log.name})"
                out.write(f"[{done[0]}/{len(configs)}, {time.time() - t0:.0f}s] {name}: "
                          f"{status}\n")
                out.flush()
        return rc

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(dirs, pool.map(one, configs)))


def main(argv: Sequence[str]) -> int:
    """One cell: `python -m experiments.studies.pool CONFIG_JSON_PATH` (a SAOConfig.to_json)."""
    if len(argv) != 2:
        sys.stderr.write("usage: python -m experiments.studies.pool CONFIG_JSON_PATH\n")
        return 2
    from sao_actor_learner.builder import make_program
    from sao_actor_learner.run import run_program

    with open(argv[1]) as f:
        config = SAOConfig.from_json(f.read())
    run_program(config, make_program, progress=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
