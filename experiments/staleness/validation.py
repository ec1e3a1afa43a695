"""The planner against measured runs (programs/benchmarks/validate_planner.py).

Each configuration (a limit, a number of actors, an injected delay or none) runs the whole
program once with generate-call logs (the tuner's measure_run reads its throughput and mean
staleness); then the planner simulates the same configuration with
  self         the costs and lengths fitted to that run (inputs.fit_costs, run:DIR): does the
               loop model (admission, queue, drops, overlap) turn measured part speeds into the
               measured throughput and staleness?
  calibration  the costs and lengths of the first configuration's run only: can one run
               predict the others (on a machine where the parts share cores, contention differs
               between layouts, which this column shows)?
Errors: |predicted - measured| / measured for throughput; for mean staleness / max(measured, 1)
version, since lock-step's is 0. The target: both within 15% on every configuration.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, List, Optional, Sequence

from experiments.staleness import planner
from experiments.staleness.inputs import fit_costs, lengths_from_run
from experiments.staleness.tuner import measure_run
from sao_actor_learner.config import ConfigError, SAOConfig

TARGET = 0.15


@dataclasses.dataclass(frozen=True)
class Case:
    limit: int
    actors: int
    delay: str       # none or an actors/delays kind

    @property
    def name(self) -> str:
        return f"eta{self.limit}_a{self.actors}_{self.delay}"


# >= 8 configurations: limits 0..8, 1-4 actors, with and without the heavy-tailed delay.
DEFAULT_CASES = ("0:1:none", "1:1:none", "4:1:none", "0:2:none", "2:2:none", "8:2:none",
                 "0:2:heavy_tailed", "1:2:heavy_tailed", "4:2:heavy_tailed",
                 "8:4:heavy_tailed", "2:4:none", "4:3:heavy_tailed")


def parse_cases(entries: Sequence[str], flag: str = "--cases") -> List[Case]:
    cases = []
    for entry in entries:
        try:
            k, a, d = entry.split(":")
            case = Case(int(k), int(a), d)
        except ValueError:
            raise ConfigError(f"{flag} entry {entry!r}: write LIMIT:ACTORS:DELAY, e.g. "
                              "4:2:heavy_tailed") from None
        if case.limit < 0 or case.actors < 1 or case.delay not in (
                "none", "fixed", "uniform", "heavy_tailed"):
            raise ConfigError(f"{flag} entry {entry!r}: needs LIMIT >= 0, ACTORS >= 1 and "
                              "DELAY one of none, fixed, uniform, heavy_tailed")
        cases.append(case)
    if not cases:
        raise ConfigError(f"{flag} is empty: give at least one LIMIT:ACTORS:DELAY")
    return cases


def case_config(base: SAOConfig, case: Case, delay_mean_s: float, out_dir: str) -> SAOConfig:
    return base.replace(lockstep=case.limit == 0, max_staleness=case.limit,
                        num_actors=case.actors, actor_delay=case.delay,
                        actor_delay_mean_s=0.0 if case.delay == "none" else delay_mean_s,
                        run_dir=os.path.join(out_dir, "runs", case.name))


def _error(predicted: float, measured: float, floor: float = 0.0) -> float:
    return abs(predicted - measured) / max(abs(measured), floor, 1e-12)


def predict(config: SAOConfig, costs_run: str, seeds: int) -> Dict[str, float]:
    costs, _ = fit_costs(costs_run)
    lengths = lengths_from_run(costs_run, "--from_run", config.max_new_tokens or 0)
    rows = planner.curve(planner.Setting.from_config(config), costs, lengths,
                         [config.max_staleness], seeds)
    return rows[0]


def validate(base: SAOConfig, cases: Sequence[Case], delay_mean_s: float, out_dir: str,
             run_fn: Callable[[SAOConfig], Dict], seeds: int = 3, out=None) -> List[Dict]:
    """Runs every case (skipping one already finished with the same config), then compares;
    one row per case."""
    from experiments import sweeps
    configs = [case_config(base, c, delay_mean_s, out_dir) for c in cases]
    measured = []
    for i, (case, config) in enumerate(zip(cases, configs)):
        summary = sweeps.finished_summary(config)
        if out is not None:
            out.write(f"[{i + 1}/{len(cases)}] {case.name}"
                      f"{': done earlier, read' if summary else ''}\n")
            out.flush()
        if summary is None:
            summary = run_fn(config)
        measured.append(measure_run(config, summary))
    reference = configs[0].run_dir
    rows = []
    for case, config, m in zip(cases, configs, measured):
        own = predict(config, config.run_dir, seeds)
        ref = predict(config, reference, seeds)
        row = {"case": case.name, "limit": case.limit, "actors": case.actors,
               "delay": case.delay, "measured_rollouts_per_s": m["rollouts_per_s"],
               "measured_staleness": m["staleness_rollout_mean"] or 0.0,
               "load_avg_1m": m["load_avg_1m"]}
        for tag, p in (("self", own), ("calibration", ref)):
            row[f"{tag}_rollouts_per_s"] = p["rollouts_per_s"]
            row[f"{tag}_staleness"] = p["staleness_rollout_mean"]
            row[f"{tag}_throughput_error"] = _error(p["rollouts_per_s"], m["rollouts_per_s"])
            row[f"{tag}_staleness_error"] = _error(p["staleness_rollout_mean"],
                                                   row["measured_staleness"], 1.0)
        row["self_within_target"] = (row["self_throughput_error"] <= TARGET and
                                     row["self_staleness_error"] <= TARGET)
        rows.append(row)
    return rows


def markdown(rows: Sequence[Dict], command: str, reference: Optional[str] = None) -> str:
    met = sum(r["self_within_target"] for r in rows)
    lines = ["# Staleness planner against measured runs", "", "```", command, "```", "",
             f"{met} of {len(rows)} configurations within {TARGET:.0%} on both throughput and "
             "mean staleness (self-calibrated). 'calibration': every prediction from the costs "
             f"of the first configuration's run{f' ({reference})' if reference else ''}.", "",
             "| config | measured rollouts/s | self | err | calibration | err | measured "
             "staleness | self | err | calibration | err | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['measured_rollouts_per_s']:.2f} | {r['self_rollouts_per_s']:.2f}"
            f" | {r['self_throughput_error']:.0%} | {r['calibration_rollouts_per_s']:.2f} | "
            f"{r['calibration_throughput_error']:.0%} | {r['measured_staleness']:.2f} | "
            f"{r['self_staleness']:.2f} | {r['self_staleness_error']:.0%} | "
            f"{r['calibration_staleness']:.2f} | {r['calibration_staleness_error']:.0%} | "
            f"{r['load_avg_1m']:.1f} |")
    return "\n".join(lines) + "\n"
