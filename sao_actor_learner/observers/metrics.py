"""metrics.jsonl and TensorBoard, written side by side.

Several processes (learner, evaluator) append to the same metrics.jsonl: each row is one
`os.write` of one line on an O_APPEND descriptor, which Linux keeps whole for regular files.
Rows carry a `kind`: "train" (one per learner step), "eval" (evaluations) or "value_pretrain".
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Dict, Iterator, List, Optional

from absl import logging


def _jsonable(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsLogger:
    """Appends JSON rows to `<run_dir>/metrics.jsonl` and scalars to TensorBoard.

    tensorboard_subdir: TensorBoard events go to <run_dir>/tb/<subdir> (one writer per process).
    """

    def __init__(self, run_dir: str, tensorboard_subdir: Optional[str] = "learner",
                 default_kind: str = "train"):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._kind = default_kind
        self._tb = None
        if tensorboard_subdir:
            try:
                from sao_actor_learner.observers.tensorboard import SummaryWriter
                self._tb = SummaryWriter(os.path.join(run_dir, "tb", tensorboard_subdir))
            except Exception as e:  # noqa: BLE001 - TensorBoard is optional
                logging.warning("TensorBoard disabled: %s", e)

    def write(self, row: Dict) -> None:
        row = {"kind": self._kind, "time": time.time(), **row}
        row = {k: (_jsonable(v) if not isinstance(v, list) else [_jsonable(x) for x in v])
               for k, v in row.items()}
        os.write(self._fd, (json.dumps(row) + "\n").encode())
        if self._tb is not None:
            step = row.get("step", row.get("policy_version", 0))
            prefix = row["kind"]
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("time", "step"):
                    self._tb.add_scalar(f"{prefix}/{k}", v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_metrics(run_dir: str, kind: Optional[str] = None) -> List[Dict]:
    """All rows of `<run_dir>/metrics.jsonl` (optionally of one kind); skips a torn last line."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if kind is None or row.get("kind") == kind:
                rows.append(row)
    return rows


def write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
    os.replace(tmp, path)

