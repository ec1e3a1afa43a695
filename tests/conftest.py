"""Shared fixtures: a warm-start checkpoint for the program tests."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WARM_START = os.path.join(REPO, "checkpoints", "warm_start")


@pytest.fixture(scope="session")
def warm_start(tmp_path_factory):
    """The warm start `make` builds; else a quickly trained one (fewer steps, less accurate)."""
    if os.path.exists(os.path.join(DEFAULT_WARM_START, "config.json")):
        return DEFAULT_WARM_START
    out = str(tmp_path_factory.mktemp("warm_start"))
    subprocess.run([sys.executable, os.path.join(REPO, "programs", "sft.py"), f"--out_dir={out}",
                    "--steps=300", "--num_eval=50", "--eval_samples=1"], check=True, cwd=REPO,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out
