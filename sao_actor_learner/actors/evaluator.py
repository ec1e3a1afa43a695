"""The evaluator node: greedy held-out accuracy of the latest policy every `eval_every` versions,
and optionally pass@k (k samples per prompt at the training temperature; a prompt passes when
any sample is correct).

Version 0 (the warm start) is evaluated from the checkpoint on disk at start-up, so the
initial accuracy never depends on timing; the final version (`max_steps`) is always evaluated,
after which the evaluator finishes.

`InLearnerEvaluation` runs the same evaluation inside the learner's process (config
evaluator=in_learner): the learner offers every version it publishes; a due one is copied into
this process's engine and evaluated while the learner waits. It saves the evaluator's process
(its start-up, its polling, its share of the cores) and evaluates exactly the versions due,
never a later one; the learner's wall clock includes the evaluations (counted in its
`in_learner_eval_s`). docs/DESIGN.md, The lean profile, has what it buys and costs.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional

from absl import logging

from sao_actor_learner import core


def evaluate(engine: core.Engine, task: core.Task, prompts: List[core.Prompt],
             params: core.SamplingParams, batch_size: int = 64, max_turns: int = 1,
             max_total_tokens: int = 1 << 30, env_threads: int = 1) -> float:
    """Fraction of `prompts` the engine solves with greedy decoding.

    max_turns > 1 (multi-turn tasks, e.g. calculator_tool): whole episodes with the task's
    environment (actors.rollout.run_episodes); success is `task.episode_success(rollout)` (by
    default a positive total reward: core.Task).
    """
    correct = 0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        if max_turns > 1:
            from sao_actor_learner.actors.rollout import run_episodes
            rollouts = run_episodes(engine, task, chunk, params, max_turns=max_turns,
                                    max_total_tokens=max_total_tokens, env_threads=env_threads)
            correct += sum(bool(task.episode_success(r)) for r in rollouts)
            continue
        gens = engine.generate([p.token_ids for p in chunk], params)
        correct += sum(task.is_correct(p, g.tokens) for p, g in zip(chunk, gens))
    return correct / max(len(prompts), 1)


def generate_samples(engine: core.Engine, prompts: List[core.Prompt],
                     params: core.SamplingParams, n: int, batch_size: int = 64
                     ) -> List[List[core.Generation]]:
    """n generations of each single-turn prompt (list i holds prompt i's), about `batch_size`
    sequences per engine call."""
    out: List[List[core.Generation]] = []
    per_call = max(1, batch_size // n)
    for i in range(0, len(prompts), per_call):
        chunk = prompts[i:i + per_call]
        gens = engine.generate([p.token_ids for p in chunk for _ in range(n)], params)
        out.extend(gens[j * n:(j + 1) * n] for j in range(len(chunk)))
    return out


def pass_at_k(engine: core.Engine, task: core.Task, prompts: List[core.Prompt],
              params: core.SamplingParams, k: int, batch_size: int = 64) -> float:
    """Fraction of single-turn `prompts` for which at least one of k samples is correct."""
    samples = generate_samples(engine, prompts, params, k, batch_size)
    passed = sum(any(task.is_correct(p, g.tokens) for g in gens)
                 for p, gens in zip(prompts, samples))
    return passed / max(len(prompts), 1)


class Evaluator(core.Worker):
    """Evaluates the versions due (module docstring) with its own engine.

    Args:
      task, engine: the Task (its eval_prompts) and the Engine that answers them.
      variables: the core.VariableFollower versions come from (a variables.VariableClient);
        None when the learner offers them (InLearnerEvaluation).
      decode: the follower's params -> the state dict the engine loads.
      params: greedy SamplingParams; sample_params: those of pass@k (pass_k > 0).
      eval_every, max_steps: every eval_every-th version is due, and the last (max_steps).
      logger: a MetricsLogger for the "eval" rows, or None.
      max_turns, max_total_tokens, env_threads: multi-turn episode limits.
    """

    def __init__(self, task: core.Task, engine: core.Engine,
                 variables: Optional[core.VariableFollower],
                 decode: Optional[Callable], params: core.SamplingParams, eval_every: int,
                 max_steps: int, logger=None, max_turns: int = 1,
                 max_total_tokens: int = 1 << 30, env_threads: int = 1, pass_k: int = 0,
                 sample_params: Optional[core.SamplingParams] = None):
        self._task = task
        self._engine = engine
        self._variables = variables
        self._decode = decode
        self._params = params
        self._eval_every = eval_every
        self._max_steps = max_steps
        self._logger = logger
        self._episode_limits = dict(max_turns=max_turns, max_total_tokens=max_total_tokens,
                                    env_threads=env_threads)  # multi-turn tasks
        self._prompts = task.eval_prompts()
        if pass_k and (sample_params is None or max_turns > 1):
            raise ValueError("pass_k needs sample_params and a single-turn task (max_turns=1)")
        self._pass_k = pass_k
        self._sample_params = sample_params
        self._stop = threading.Event()
        self.results: Dict[int, float] = {}

    def stop(self) -> None:
        self._stop.set()

    def _evaluate_current(self) -> float:
        t0 = time.time()
        acc = evaluate(self._engine, self._task, self._prompts, self._params,
                       **self._episode_limits)
        v = self._engine.version
        row = {"kind": "eval", "step": v, "policy_version": v, "eval_accuracy": acc,
               "eval_size": len(self._prompts)}
        if self._pass_k:
            row[f"eval_pass_at_{self._pass_k}"] = pass_at_k(
                self._engine, self._task, self._prompts, self._sample_params, self._pass_k)
        row["eval_time_s"] = time.time() - t0
        self.results[v] = acc
        logging.info("eval: version %d accuracy %.3f (%.1fs)", v, acc, row["eval_time_s"])
        if self._logger is not None:
            self._logger.write(row)
        return acc

    def offer(self, version: int, weights: Callable[[], dict]) -> bool:
        """Evaluates `version` if it is due, loading `weights()` (a state dict) first when the
        engine holds another version; returns whether it evaluated."""
        if not self._due(version):
            return False
        if version != self._engine.version:
            self._engine.load_weights(weights(), version)
        self._evaluate_current()
        return True

    def _due(self, version: int) -> bool:
        if version in self.results:
            return False
        if version == 0 or version >= self._max_steps:   # the node's first and last, always
            return True
        last = max(self.results) if self.results else -1
        return self._eval_every > 0 and version // self._eval_every > last // self._eval_every

    def close(self) -> None:
        self._task.close()
        if self._logger is not None:
            self._logger.close()   # its trackers log every queued row and end their runs

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.close()

    def _run(self) -> None:
        self._evaluate_current()  # version 0, the checkpoint the engine was built from
        while not self._stop.is_set() and self._max_steps not in self.results:
            self._variables.update()
            v, params = self._variables.get_variables()
            if v < 0 or not self.offer(v, lambda: self._decode(params)):
                time.sleep(0.05)


class InLearnerEvaluation:
    """The evaluator's work in the learner's process (see the module docstring): the Learner
    calls it as `evaluation(version, weights)` after publishing each version; `weights()` is
    the policy's sync state dict (copied into `engine` only when the version is due)."""

    def __init__(self, evaluator: Evaluator):
        self._evaluator = evaluator

    @property
    def results(self) -> Dict[int, float]:
        return self._evaluator.results

    def __call__(self, version: int, weights: Callable[[], dict]) -> bool:
        return self._evaluator.offer(version, weights)

    def close(self) -> None:
        self._evaluator.close()
