"""A fixed set of rollouts of one policy: sampled once, saved, reused.

The critic probe (programs/critic_probe.py) and the value-pretrained critic
(programs/pretrain_critic.py) fit and measure critics on the same rollouts every time, so their
numbers differ only by what is fitted. `sample_rollouts` runs the actors' own episode loop
(actors/rollout.run_episodes) with an engine and a task, `samples` rollouts per prompt, each
rollout of a prompt with the prompt's `group_id`; `save_rollouts` / `load_rollouts` keep them in
one .npz file (token columns concatenated, with offsets; scalar columns as arrays).
No reverb, tensorflow or grpc here.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, List, Optional, Sequence

import numpy as np

from sao_actor_learner import core
from sao_actor_learner.actors.rollout import run_episodes
from sao_actor_learner.types import SCALAR_COLUMNS, SCALAR_DTYPES, TOKEN_COLUMNS, Rollout


def sample_rollouts(engine: core.Engine, task: core.Task, prompts: Sequence[core.Prompt],
                    params: core.SamplingParams, samples: int = 1, batch: int = 64,
                    max_turns: int = 1, max_total_tokens: int = 1 << 30,
                    log: Optional[Callable[[str], None]] = None) -> List[Rollout]:
    """`samples` rollouts of each prompt (group_id = the prompt's id), `batch` episodes at a
    time, in prompt order; sampling is seeded by params.seed and the batch index."""
    if samples < 1:
        raise ValueError(f"samples={samples}: must be >= 1")
    todo = [p for p in prompts for _ in range(samples)]
    out: List[Rollout] = []
    for i in range(0, len(todo), batch):
        chunk = todo[i:i + batch]
        seed = None if params.seed is None else params.seed + i
        rollouts = run_episodes(engine, task, chunk, dataclasses.replace(params, seed=seed),
                                max_turns=max_turns, max_total_tokens=max_total_tokens)
        for p, r in zip(chunk, rollouts):
            r.group_id = int(p.prompt_id)
        out.extend(rollouts)
        if log is not None:
            log(f"sampled {len(out)}/{len(todo)} rollouts")
    return out


def save_rollouts(path: str, rollouts: Sequence[Rollout], **meta) -> str:
    """Writes `rollouts` (and scalar metadata `meta`) to `path` (.npz), atomically."""
    if not rollouts:
        raise ValueError("save_rollouts: no rollouts")
    lengths = np.array([r.length for r in rollouts], dtype=np.int64)
    arrays = {"offsets": np.concatenate([[0], np.cumsum(lengths)])}
    for name in TOKEN_COLUMNS:
        arrays[name] = np.concatenate([getattr(r, name) for r in rollouts])
    for name in SCALAR_COLUMNS:
        arrays[name] = np.array([getattr(r, name) for r in rollouts], dtype=SCALAR_DTYPES[name])
    for key, value in meta.items():
        arrays[f"meta_{key}"] = np.asarray(value)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)
    return path


def load_rollouts(path: str) -> tuple:
    """(rollouts, meta dict) from a file `save_rollouts` wrote."""
    with np.load(path, allow_pickle=False) as data:   # data only, never code
        offsets = data["offsets"]
        columns = {name: data[name] for name in TOKEN_COLUMNS}
        scalars = {name: data[name] for name in SCALAR_COLUMNS}
        meta = {k[len("meta_"):]: data[k].item() if data[k].ndim == 0 else data[k].tolist()
                for k in data.files if k.startswith("meta_")}
    rollouts = []
    for i in range(len(offsets) - 1):
        a, b = int(offsets[i]), int(offsets[i + 1])
        rollouts.append(Rollout(**{n: columns[n][a:b] for n in TOKEN_COLUMNS},
                                **{n: scalars[n][i].item() for n in SCALAR_COLUMNS}))
    return rollouts, meta
