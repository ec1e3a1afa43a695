"""MetricsLogger: JSON rows and TensorBoard scalars, without TensorFlow in processes that do not
load it (the evaluator: ~380 MB less, programs/benchmarks/memory.py)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_metrics_logger_writes_tensorboard_events_without_importing_tensorflow(tmp_path):
    code = f"""
import sys
from sao_actor_learner.observers import MetricsLogger
logger = MetricsLogger({str(tmp_path)!r}, "evaluator", default_kind="eval")
for v, acc in [(0, 0.25), (10, 0.75)]:
    logger.write({{"policy_version": v, "eval_accuracy": acc}})
logger.close()
print("tensorflow" in sys.modules, "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["eval_accuracy"] for r in rows] == [0.25, 0.75]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb" / "evaluator"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/eval_accuracy")] == [(0, 0.25),
                                                                               (10, 0.75)]
