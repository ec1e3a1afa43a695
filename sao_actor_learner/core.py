"""The contracts of the whole loop, in the order a rollout goes round it (after Acme's core.py).

  prompt    a Task hands out Prompts and an Environment per episode, in the model's Tokenizer.
  rollout   an Engine (holding that Tokenizer) generates each model turn (SamplingParams ->
            Generation: tokens, log-probs, per-token policy versions); the Environment answers
            (StepResult); actors/rollout.py joins the turns into one types.Rollout.
  replay    the actor hands it to a RolloutSink; the learner takes it from a RolloutSource.
  learner   a Learner steps on rollouts; it is the VariableSource of the newest policy.
  weights   it hands each version and its progress (admission credit, the rollouts consumed for
            good, its loss epoch) to a WeightPublisher (the variable server).
  actor     the actor follows the server through its ActorCoordination: a VariableFollower (a
            local copy of the newest version) that also asks admission and reads the
            acknowledgements. The evaluator and the version recorder are VariableFollowers.
Every node runs a Worker. The values handed along (Prompt, StepResult, SamplingParams,
Generation; the server's answers VersionInfo, AdmitResult, AckInfo, ProgressResult) are in
core_values.py, importable from here.
"""
from __future__ import annotations

import abc
import itertools
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from sao_actor_learner.core_values import (  # noqa: F401 - re-exported: core.Prompt, ...
    AckInfo, AdmitResult, Generation, ProgressResult, Prompt, SamplingParams, StepResult,
    VersionConflict, VersionInfo)


class Worker(abc.ABC):
    """What a launcher runs in a node: `run()` returns when done or soon after `stop()`."""

    @abc.abstractmethod
    def run(self) -> None:
        """Runs until finished or stopped."""

    def stop(self) -> None:
        """Asks `run()` to return soon. Called from another thread."""


# --- prompt ---------------------------------------------------------------------------------------
class Environment(abc.ABC):
    """One episode of a (possibly multi-turn) task."""

    @abc.abstractmethod
    def step(self, action_tokens: Sequence[int]) -> StepResult:
        """Takes the model's turn (its tokens); returns observation tokens, reward and done."""


class Task(abc.ABC):
    """A verifiable task: prompts for training and evaluation, and an environment per episode."""

    name: str = "task"
    tokenizer: Optional[Tokenizer] = None   # the model's: prompts and observations use it
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

    def episode_success(self, rollout: "Rollout") -> bool:
        """Whether a greedy multi-turn episode solved its prompt (evaluation, max_turns > 1);
        by default, a positive total reward."""
        return rollout.total_reward > 0

    def set_version_source(self, version_source: "Callable[[], int]") -> None:
        """Hands over where the current policy version comes from (the engine's) to a task whose
        reward depends on it (online_shift). By default: unused."""

    def close(self) -> None:
        """Releases what the task holds (reward worker processes); called once, at the end."""


class Tokenizer(abc.ABC):
    """Text <-> token ids for one model (prompts, the ids that end a turn, a completion's text for
    the reward); conversations are kept as ids, never re-rendered. Implementations:
    models.tokenizer.CharTokenizer (toy tasks), models.hf_tokenizer.HFTokenizer (HF models)."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Ids [0, vocab_size) have a token; an embedding's extra rows are never sampled."""

    @property
    @abc.abstractmethod
    def pad_id(self) -> int:
        """The id that pads batches (never trained on: its masks are 0)."""

    @property
    @abc.abstractmethod
    def bos_id(self) -> Optional[int]:
        """The id `encode(add_bos=True)` prepends; None when the model has none (Qwen)."""

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
        turn = itertools.takewhile(lambda t: t not in stops, (int(t) for t in ids))
        return self.decode(list(turn), skip_special=True)


# --- rollout --------------------------------------------------------------------------------------
# What a version offered during generation does to it (Engine; DESIGN.md "Weight sync modes").
WEIGHT_SYNC_MODES = ("off", "keep", "abort")


class Engine(abc.ABC):
    """Generates continuations of token-id prompts and can switch weights by version.

    Weights reach an engine in two ways. `load_weights` switches at once, between generate
    calls (it waits for a call in flight). `offer_weights` hands over a newer version from any
    thread, also while `generate` runs in another; `weight_sync_mode` says what it does to the
    sequences in flight: off, nothing (the next generate call uses it); keep, they continue on
    the new weights from their next token (their prefix's KV recomputed with them, so each
    token's log-prob is exactly that of the weights that sampled it); abort, they restart from
    their prompts on the new weights. `Generation.versions` record which weights sampled each
    token."""

    tokenizer: Tokenizer   # the model's, set by every engine's __init__ (and kept by wrappers)
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
        """Hands a newer `version` to the engine from any thread, used as `weight_sync_mode`
        says (waits for a generate call in flight only when "off"); one not newer than the
        engine's or its held offer is ignored; `state_dict` must not change until used. This
        default (no switching mid-generation) is `load_weights`."""
        if version > self.version:
            self.load_weights(state_dict, version)

    def weight_sync_counters(self) -> Dict[str, float]:
        """What weight changes in flight cost so far: `tokens` (returned), `sequences_switched`
        (changed weights in flight), `tokens_discarded` (abort: sampled, thrown away),
        `tokens_recomputed` (keep: prefix tokens whose KV was recomputed); {}: not counted."""
        return {}

    def close(self) -> None:
        """Releases processes or memory the engine holds."""


class EngineWrapper(Engine):
    """An Engine around another (`engine`), delegating the whole contract to it and keeping its
    `tokenizer`. A subclass overrides what it changes, usually `generate`, so a wrapper never
    drops part of the contract (e.g. the sync mode of the engine it wraps)."""

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


