"""Run observers: metrics.jsonl, TensorBoard, progress display and the run summary."""
from sao_actor_learner.observers.metrics import MetricsLogger, read_metrics, write_json_atomic
