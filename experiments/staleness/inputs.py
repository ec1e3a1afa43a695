"""The planner's inputs: the response-length distribution and the cost model, given or measured.

A length distribution (`--lengths`, response tokens per rollout; `parse_lengths`):
  fixed:L              every response L tokens
  uniform:LO,HI        uniform on [LO, HI]
  exponential:MEAN     exponential with that mean
  lognormal:MEAN,SIGMA log-normal with that mean and log-space sigma (a long tail)
  pareto:MEAN,TAIL     Pareto II (Lomax) with that mean and shape TAIL > 1 (TAIL <= 1 has no
                       finite mean and is refused)
  file:PATH            the `lengths` (minus `prompt_lengths`) of programs/benchmarks/
                       rollout_lengths.py's JSON, or a `response_lengths` list, or a bare list
  run:DIR              the per-generation lengths a run's generate-call logs recorded
                       (experiments/benchmarks/generate_log.py); without them, the batch means of
                       its metrics (response_length_mean: the spread is underestimated)
Every draw is capped at `cap` tokens (the config's max_new_tokens when it is set).

The cost model (`Costs`, every time in seconds):
  generation call   gen_call_s + gen_token_s * sum(L) + gen_step_s * max(L), for the L of the
                    rollouts an actor generates together (gen_step_s: the batch waits for its
                    longest response, as a batched engine does)
  learner step      learner_step_s + learner_token_s * (batch tokens: prompt + response), and
                    learner_other_s between steps (checkpoints, the critic's yardstick: the
                    loop's time outside its logged steps)
  weight sync       publish_s on the learner per version, load_s on an actor per version it
                    loads
`fit_costs(run_dir)` fits them to a finished run: generation to its generate-call logs (least
squares, non-negative), the learner to its train rows (busy time = step_time_s - wait_s -
publish_s against the batch's tokens; learner_other_s the mean time between one step's row and
the next step's start), weight sync to publish_s and the actors' weight_load_s.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

LENGTH_KINDS = ("fixed", "uniform", "exponential", "lognormal", "pareto", "file", "run")


class PlanError(ValueError):
    """A planner input that cannot be used; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Response lengths in tokens: a parametric kind with its parameters, or `values`."""
    kind: str
    params: Tuple[float, ...] = ()
    values: Tuple[float, ...] = ()
    cap: float = math.inf
    source: str = ""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.params[0])
        elif self.kind == "uniform":
            x = rng.uniform(self.params[0], self.params[1], size=n)
        elif self.kind == "exponential":
            x = rng.exponential(self.params[0], size=n)
        elif self.kind == "lognormal":
            mean, sigma = self.params
            x = rng.lognormal(math.log(mean) - sigma * sigma / 2.0, sigma, size=n)
        elif self.kind == "pareto":
            mean, tail = self.params
            x = mean * (tail - 1.0) * rng.pareto(tail, size=n)
        else:
            x = rng.choice(np.asarray(self.values, dtype=np.float64), size=n)
        return np.minimum(np.maximum(x, 1.0), self.cap)

    def mean(self, samples: int = 200_000) -> float:
        """The mean after the cap (exact for fixed and empirical lengths, else sampled)."""
        if self.values:
            return float(np.minimum(self.values, self.cap).mean())
        if self.kind == "fixed":
            return min(self.params[0], self.cap)
        return float(self.sample(np.random.default_rng(0), samples).mean())

    def describe(self) -> str:
        cap = "" if math.isinf(self.cap) else f", capped at {self.cap:g}"
        if self.values:
            v = np.asarray(self.values)
            return (f"{len(v)} measured lengths from {self.source or self.kind} (mean "
                    f"{v.mean():.1f}, p50 {np.percentile(v, 50):.0f}, p99 "
                    f"{np.percentile(v, 99):.0f}, max {v.max():.0f}){cap}")
        return f"{self.kind}:{','.join(f'{p:g}' for p in self.params)}{cap}"


def _numbers(text: str, count: int, flag: str, spec: str) -> Tuple[float, ...]:
    parts = [p for p in text.split(",") if p.strip()]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != count or not all(math.isfinite(v) for v in values):
        raise PlanError(f"{flag}={spec!r}: needs {count} finite number(s) after the colon "
                        f"(e.g. {EXAMPLES[spec.split(':')[0]]})")
    return values


EXAMPLES = {"fixed": "fixed:128", "uniform": "uniform:16,256", "exponential": "exponential:200",
            "lognormal": "lognormal:4000,1.0", "pareto": "pareto:500,1.5"}


def empirical(values: Sequence[float], flag: str, source: str,
              cap: float = math.inf) -> LengthDistribution:
    """Measured lengths as a distribution; PlanError (naming `flag`) when there are none or
    one is not a finite number >= 0."""
    try:
        v = np.asarray([float(x) for x in values], dtype=np.float64)
    except (TypeError, ValueError):
        raise PlanError(f"{flag}: {source} holds lengths that are not numbers") from None
    if v.size == 0:
        raise PlanError(f"{flag}: {source} holds no lengths (an empty distribution); record "
                        "some rollouts first or give a parametric one, e.g. lognormal:500,0.8")
    if not np.all(np.isfinite(v)) or np.any(v < 0):
        raise PlanError(f"{flag}: {source} holds a length that is negative or not finite (the "
                        "distribution has no finite mean)")
    return LengthDistribution("empirical", values=tuple(v.tolist()), cap=cap, source=source)


def parse_lengths(spec: str, flag: str = "--lengths", cap: float = 0) -> LengthDistribution:
    """The distribution `spec` names (module docstring); PlanError naming `flag` when it is
    unknown, empty or has no finite mean. cap > 0 caps every draw."""
    cap = float(cap) if cap and cap > 0 else math.inf
    kind, _, rest = (spec or "").partition(":")
    kind = kind.strip().lower()
    if kind not in LENGTH_KINDS:
        raise PlanError(f"{flag}={spec!r}: must be KIND:PARAMETERS with KIND one of "
                        f"{', '.join(LENGTH_KINDS)} (e.g. lognormal:500,0.8)")
    if kind == "file":
        return lengths_from_file(rest, flag, cap)
    if kind == "run":
        return lengths_from_run(rest, flag, cap)
    count = {"fixed": 1, "exponential": 1}.get(kind, 2)
    params = _numbers(rest, count, flag, spec)
    if kind == "pareto" and params[1] <= 1.0:
        raise PlanError(f"{flag}={spec!r}: a Pareto shape <= 1 has no finite mean; use a shape "
                        "> 1 (1.5: a heavy tail with a finite mean) or lognormal:MEAN,SIGMA")
    if any(p < 0 for p in params) or params[0] <= 0:
        raise PlanError(f"{flag}={spec!r}: lengths and their parameters must be > 0")
    if kind == "uniform" and params[1] < params[0]:
        raise PlanError(f"{flag}={spec!r}: uniform:LO,HI needs LO <= HI")
    return LengthDistribution(kind, params, cap=cap)


def lengths_from_file(path: str, flag: str, cap: float = math.inf) -> LengthDistribution:
    """Response lengths from a JSON file (module docstring, `file:`)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise PlanError(f"{flag}=file:{path}: cannot read it as JSON ({e})") from None
    if isinstance(data, dict) and "response_lengths" in data:
        values = data["response_lengths"]
    elif isinstance(data, dict) and "lengths" in data:
        prompts = data.get("prompt_lengths") or [0] * len(data["lengths"])
        if len(prompts) != len(data["lengths"]):
            raise PlanError(f"{flag}=file:{path}: lengths and prompt_lengths differ in count")
        values = [a - p for a, p in zip(data["lengths"], prompts)]
    elif isinstance(data, list):
        values = data
    else:
        raise PlanError(f"{flag}=file:{path}: expected a list of lengths, or an object with "
                        "response_lengths, or lengths (and prompt_lengths)")
    return empirical(values, flag, f"file:{path}", cap)


