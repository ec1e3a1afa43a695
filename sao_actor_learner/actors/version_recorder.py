"""The version recorder (config evaluator=record): keeps policy versions for evaluation later.

The evaluator node evaluates while the run trains, on the same cores: its CPU time competes with
training, and a loaded evaluator skips to the newest version. A benchmark that wants the
training clock free of evaluation (docs/BENCHMARKS' budget mode, `programs/benchmarks/vs_trl.py
--mode=budget`) records instead: this node fetches every due version from the variable server,
as the evaluator would, and writes its weights (the safetensors payload as published) to
`<run_dir>/policy_versions/v<version>.safetensors`, with one line per version in
`policy_versions/index.jsonl` ({"version", "time", "bytes"}). `programs/evaluate_versions.py`
evaluates them afterwards with the evaluator's own greedy evaluation.

Due versions: 0 (the warm start, written from the first fetch), every `eval_every`-th, and
`max_steps` (after which the node finishes). A file is written to a temporary name and renamed,
so a run killed at any moment leaves only whole files.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Optional

from absl import logging

from sao_actor_learner import core

__all__ = ["VersionRecorder", "VERSIONS_DIR", "version_path", "read_index"]

VERSIONS_DIR = "policy_versions"


def version_path(run_dir: str, version: int) -> str:
    return os.path.join(run_dir, VERSIONS_DIR, f"v{version:06d}.safetensors")


def read_index(run_dir: str) -> list:
    """The recorded versions of `run_dir`, in the order written ([] when none)."""
    path = os.path.join(run_dir, VERSIONS_DIR, "index.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:   # a line cut by a kill
                continue
    return [r for r in rows if os.path.exists(version_path(run_dir, r["version"]))]


class VersionRecorder(core.Worker):
    """Fetches due versions from `variables` (a core.VariableFollower without a decode: its
    params are the published payloads) and writes them."""

    def __init__(self, variables: core.VariableFollower, run_dir: str, eval_every: int,
                 max_steps: int, poll_s: float = 0.05) -> None:
        self._variables = variables
        self._dir = os.path.join(run_dir, VERSIONS_DIR)
        self._run_dir = run_dir
        self._eval_every = eval_every
        self._max_steps = max_steps
        self._poll_s = poll_s
        self._stop = threading.Event()
        self.recorded: list = []
        os.makedirs(self._dir, exist_ok=True)

    def stop(self) -> None:
        self._stop.set()

    def _due(self, version: int) -> bool:
        if version < 0 or version in self.recorded:
            return False
        if not self.recorded or version >= self._max_steps:
            return True
        last = self.recorded[-1]
        return self._eval_every > 0 and version // self._eval_every > last // self._eval_every

    def record(self, version: int, payload) -> None:
        data = bytes(payload)
        path = version_path(self._run_dir, version)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        with open(os.path.join(self._dir, "index.jsonl"), "a") as f:
            f.write(json.dumps({"version": version, "time": time.time(), "bytes": len(data)})
                    + "\n")
        self.recorded.append(version)
        logging.info("recorded policy version %d (%d bytes)", version, len(data))

    def run(self) -> None:
        while not self._stop.is_set() and self._max_steps not in self.recorded:
            self._variables.update()
            version, payload = self._variables.get_variables()
            if payload is not None and self._due(version):
                self.record(version, payload)
            else:
                time.sleep(self._poll_s)

