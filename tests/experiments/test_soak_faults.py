"""The soak test's fault machinery (experiments/soak_faults.py) on its own: the stall and
drain-detection bookkeeping on made-up progress samples, and the check for a stopped process on
a real one. The whole soak runs in test_faults.py."""
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from experiments import soak_faults  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _monitor(samples):
    monitor = soak_faults.ProgressMonitor("/nonexistent")
    monitor.samples = list(samples)
    return monitor


def test_stalls_are_the_times_without_a_new_step_minus_deliberate_pauses():
    # (time, newest step, loss epoch): steps at 0-2 s, nothing new from 2 s to 12 s, then a
    # step again; a resume pause from 20 s to 30 s inside the second gap (12 s -> 40 s).
    samples = [(0.0, 1, 0), (1.0, 2, 0), (2.0, 3, 0), (7.0, 3, 0), (12.0, 4, 0),
               (20.0, 4, 0), (30.0, 4, 1), (40.0, 5, 1)]
    stalls = _monitor(samples).stalls(pauses=[(20.0, 30.0)])
    assert [(s["from_step"], s["s"]) for s in stalls] == [(4, 18.0), (3, 10.0), (1, 1.0),
                                                           (2, 1.0)]
    assert _monitor(samples).stalls()[0]["s"] == 28.0
    assert _monitor([]).stalls() == []


def test_loss_epoch_after_a_drain():
    samples = [(0.0, 1, 2), (5.0, 2, 2), (9.0, 3, 3), (12.0, 4, 3)]
    monitor = _monitor(samples)
    assert monitor.loss_epoch_after(4.0) == 5.0     # epoch 2 at the drain, 3 at 9 s
    assert monitor.loss_epoch_after(10.0) is None   # never higher than at 10 s
    assert monitor.step() == 4


def test_stopped_tells_a_stopped_process_from_a_running_or_gone_one():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not soak_faults.process_stopped(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not soak_faults.process_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert soak_faults.process_stopped(child.pid)
        os.kill(child.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while soak_faults.process_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not soak_faults.process_stopped(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not soak_faults.process_stopped(child.pid)      # gone
