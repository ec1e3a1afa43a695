"""Turning prompts into rollouts: the episode loop, batched over prompts (one rollout each).

Each turn the engine continues every unfinished episode; its tokens are appended with
action_mask=1, their log-probs and the version that sampled each; the environment answers
with observation tokens (action_mask=0, version -1) and a reward, which is credited to the
turn's last action token. Episodes end when the environment says so, or are truncated by the
turn or token limit (marked so the learner can bootstrap).
"""
from __future__ import annotations

import dataclasses
import time
from typing import List, Sequence

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
    turns: int = 0
    done: bool = False
    truncated: bool = False


def _check_step_result(result, env) -> core.StepResult:
    name = type(env).__name__
    if not isinstance(result, core.StepResult):
        raise EnvironmentError_(f"environment {name}.step returned {type(result).__name__}; "
                                "it must return sao_actor_learner.core.StepResult")
    obs = result.observation_tokens
    if not all(isinstance(t, (int, np.integer)) for t in obs):
        raise EnvironmentError_(f"environment {name} returned observation_tokens that are not "
                                f"token ids (ints): {list(obs)[:5]!r}; encode text with the "
                                "task's tokenizer")
    return result


def run_episodes(engine: core.Engine, task: core.Task, prompts: Sequence[core.Prompt],
                 params: core.SamplingParams, actor_id: int = 0, max_turns: int = 1,
                 max_total_tokens: int = 1 << 30) -> List[Rollout]:
    """Runs one episode per prompt, batching the engine calls across episodes."""
    now = time.time()
    episodes = [
        _Episode(prompt=p, env=task.make_environment(p), tokens=list(p.token_ids),
                 action_mask=[0] * len(p.token_ids), logp=[0.0] * len(p.token_ids),
                 versions=[-1] * len(p.token_ids), rewards=[0.0] * len(p.token_ids),
                 start_time=now)
        for p in prompts
    ]
    while True:
        active = [e for e in episodes if not e.done]
        if not active:
            break
        budgets = [max_total_tokens - len(e.tokens) for e in active]
        step_params = dataclasses.replace(
            params, max_new_tokens=max(1, min(params.max_new_tokens, max(budgets))))
        gens = engine.generate([e.tokens for e in active], step_params)
        for e, g, budget in zip(active, gens, budgets):
            toks = list(g.tokens)[:max(budget, 0)]
            n = len(toks)
            e.tokens += toks
            e.action_mask += [1] * n
            e.logp += list(g.logprobs)[:n]
            e.versions += list(g.versions)[:n]
            e.rewards += [0.0] * n
            e.turns += 1
            result = _check_step_result(e.env.step(toks), e.env)
            if n:
                e.rewards[-1] += float(result.reward)
            elif result.reward:
                # No action token to credit (empty turn): credit the last action token, if any.
                idx = max((i for i, m in enumerate(e.action_mask) if m), default=None)
                if idx is not None:
                    e.rewards[idx] += float(result.reward)
            if result.done:
                e.done = True
                continue
            obs = [int(t) for t in result.observation_tokens]
            room = max_total_tokens - len(e.tokens)
            if len(obs) >= room or e.turns >= max_turns:
                e.done = e.truncated = True
                continue
            e.tokens += obs
            e.action_mask += [0] * len(obs)
            e.logp += [0.0] * len(obs)
            e.versions += [-1] * len(obs)
            e.rewards += [0.0] * len(obs)
    end = time.time()
    return [
        Rollout(tokens=e.tokens, action_mask=e.action_mask, rollout_logp=e.logp,
                versions=e.versions, rewards=e.rewards, prompt_id=e.prompt.prompt_id,
                actor_id=actor_id, start_time=e.start_time, end_time=end,
                truncated=int(e.truncated))
        for e in episodes
    ]
