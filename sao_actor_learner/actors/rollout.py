"""Turning prompts into rollouts: the multi-turn episode loop, batched over episodes.

Each turn the engine continues an episode until EOS, one of the task's turn-ending tokens
(`task.turn_stop_token_ids`, e.g. the "]" that closes a tool call) or the per-turn budget. Its
tokens are appended with action_mask=1, their log-probs and the version that sampled each; the
environment answers with observation tokens (action_mask=0, log-prob 0, version -1) and a reward,
which is credited to the turn's last action token. Episodes end when the environment says so, or
are truncated by the turn limit or the total-token limit (marked `truncated` so the learner can
bootstrap).

Concurrency: the episodes of one call are in flight together. With `env_threads > 1` environment
steps (tool calls, which may sleep for their latency) run in a thread pool while the engine keeps
generating for every episode whose observation has arrived, so one slow tool call holds up only
its own episode. With `env_threads = 1` steps run inline, one after another.

Counters: pass a dict as `counters` and the loop adds to it: episodes, turns, truncated_turns,
truncated_tokens, generate_calls, env_step_s (time spent inside environment steps), env_wait_s
(time the loop sat idle waiting for environment steps), plus every number an environment puts
in `StepResult.info["counters"]` (the calculator task counts tool calls and tool errors there).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from sao_actor_learner import core
from sao_actor_learner.types import Rollout


class EnvironmentError_(TypeError):
    """An environment returned something that is not a StepResult of token ids."""


@dataclasses.dataclass
class _Episode:
    prompt: core.Prompt
    env: core.Environment
    tokens: List[int]
    action_mask: List[int]
    logp: List[float]
    versions: List[int]
    rewards: List[float]
    start_time: float
    end_time: float = 0.0
    turns: int = 0
    last_turn_len: int = 0
    done: bool = False
    truncated: bool = False


def _check_step_result(result, env, vocab_size: Optional[int] = None) -> core.StepResult:
    """`result` if it is a StepResult of in-vocabulary token ids; else EnvironmentError_ naming
    the environment's class."""
    name = type(env).__name__
    if not isinstance(result, core.StepResult):
        raise EnvironmentError_(f"environment {name}.step returned {type(result).__name__}; "
                                "it must return sao_actor_learner.core.StepResult")
    obs = result.observation_tokens
    if isinstance(obs, (str, bytes)) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in obs):
        shown = obs[:20] if isinstance(obs, (str, bytes)) else list(obs)[:5]
        raise EnvironmentError_(f"environment {name} returned observation_tokens that are not "
                                f"token ids (ints): {shown!r}; encode text with the "
                                "task's tokenizer")
    if vocab_size is not None:
        bad = [int(t) for t in obs if not 0 <= int(t) < vocab_size]
        if bad:
            raise EnvironmentError_(f"environment {name} returned observation token ids {bad[:5]} "
                                    f"outside the vocabulary [0, {vocab_size})")
    if not isinstance(result.reward, (int, float, np.number)) or isinstance(result.reward, bool) \
            or not math.isfinite(float(result.reward)):
        raise EnvironmentError_(f"environment {name} returned reward={result.reward!r}; it must "
                                "be a finite number")
    counters = result.info.get("counters", {}) if isinstance(result.info, dict) else None
    if not isinstance(counters, dict) or not all(
            isinstance(v, (int, float, np.number)) for v in counters.values()):
        raise EnvironmentError_(f"environment {name} returned info={result.info!r}; info must be "
                                "a dict whose optional 'counters' entry maps names to numbers")
    return result


def _add(counters: Optional[Dict[str, float]], key: str, value: float) -> None:
    if counters is not None:
        counters[key] = counters.get(key, 0) + value


