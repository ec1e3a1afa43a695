"""The drift knobs in the learner's metrics rows: every training row carries the run's drift
labels (config/drift.knob_record), and with task=preference_drift the preference weight of the
version the step trained (reward_preference_weight), so a metrics file read alone says which
drift experiment made it.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

from sao_actor_learner.config.drift import knob_record

# The knob record's fields each training row repeats (the rest are in config.json and
# summary.json): the label, the lag law and its exact mean, the actors' precision and sampling.
ROW_FIELDS = ("drift_experiment", "forced_staleness_distribution", "forced_lag_mean",
              "actor_dtype", "actor_temperature", "actor_top_p")


class LabelledMetrics:
    """A MetricsLogger (`write`, `close`) whose training rows (rows without a "kind") get the
    drift labels and, given `preference_weight`, reward_preference_weight = w(policy_version - 1)
    (the step's row names the version it produced)."""

    def __init__(self, logger, labels: Dict[str, object],
                 preference_weight: Optional[Callable[[int], float]] = None):
        self._logger = logger
        self._labels = {k: v for k, v in labels.items() if v is not None}
        self._weight = preference_weight

    def write(self, row: Dict) -> None:
        if "kind" not in row:
            row = {**self._labels, **row}
            if self._weight is not None and "policy_version" in row:
                row["reward_preference_weight"] = self._weight(int(row["policy_version"]) - 1)
        self._logger.write(row)

    def close(self) -> None:
        self._logger.close()


def label_learner_metrics(config, logger):
    """`logger` wrapped in LabelledMetrics for `config`'s drift knobs (None stays None)."""
    if logger is None:
        return None
    record = knob_record(config)
    weight = None
    if config.task == "preference_drift":
        from sao_actor_learner.tasks.preference_drift import weight_of_config
        weight = weight_of_config(config)
    return LabelledMetrics(logger, {k: record[k] for k in ROW_FIELDS}, weight)