# --- replay ---------------------------------------------------------------------------------------
class RolloutSink(abc.ABC):
    """Where an actor's rollouts go: replay, through the actor's writer (replay/writer.py)."""

    @abc.abstractmethod
    def check(self, rollout: "Rollout") -> Optional[str]:
        """None when `rollout` may be sent, else why not (a replay.REJECT_REASONS key)."""

    @abc.abstractmethod
    def send(self, rollouts: Sequence["Rollout"], timeout_s: float) -> List[bool]:
        """Hands checked rollouts to replay in order; per rollout whether it went (False: the
        table stayed full until `timeout_s`: send it again later). The last call's may still be
        in flight at return (they land unless this process dies; a restarted actor sends again
        what it had sent and nobody acknowledged)."""

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
        """Runs `commit()` (writes the learner checkpoint of version `after_step`) such that a
        crash at any moment leaves a checkpoint and every rollout sampled after it (the
        journal's job); returns commit()'s result."""
        return commit()

    def journal_bytes(self) -> int:
        """Bytes journalled since the newest checkpoint (0: no journal); past the learner's
        journal limit it writes a checkpoint, so the journal stays bounded."""
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
        """How often the stream from replay broke (rollouts in transit may be lost) or items left
        the table without reaching it (another client took them; replay/loss.py): each starts a
        loss epoch."""
        return 0

    def close(self) -> None:
        """Releases connections and files."""


# --- learner and weights --------------------------------------------------------------------------
class VariableSource(abc.ABC):
    """Holds the newest policy's variables: the learner, or a follower of it."""

    @abc.abstractmethod
    def get_variables(self) -> Tuple[int, Any]:
        """(version, variables) of the newest policy held, read together: the learner's sync
        state dict; a VariableFollower's payload after its `decode` (a state dict when decode
        makes one, else the payload itself); (-1, None) before the first version."""


class Learner(VariableSource, Worker):
    """Turns rollouts from a RolloutSource into policy versions, each handed (by rank 0) to a
    WeightPublisher with the learner's progress; `run()` steps until the last or `stop()`."""

    version: int   # of its policy: the policy steps taken (0: the warm start)

    @abc.abstractmethod
    def step(self) -> Dict[str, float]:
        """One policy step (draw, update, publish, report); its metrics, {} if stopped first."""


class WeightPublisher(abc.ABC):
    """The learner's way back to the actors: each version and the learner's progress go to the
    variable server, which answers the actors' fetches, admission requests and acknowledgement
    queries from them (variables.VariablePublisher)."""

    @abc.abstractmethod
    def publish(self, version: int, payload: Any, dropped_total: int = 0) -> int:
        """Publishes `payload` (the serialized weights: bytes-like, or a sequence of bytes-likes
        sent back to back as one payload) as `version`; returns it once the server holds it.
        `dropped_total`: the admission credit. A version not newer: VersionConflict."""

    @abc.abstractmethod
    def report_progress(self, version: int, dropped_total: int, trained_total: int,
                        loss_epoch: int = 0,
                        acks: Optional[Mapping[int, Tuple[int, Sequence[int]]]] = None
                        ) -> ProgressResult:
        """Sends the learner's cumulative progress (variables/progress.py): rollouts dropped and
        trained so far, the loss epoch (bumped when queued rollouts were lost: actors send again
        what is unacknowledged), `acks` (actor id -> (watermark, seqs): each seq < watermark,
        and each of seqs, was consumed for good); returns once the server keeps it."""

    def close(self) -> None:
        """Releases connections and files; nothing is published after."""


# --- and back to the actor ------------------------------------------------------------------------
class VariableFollower(VariableSource):
    """A local copy of the newest version the learner published, refreshed without blocking
    the caller (after Acme's VariableClient; variables.VariableClient)."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The version held; -1 before the first."""

    @abc.abstractmethod
    def update(self) -> None:
        """Starts a background fetch of a newer version when one is due; never blocks."""

    @abc.abstractmethod
    def update_and_wait(self, timeout_s: float = 60.0) -> int:
        """Blocks until the newest published version is held; returns it (-1: none is)."""

    @abc.abstractmethod
    def wait_for_version(self, min_version: int, timeout_s: float = 60.0) -> int:
        """Blocks until a version >= `min_version` is held; returns it (TimeoutError)."""

    @abc.abstractmethod
    def fetch_version(self, version: int, timeout_s: float = 60.0) -> Any:
        """The variables of an older `version` still kept (as get_variables gives them), the
        held version unchanged: for an actor that runs an older policy on purpose."""

    @property
    def counters(self) -> Mapping[str, float]:
        """How versions arrived so far (shm_loads, grpc_loads, ...); {}: not counted."""
        return {}


class ActorCoordination(VariableFollower):
    """An actor's whole way back from the learner, through the variable server: the newest
    weights (VariableFollower), admission (docs/METHOD.md: no rollout starts that would be too
    stale when consumed) and acknowledgements (what its spool may forget; when to send again).
    A call failing while the server is away raises an error whose `retryable` is True
    (variables.VariableClientError): the actor asks again later."""

    @abc.abstractmethod
    def admit_details(self, actor_id: str, count: int = 1, timeout_s: float = 30.0,
                      released: int = 0) -> AdmitResult:
        """Asks to start `count` rollouts (`released`: admitted earlier, never to be inserted:
        their slots go back first); `granted` may start, counted as at `policy_version`."""

    @abc.abstractmethod
    def acknowledged(self, actor_id: int, timeout_s: float = 10.0) -> AckInfo:
        """Which of `actor_id`'s rollouts the learner consumed for good, and its loss epoch."""