def run_episodes(engine: core.Engine, task: core.Task, prompts: Sequence[core.Prompt],
                 params: core.SamplingParams, actor_id: int = 0, max_turns: int = 1,
                 max_total_tokens: int = 1 << 30, env_threads: int = 1,
                 counters: Optional[Dict[str, float]] = None) -> List[Rollout]:
    """Runs one episode per prompt, concurrently; returns their rollouts in prompt order.

    Args:
      engine, task: what samples and what answers.
      params: per-turn sampling (max_new_tokens is the per-turn budget); the task's
        `turn_stop_token_ids` are added to its stop tokens.
      max_turns: model turns per episode; an episode still going after this many is truncated.
      max_total_tokens: the longest a rollout may get (prompt included); an episode whose next
        observation would not leave room for another action token is truncated.
      env_threads: threads stepping environments (1: inline).
      counters: optional dict the loop adds its counters to (module docstring).
    """
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns}: must be >= 1")
    if env_threads < 1:
        raise ValueError(f"env_threads={env_threads}: must be >= 1 (1 steps inline)")
    extra_stop = tuple(int(t) for t in task.turn_stop_token_ids)
    stop = tuple(sorted(set(params.stop_token_ids) | set(extra_stop)))
    vocab_size = task.tokenizer.vocab_size if task.tokenizer is not None else None
    now = time.time()
    episodes = [
        _Episode(prompt=p, env=task.make_environment(p), tokens=list(p.token_ids),
                 action_mask=[0] * len(p.token_ids), logp=[0.0] * len(p.token_ids),
                 versions=[-1] * len(p.token_ids), rewards=[0.0] * len(p.token_ids),
                 start_time=now)
        for p in prompts
    ]
    _add(counters, "episodes", len(episodes))

    def step(e: _Episode, toks: List[int]):
        t0 = time.monotonic()
        try:
            result = e.env.step(toks)
        except Exception as err:
            raise RuntimeError(f"environment {type(e.env).__name__}.step raised on prompt "
                               f"{e.prompt.prompt_id} (turn {e.turns}): {err!r}; environments "
                               "must turn bad model output into observations") from err
        return result, time.monotonic() - t0

    def apply(e: _Episode, result, step_s: float) -> bool:
        """Records an environment step; True when the episode needs another model turn."""
        result = _check_step_result(result, e.env, vocab_size)
        _add(counters, "env_step_s", step_s)
        for key, value in result.info.get("counters", {}).items():
            _add(counters, key, value)
        if e.last_turn_len:
            e.rewards[-1] += float(result.reward)
        elif result.reward:
            # No action token to credit (empty turn): credit the last action token, if any.
            idx = max((i for i, m in enumerate(e.action_mask) if m), default=None)
            if idx is not None:
                e.rewards[idx] += float(result.reward)
        if result.done:
            e.done, e.end_time = True, time.time()
            return False
        obs = [int(t) for t in result.observation_tokens]
        room = max_total_tokens - len(e.tokens)
        if len(obs) >= room or e.turns >= max_turns:
            e.done = e.truncated = True
            e.end_time = time.time()
            _add(counters, "truncated_tokens" if len(obs) >= room else "truncated_turns", 1)
            return False
        e.tokens += obs
        e.action_mask += [0] * len(obs)
        e.logp += [0.0] * len(obs)
        e.versions += [-1] * len(obs)
        e.rewards += [0.0] * len(obs)
        return True

    pool = cf.ThreadPoolExecutor(max_workers=min(env_threads, max(len(episodes), 1)),
                                 thread_name_prefix="env-step") if env_threads > 1 else None
    to_generate: List[_Episode] = list(episodes)
    pending: Dict[cf.Future, tuple] = {}
    try:
        while to_generate or pending:
            if to_generate:
                batch, to_generate = to_generate, []
                budgets = [max_total_tokens - len(e.tokens) for e in batch]
                step_params = dataclasses.replace(
                    params, stop_token_ids=stop,
                    max_new_tokens=max(1, min(params.max_new_tokens, max(budgets))))
                gens = engine.generate([e.tokens for e in batch], step_params)
                _add(counters, "generate_calls", 1)
                for e, g, budget in zip(batch, gens, budgets):
                    toks = [int(t) for t in g.tokens][:max(budget, 0)]
                    n = len(toks)
                    e.tokens += toks
                    e.action_mask += [1] * n
                    e.logp += [float(x) for x in g.logprobs[:n]]
                    e.versions += [int(v) for v in g.versions[:n]]
                    e.rewards += [0.0] * n
                    e.turns += 1
                    e.last_turn_len = n
                    _add(counters, "turns", 1)
                    if pool is None:
                        if apply(e, *step(e, toks)):
                            to_generate.append(e)
                    else:
                        pending[pool.submit(step, e, toks)] = e
            if pending:
                t0 = time.monotonic()
                # Block only when nothing else can be generated meanwhile.
                done, _ = cf.wait(list(pending), timeout=0 if to_generate else None,
                                  return_when=cf.FIRST_COMPLETED)
                if not to_generate:
                    _add(counters, "env_wait_s", time.monotonic() - t0)
                for f in done:
                    e = pending.pop(f)
                    if apply(e, *f.result()):
                        to_generate.append(e)
    finally:
        if pool is not None:
            pool.shutdown(wait=not pending, cancel_futures=True)
    for e in episodes:
        if len(e.logp) != len(e.tokens) or len(e.versions) != len(e.tokens):
            raise AssertionError(
                f"engine {type(engine).__name__} returned {len(e.logp)} log-probs / "
                f"{len(e.versions)} versions for {len(e.tokens)} tokens of prompt "
                f"{e.prompt.prompt_id}: a Generation needs one log-prob and one version per token")
    return [
        Rollout(tokens=e.tokens, action_mask=e.action_mask, rollout_logp=e.logp,
                versions=e.versions, rewards=e.rewards, prompt_id=e.prompt.prompt_id,
                actor_id=actor_id, start_time=e.start_time, end_time=e.end_time,
                truncated=int(e.truncated))
        for e in episodes
    ]
