"""The small interfaces everything else composes (after Acme's core.py).

Tokenizer    text <-> token ids for one model: BOS, stop ids, chat template, response decoding.
Engine       generates tokens with per-token log-probs and policy versions; takes new weights
             between calls or, with a weight sync mode, while generations are in flight.
EngineWrapper  an Engine around another, delegating the whole contract.
Task         hands out prompts and makes an Environment per episode; scores answers.
Environment  one episode: takes the model's turn, answers with observation tokens and a reward.
VariableSource  something that holds policy variables (the learner, the variable server).
RolloutSink     where an actor's rollouts go (replay, through its writer).
RolloutSource   where the learner's rollouts come from (replay, through its journal).
Worker       anything a launcher runs: `run()` until done or until `stop()` is called.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple


class Tokenizer(abc.ABC):
    """Text <-> token ids for one model. Every tokenizer-specific decision goes through here:
    prompt encoding (BOS or not, chat template), the ids that end a model turn, and decoding a
    completion for the reward. Conversations are kept as token ids; nothing is re-rendered.

    `models.tokenizer.CharTokenizer` (the toy tasks) and `models.hf_tokenizer.HFTokenizer` (any
    Hugging Face model directory) implement it.
    """

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Ids [0, vocab_size) have a token. A model's embedding may have more rows (real Qwen
        checkpoints pad it); ids at or beyond vocab_size are never sampled."""

    @property
    @abc.abstractmethod
    def pad_id(self) -> int:
        """The id that pads batches (never trained on: attention and action masks are 0)."""

    @property
    @abc.abstractmethod
    def bos_id(self) -> Optional[int]:
        """The beginning-of-sequence id `encode(add_bos=True)` prepends; None when the model
        has none (Qwen)."""

    @property
    @abc.abstractmethod
    def eos_id(self) -> int:
        """The primary end-of-sequence id (the one a demonstration ends with)."""

    @property
    @abc.abstractmethod
    def stop_ids(self) -> Tuple[int, ...]:
        """Every id that ends a model turn: eos_id and the model's generation_config eos ids."""

    @property
    @abc.abstractmethod
    def special_ids(self) -> frozenset:
        """Ids of special tokens (skipped when decoding for a reward)."""

    @abc.abstractmethod
    def encode(self, text: str, add_bos: bool = True) -> List[int]:
        """Token ids of `text`, preceded by bos_id when `add_bos` and the model has one.
        Special-token strings inside `text` are not turned into special ids."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of `ids`; special tokens dropped when `skip_special`."""

    @property
    def has_chat_template(self) -> bool:
        """Whether `apply_chat_template` can render conversations."""
        return False

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> List[int]:
        """Token ids of `messages` ([{"role", "content"}, ...]) rendered by the model's chat
        template, ending with the assistant's turn header when `add_generation_prompt`.
        `template_kwargs` reach the template (e.g. enable_thinking=False for Qwen3)."""
        raise ValueError(f"{type(self).__name__} has no chat template: render prompts as plain "
                         "text (apply_chat_template=False)")

    def decode_response(self, ids: Sequence[int]) -> str:
        """The text of one model turn as a reward sees it: the ids up to (not including) the
        first stop id, special tokens skipped."""
        stops = set(self.stop_ids)
        out = []
        for t in ids:
            if int(t) in stops:
                break
            out.append(int(t))
        return self.decode(out, skip_special=True)


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


# What a newer version offered while generations are in flight does to them (Engine,
# docs/DESIGN.md "Weight sync modes").
WEIGHT_SYNC_MODES = ("off", "keep", "abort")


class Engine(abc.ABC):
    """Generates continuations of token-id prompts and can switch weights by version.

    Weights reach an engine in two ways. `load_weights` switches at once, between generate
    calls (it waits for a call in flight). `offer_weights` hands over a newer version from any
    thread, also while `generate` runs in another; `weight_sync_mode` says what it does to the
    sequences in flight:
      off    nothing: the offered weights are used from the next generate call on;
      keep   in-flight sequences continue on the new weights from their next token (the KV of
             their prefix is recomputed with the new weights, so each token's log-prob is
             exactly that of the weights that sampled it);
      abort  in-flight sequences are restarted from their prompts on the new weights.
    Either way `Generation.versions` record which weights sampled each token.
    """

    # An engine that cannot switch weights inside a generate call is "off".
    weight_sync_mode: str = "off"

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> List[Generation]:
        """One Generation per prompt, in order."""

    @abc.abstractmethod
    def load_weights(self, state_dict: dict, version: int) -> None:
        """Switches to new weights (Hugging Face parameter names) tagged with `version`."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The policy version of the weights in use."""

    def offer_weights(self, state_dict: dict, version: int) -> None:
        """Hands the weights of a newer `version` to the engine, from any thread, to be used as
        `weight_sync_mode` says (class docstring). Never waits for a generate call in flight to
        end unless the mode is "off". An offer not newer than the engine's version, or than an
        offer it still holds, is ignored. `state_dict` must not change until it is used.

        This default (an engine that cannot switch mid-generation) is `load_weights`."""
        if version > self.version:
            self.load_weights(state_dict, version)

    def weight_sync_counters(self) -> Dict[str, float]:
        """What weight changes in flight cost so far, cumulative: `tokens` (returned),
        `sequences_switched` (sequences that changed weights in flight), `tokens_discarded`
        (abort: sampled, then thrown away), `tokens_recomputed` (keep: prefix tokens whose KV
        was recomputed). {} when the engine counts none."""
        return {}

    def close(self) -> None:
        """Releases processes or memory the engine holds."""