def _generate_calls(run_dir: str) -> List[dict]:
    from experiments.benchmarks.generate_log import read_generate_calls
    if not os.path.isdir(run_dir):
        return []
    return [c for calls in read_generate_calls(run_dir).values() for c in calls]


def _train_rows(run_dir: str) -> List[dict]:
    from sao_actor_learner.observers import read_metrics
    return read_metrics(run_dir, "train") if os.path.isdir(run_dir) else []


def lengths_from_run(run_dir: str, flag: str, cap: float = math.inf) -> LengthDistribution:
    """Response lengths a run recorded (module docstring, `run:`)."""
    calls = _generate_calls(run_dir)
    values = [x for c in calls for x in c.get("lengths", [])]
    if values:
        return empirical(values, flag, f"run:{run_dir} (generate-call logs)", cap)
    rows = [r["response_length_mean"] for r in _train_rows(run_dir)
            if isinstance(r.get("response_length_mean"), (int, float))]
    return empirical(rows, flag, f"run:{run_dir} (batch means of metrics.jsonl)", cap)


# --- costs ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds of each part of the loop (module docstring); every field is a planner flag."""
    gen_call_s: float = 0.0
    gen_token_s: float = 0.0
    gen_step_s: float = 0.0
    prompt_tokens: float = 0.0
    learner_step_s: float = 0.0
    learner_token_s: float = 0.0
    learner_other_s: float = 0.0
    publish_s: float = 0.0
    load_s: float = 0.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise PlanError(f"--{f.name}={v}: must be a finite number >= 0")
        if self.gen_call_s + self.gen_token_s + self.gen_step_s <= 0:
            raise PlanError("--gen_call_s, --gen_token_s, --gen_step_s are all 0: generation "
                            "would be free; give at least one (or --from_run=DIR)")

    def generation_s(self, lengths: np.ndarray) -> float:
        if len(lengths) == 0:
            return 0.0
        return (self.gen_call_s + self.gen_token_s * float(lengths.sum())
                + self.gen_step_s * float(lengths.max()))

    def learner_s(self, tokens: float) -> float:
        return self.learner_step_s + self.learner_token_s * tokens


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: a column whose coefficient comes out negative is
    left out and the rest refitted (enough for the two or three columns here)."""
    keep = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while keep:
        sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if np.all(sol >= 0):
            coef[keep] = sol
            return coef
        keep.pop(int(np.argmin(sol)))
    return coef


def _actor_stats(run_dir: str) -> List[dict]:
    out = []
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("actor_") and name.endswith("_stats.json"):
            with open(os.path.join(run_dir, name)) as f:
                out.append(json.load(f))
    return out


def fit_costs(run_dir: str, flag: str = "--from_run") -> Tuple[Costs, Dict[str, str]]:
    """Costs fitted to a finished run (module docstring) and a note per fitted field saying
    where it came from. The run must have generate-call logs (programs run with
    experiments/benchmarks/generate_log.make_program_with_generate_log: the tuner's and the
    validation's runs are) and train rows."""
    calls = [c for c in _generate_calls(run_dir) if c.get("n")]
    rows = [r for r in _train_rows(run_dir) if isinstance(r.get("step_time_s"), (int, float))]
    if not calls or not rows:
        raise PlanError(f"{flag}={run_dir}: needs a finished run with generate-call logs "
                        f"({len(calls)} calls) and train rows ({len(rows)}); run it with the "
                        "tuner or programs/benchmarks/validate_planner.py")
    times = np.array([c["t1"] - c["t0"] for c in calls])
    has_lengths = all(c.get("lengths") for c in calls)
    columns = [np.ones(len(calls)), np.array([float(c["tokens"]) for c in calls])]
    if has_lengths:
        columns.append(np.array([float(max(c["lengths"])) for c in calls]))
    gen = nonnegative_lstsq(np.stack(columns, 1), times)
    tokens = np.array([r["tokens_per_s"] * r["step_time_s"] for r in rows])
    busy = np.array([max(r["step_time_s"] - r.get("wait_s", 0.0) - r.get("publish_s", 0.0), 0.0)
                     for r in rows])
    learner = nonnegative_lstsq(np.stack([np.ones(len(rows)), tokens], 1), busy)
    batch = np.array([max(r.get("batch_size", 1), 1) for r in rows])
    response = np.array([r.get("response_length_mean", 0.0) for r in rows])
    prompt = float(np.mean(np.maximum(tokens / batch - response, 0.0)))
    times = [r.get("time") for r in rows]
    gaps = [max(t1 - t0 - r["step_time_s"], 0.0) for t0, t1, r in zip(times, times[1:], rows[1:])
            if isinstance(t0, (int, float)) and isinstance(t1, (int, float))]
    actors = _actor_stats(run_dir)
    loads = sum(a.get("weight_updates", 0) for a in actors)
    load_s = sum(a.get("weight_load_s", 0.0) for a in actors) / loads if loads else 0.0
    costs = Costs(gen_call_s=float(gen[0]), gen_token_s=float(gen[1]),
                  gen_step_s=float(gen[2]) if has_lengths else 0.0, prompt_tokens=prompt,
                  learner_step_s=float(learner[0]), learner_token_s=float(learner[1]),
                  learner_other_s=float(np.mean(gaps)) if gaps else 0.0,
                  publish_s=float(np.mean([r.get("publish_s", 0.0) for r in rows])),
                  load_s=float(load_s))
    notes = {
        "generation": f"least squares over {len(calls)} generate calls of {run_dir} "
                      f"(time against 1, tokens{', longest generation' if has_lengths else ''})",
        "learner": f"least squares over {len(rows)} train rows (step_time_s - wait_s - "
                   "publish_s against the batch's tokens); learner_other_s the mean gap between "
                   "a row and the next step's start",
        "prompt_tokens": "batch tokens / batch size - response_length_mean, averaged",
        "weight sync": f"publish_s averaged over the train rows; load_s = the actors' "
                       f"weight_load_s / weight_updates ({loads} loads)"}
    return costs, notes


def costs_with(costs: Optional[Costs], overrides: Dict[str, Optional[float]]) -> Costs:
    """`costs` (None: all zero) with the given fields replaced (None values are ignored)."""
    given = {k: float(v) for k, v in overrides.items() if v is not None}
    if costs is None:
        return Costs(**given)
    return dataclasses.replace(costs, **given)
