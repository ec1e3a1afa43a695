"""The data that flows through the system: one `Rollout` per prompt, and a padded `Batch`.

Token alignment (docs/METHOD.md section 1): a rollout is one token sequence x_0 .. x_{L-1}: the
prompt, then action and observation segments. Every per-token array has length L and index t
describes token x_t. The log-prob of x_t is predicted from position t-1, so position 0 (the first
prompt token) is never an action.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import numpy as np

# Per-token columns, in the order they are stored in replay.
TOKEN_COLUMNS = ("tokens", "action_mask", "rollout_logp", "versions", "rewards")
# Per-rollout scalar columns.
SCALAR_COLUMNS = ("prompt_id", "actor_id", "group_id", "start_time", "end_time", "truncated",
                  "seq")

TOKEN_DTYPES = {
    "tokens": np.int32,
    "action_mask": np.int8,
    "rollout_logp": np.float32,
    "versions": np.int32,
    "rewards": np.float32,
}
SCALAR_DTYPES = {
    "prompt_id": np.int64,
    "actor_id": np.int32,
    "group_id": np.int64,
    "start_time": np.float64,
    "end_time": np.float64,
    "truncated": np.int8,
    "seq": np.int64,
}


def rollout_staleness(min_version: int, learner_version: int) -> int:
    """The staleness of a rollout whose oldest action token came from policy `min_version`
    (-1: it has no action token) when trained at `learner_version`: the versions between them,
    0 without action tokens. Rollout.staleness and the staleness planner both use it."""
    return 0 if min_version < 0 else learner_version - min_version


@dataclasses.dataclass
class Rollout:
    """One trajectory, as an actor inserts it and the learner samples it.

    tokens:       [L] int32  token ids: prompt, then actions and observations.
    action_mask:  [L] int8   1 where the policy sampled the token, else 0.
    rollout_logp: [L] float32 log-prob of the token under the weights that sampled it; 0 elsewhere.
    versions:     [L] int32  policy version that sampled the token; -1 for non-action tokens.
    rewards:      [L] float32 reward credited at the token (final reward on the last action token).
    prompt_id:    id of the prompt in its task (a fresh id per prompt).
    actor_id:     which actor produced it.
    group_id:     id shared by the G rollouts of one prompt in group mode (GRPO); else = prompt_id.
    start_time, end_time: wall-clock seconds since the epoch, actor's clock.
    truncated:    1 if the episode was cut by a length/turn limit (the learner may bootstrap).
    seq:          the actor's sequence number of this rollout (from its spool; -1 before it is
                  spooled). (actor_id, seq) names the rollout end to end: the learner trains a
                  key once and acknowledges it back to the actor (`key`).
    """
    tokens: np.ndarray
    action_mask: np.ndarray
    rollout_logp: np.ndarray
    versions: np.ndarray
    rewards: np.ndarray
    prompt_id: int
    actor_id: int = 0
    group_id: int = -1
    start_time: float = 0.0
    end_time: float = 0.0
    truncated: int = 0
    seq: int = -1

    def __post_init__(self):
        for name in TOKEN_COLUMNS:
            setattr(self, name, np.asarray(getattr(self, name), dtype=TOKEN_DTYPES[name]))
        if self.group_id < 0:
            self.group_id = self.prompt_id

    @property
    def key(self) -> tuple:
        """(actor_id, seq): the rollout's identity from actor to learner."""
        return (int(self.actor_id), int(self.seq))

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum())

    @property
    def total_reward(self) -> float:
        return float(self.rewards.sum())

    def min_version(self) -> int:
        """Oldest policy version that produced any of its action tokens (-1 if none)."""
        v = self.versions[self.action_mask.astype(bool)]
        return int(v.min()) if v.size else -1

    def staleness(self, learner_version: int) -> int:
        """Rollout staleness when trained at `learner_version` (docs/METHOD.md section 9)."""
        return rollout_staleness(self.min_version(), learner_version)

    def columns(self) -> dict:
        """All columns as numpy values (the replay item)."""
        out = {name: getattr(self, name) for name in TOKEN_COLUMNS}
        for name in SCALAR_COLUMNS:
            out[name] = np.asarray(getattr(self, name), dtype=SCALAR_DTYPES[name])
        return out


@dataclasses.dataclass
class Batch:
    """B rollouts right-padded to a common length T, as torch tensors (built by `collate`).

    tokens [B,T] long, action_mask [B,T] float (0 on padding), rollout_logp [B,T] float,
    versions [B,T] long (-1 on padding), rewards [B,T] float, attention_mask [B,T] long,
    lengths [B] long, truncated [B] bool; `rollouts` keeps the originals (metadata).
    """
    tokens: "torch.Tensor"
    attention_mask: "torch.Tensor"
    action_mask: "torch.Tensor"
    rollout_logp: "torch.Tensor"
    versions: "torch.Tensor"
    rewards: "torch.Tensor"
    lengths: "torch.Tensor"
    truncated: "torch.Tensor"
    rollouts: List[Rollout]

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def to(self, device) -> "Batch":
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k, v in fields.items():
            if hasattr(v, "to"):
                fields[k] = v.to(device)
        return Batch(**fields)


def collate(rollouts: Sequence[Rollout], pad_id: int = 0, pad_to: Optional[int] = None) -> Batch:
    """Right-pads rollouts into a `Batch`."""
    import torch

    if not rollouts:
        raise ValueError("collate() needs at least one rollout")
    T = max(r.length for r in rollouts)
    if pad_to is not None:
        T = max(T, pad_to)
    B = len(rollouts)
    tokens = np.full((B, T), pad_id, dtype=np.int64)
    attn = np.zeros((B, T), dtype=np.int64)
    amask = np.zeros((B, T), dtype=np.float32)
    logp = np.zeros((B, T), dtype=np.float32)
    vers = np.full((B, T), -1, dtype=np.int64)
    rew = np.zeros((B, T), dtype=np.float32)
    for i, r in enumerate(rollouts):
        L = r.length
        tokens[i, :L] = r.tokens
        attn[i, :L] = 1
        amask[i, :L] = r.action_mask
        logp[i, :L] = r.rollout_logp
        vers[i, :L] = r.versions
        rew[i, :L] = r.rewards
    return Batch(
        tokens=torch.from_numpy(tokens),
        attention_mask=torch.from_numpy(attn),
        action_mask=torch.from_numpy(amask),
        rollout_logp=torch.from_numpy(logp),
        versions=torch.from_numpy(vers),
        rewards=torch.from_numpy(rew),
        lengths=torch.tensor([r.length for r in rollouts], dtype=torch.long),
        truncated=torch.tensor([bool(r.truncated) for r in rollouts]),
        rollouts=list(rollouts),
    )