class EngineWrapper(Engine):
    """An Engine around another (`engine`): the whole contract (generate, load_weights, version,
    weight_sync_mode, offer_weights, weight_sync_counters, close) is delegated to it, and its
    `tokenizer` is kept. A subclass overrides what it changes, usually `generate`, so a wrapper
    never drops part of the contract (e.g. the sync mode of the engine it wraps)."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.tokenizer = engine.tokenizer

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> List[Generation]:
        return self._engine.generate(prompts, params)

    def load_weights(self, state_dict: dict, version: int) -> None:
        self._engine.load_weights(state_dict, version)

    @property
    def version(self) -> int:
        return self._engine.version

    @property
    def weight_sync_mode(self) -> str:  # type: ignore[override]
        return self._engine.weight_sync_mode

    def offer_weights(self, state_dict: dict, version: int) -> None:
        self._engine.offer_weights(state_dict, version)

    def weight_sync_counters(self) -> Dict[str, float]:
        return self._engine.weight_sync_counters()

    def close(self) -> None:
        self._engine.close()


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


class Environment(abc.ABC):
    """One episode of a (possibly multi-turn) task."""

    @abc.abstractmethod
    def step(self, action_tokens: Sequence[int]) -> StepResult:
        """Takes the model's turn (its tokens); returns observation tokens, reward and done."""


class Task(abc.ABC):
    """A verifiable task: prompts for training and evaluation, and an environment per episode."""

    name: str = "task"
    # The tokenizer prompts and observations are encoded with (the model's).
    tokenizer: Optional[Tokenizer] = None
    # Token ids that end a turn of a multi-turn episode besides EOS (e.g. the "]" closing a tool
    # call): the engine stops there and the environment answers. () for single-turn tasks.
    turn_stop_token_ids: Tuple[int, ...] = ()

    @abc.abstractmethod
    def sample_prompt(self, rng) -> Prompt:
        """A training prompt (fresh prompt_id each call). `rng` is a numpy Generator."""

    @abc.abstractmethod
    def eval_prompts(self) -> List[Prompt]:
        """The held-out prompts, fixed for the task's seed and disjoint from training prompts."""

    @abc.abstractmethod
    def make_environment(self, prompt: Prompt) -> Environment:
        """A new episode for `prompt`."""

    @abc.abstractmethod
    def is_correct(self, prompt: Prompt, completion_tokens: Sequence[int]) -> bool:
        """Whether a greedy single-turn completion solves the prompt (evaluation)."""

    def close(self) -> None:
        """Releases what the task holds (reward worker processes); called once, at the end."""


class VariableSource(abc.ABC):
    """Holds policy variables."""

    @abc.abstractmethod
    def get_variables(self) -> Tuple[int, dict]:
        """(version, state_dict) of the newest policy."""


class RolloutSink(abc.ABC):
    """Where an actor's rollouts go: replay, through the actor's writer."""

    @abc.abstractmethod
    def check(self, rollout: "Rollout") -> Optional[str]:
        """None when `rollout` may be sent, else why not (a replay.REJECT_REASONS key)."""

    @abc.abstractmethod
    def send(self, rollouts: Sequence["Rollout"], timeout_s: float) -> List[bool]:
        """Hands checked rollouts to replay in order; per rollout whether it went (False: the
        table stayed full until `timeout_s` and nothing was sent: send it again later). The last
        call's rollouts may still be in flight when it returns (they land unless this process
        dies; a restarted actor sends what it had sent and nobody acknowledged once more)."""

    def close(self) -> None:
        """Waits (bounded) for what `send` left in flight and releases connections. The actor
        that was given the sink calls it once, when its run ends; nothing is sent after it."""


class RolloutSource(abc.ABC):
    """Where a learner's rollouts come from: replay, through the learner's journal."""

    @abc.abstractmethod
    def sample(self, n: int, timeout_s: float) -> List["Rollout"]:
        """Up to n rollouts, oldest first; fewer (possibly none) once `timeout_s` has passed."""

    def queue_size(self) -> int:
        """Rollouts waiting in replay; -1 when unknown."""
        return -1

    def checkpoint(self, after_step: int, commit):
        """Runs `commit()`, which writes the learner checkpoint of version `after_step`, such
        that a crash at any moment leaves a checkpoint and every rollout sampled after it
        (the journal's job); returns commit()'s result."""
        return commit()

    def journal_bytes(self) -> int:
        """Bytes journalled since the newest checkpoint (0: no journal); the learner writes a
        checkpoint once they pass its journal limit, so the journal stays bounded."""
        return 0

    @property
    def replaying(self) -> bool:
        """Whether rollouts of a crashed predecessor are still being handed back."""
        return False

    @property
    def buffered(self) -> int:
        """Rollouts taken from replay that no sample() has returned yet."""
        return 0

    @property
    def rejected(self) -> Dict[str, int]:
        """Replay items refused (forged, malformed, tampered), by reason."""
        return {}

    @property
    def interruptions(self) -> int:
        """How often the stream from replay broke (rollouts in transit may be lost) or items
        left the table without reaching this source (another client took them; replay/loss.py):
        each starts a loss epoch."""
        return 0

    def close(self) -> None:
        """Releases connections and files."""


class Worker(abc.ABC):
    """What a launcher runs in a node: `run()` returns when done or soon after `stop()`."""

    @abc.abstractmethod
    def run(self) -> None:
        """Runs until finished or stopped."""

    def stop(self) -> None:
        """Asks `run()` to return soon. Called from another thread."""
