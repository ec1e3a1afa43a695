"""Shared fixtures: a warm-start checkpoint for the program tests; offline hub settings."""
import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# No model hub is reachable: a stray hub id must fail at once, not after a minute of retries.
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")

# The start-up cache (sao_actor_learner/disk_cache.py) of the tests is their own, removed at the
# end: a developer's ~/.cache is neither read nor filled.
if "SAO_CACHE_DIR" not in os.environ:
    os.environ["SAO_CACHE_DIR"] = tempfile.mkdtemp(prefix="sao-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SAO_CACHE_DIR"], True)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tests mirror the package's folders; the fixture modules (tests/*_fixtures.py) and the test
# modules other tests reuse (e.g. test_replay's rollouts) are imported by bare name from any of
# them, and from the processes they spawn (multiprocessing hands sys.path on).
_TESTS = os.path.dirname(os.path.abspath(__file__))
for _folder in sorted(os.listdir(_TESTS)):
    if os.path.isdir(os.path.join(_TESTS, _folder)) and not _folder.startswith(("_", ".")):
        sys.path.insert(0, os.path.join(_TESTS, _folder))
sys.path.insert(0, _TESTS)
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
