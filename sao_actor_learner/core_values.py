"""The plain values core.py's interfaces hand each other (re-exported there: `core.Prompt`, ...).

What a task gives and answers:   Prompt, StepResult.
What an engine is asked and returns:   SamplingParams, Generation.
What the variable server answers:   VersionInfo (its newest version), AdmitResult (an
admission decision), AckInfo (which of an actor's rollouts the learner consumed), ProgressResult
(its answer to the learner's progress report).

Standard library only, so every side of the loop (the math included) can import it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of a task. `answer` is whatever the task needs to score it."""
    prompt_id: int
    token_ids: Tuple[int, ...]
    text: str = ""
    answer: Any = None


@dataclasses.dataclass
class StepResult:
    """An environment's answer to one model turn."""
    observation_tokens: List[int]
    reward: float
    done: bool
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How an Engine samples. temperature=0 means greedy."""
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: Tuple[int, ...] = ()
    seed: Optional[int] = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")


@dataclasses.dataclass
class Generation:
    """What an Engine returns for one prompt.

    tokens:   sampled token ids (a stop token, if one ended the turn, is included).
    logprobs: log-prob of each sampled token under the weights that sampled it (with
              temperature/top-p applied as the engine sampled: the behaviour policy).
    versions: policy version of the weights that sampled each token.
    finish_reason: "stop" (stop token / EOS) or "length".
    """
    tokens: List[int]
    logprobs: List[float]
    versions: List[int]
    finish_reason: str


@dataclasses.dataclass(frozen=True)
class VersionInfo:
    """The server's newest version: -1 and empty fields when nothing is published."""
    version: int
    sha256: str
    num_bytes: int
    publish_time: float


@dataclasses.dataclass(frozen=True)
class AdmitResult:
    """One admission decision (AReaL's rule, variables/admission.py)."""
    granted: int            # rollouts the actor may start now (0..count asked)
    policy_version: int     # the version they count as started at
    started_total: int
    capacity: int


@dataclasses.dataclass(frozen=True)
class AckInfo:
    """What the learner's latest progress report says about one actor's rollouts (all zeros,
    version -1, before any report)."""
    loss_epoch: int                 # when it goes up, re-insert every unacknowledged rollout
    watermark: int                  # every seq < watermark was consumed for good
    seqs: Tuple[int, ...]           # and these (sorted, each >= watermark)
    version: int
    trained_total: int

    def consumed(self, seq: int) -> bool:
        """The learner consumed rollout `seq` for good: the actor may forget it."""
        return seq < self.watermark or seq in self.seqs


@dataclasses.dataclass(frozen=True)
class ProgressResult:
    """The server's answer to a progress report."""
    credit: int           # admission credit in effect (max over reports and publishes)
    capacity: int         # admission capacity now
    identical: bool       # the report changed nothing the server held
    loss_epoch: int = 0   # the loss epoch the server now holds (max over every report)
    version: int = -1     # the newest version any report named


class VersionConflict(RuntimeError):
    """WeightPublisher.publish was refused because the server already holds that version or a
    newer one ("not newer"), or holds that version with other weights ("different payload" in
    the message). A resumed learner redoing published steps meets it (learner/progress.py)."""
