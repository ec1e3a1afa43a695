"""The run configuration: `SAOConfig`, the flat combination of the sections in `sections.py`
and `learner.py`, validated when it is made.

Flags and config.json are flat: every field of every section is a top-level flag
(`--policy_lr`) and key. A named profile (`--profile=lean`, `SAOConfig.from_profile`) sets
several fields under the ones given explicitly (profiles.py has the precedence). Components
take their section, e.g. `config.section(LearnerConfig)`, or explicit arguments. Every check runs before any process starts and its message names the
field, the value and what to change ("max_staleness=-1: must be >= 0; 0 means strictly
on-policy"). Fields left at 0 / "" that have a per-task default take it (the task's
`TaskSpec.defaults`, tasks/registry.py); each task's and engine's own checks are its registry
entry's.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Type, TypeVar

from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.config.network import NetworkConfig, check_transport
from sao_actor_learner.config.profiles import PROFILES, apply_profile
from sao_actor_learner.config.sections import (  # noqa: F401  (re-exported)
    ACTOR_DELAYS, CRITIC_FREE_BASELINES, CRITICS, DTYPES, ENGINES, EVALUATORS,
    GAE_MODES, KERNEL_BACKENDS, LAUNCH_TYPES, LEARNER_STRATEGIES, LOSS_NORMALIZATIONS,
    PROGRAM_GROUPS, TASKS, WEIGHT_SYNC_MODES, ActorConfig, ConfigError, DatasetConfig,
    EvalConfig, ProgramConfig, ReplayConfig, Section, raise_config_error)
from sao_actor_learner.config.drift import DriftConfig, check_drift
from sao_actor_learner.config.engine import EngineConfig
from sao_actor_learner.config.launch import LaunchConfig, parse_ray_resources  # noqa: F401
from sao_actor_learner.config.trackers import TRACKERS, WANDB_MODES, TrackerConfig  # noqa: F401
from sao_actor_learner.learner.registry import ALGORITHM_NAMES, GROUP_ALGORITHMS
from sao_actor_learner.learner.registry import (  # noqa: F401 - re-exported
    ALGORITHM_NAMES as ALGORITHMS, POLICY_LOSS_NAMES as POLICY_LOSSES)
from sao_actor_learner.tasks.registry import check_task, resolved_defaults, task_names

SECTIONS = (ProgramConfig, ReplayConfig, ActorConfig, EngineConfig, LearnerConfig,
            DatasetConfig, EvalConfig, LaunchConfig, TrackerConfig, NetworkConfig, DriftConfig)

S = TypeVar("S", bound=Section)
# Fields of earlier config.json files that no longer exist, and why reading them is harmless.
REMOVED_FIELDS = {
    "replay_exactly_once": "exactly-once training is end to end now (actors keep rollouts until "
                           "the learner acknowledges them); replay is a plain FIFO",
}
# Fields of earlier config.json files that another field took over: old name -> (new name,
# the new field's value for a file that has the old one, why). A file never has both.
RENAMED_FIELDS = {
    "vllm_weight_sync_mode": (
        "weight_sync_mode", lambda old: "off",
        "weight_sync_mode (off, keep, abort) applies to both engines and reaches generations "
        "in flight; vllm_weight_sync_mode only chose what a vLLM server did to requests in "
        "flight during a weight load, and actors then loaded weights between batches only, so "
        "a run that had it ran weight_sync_mode=off"),
}


@dataclasses.dataclass(frozen=True)
class SAOConfig(DriftConfig, NetworkConfig, TrackerConfig, LaunchConfig, EvalConfig,
                DatasetConfig, LearnerConfig,
                EngineConfig, ActorConfig, ReplayConfig, ProgramConfig):
    """Every option of a run (fields in section order: program, replay, actor, engine, learner,
    dataset, eval, launch, trackers, network, drift)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):   # tuples from flags may arrive as lists
            if isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))
        self._resolve_model()
        self._resolve_task_defaults()
        object.__setattr__(self, "model", self.init_checkpoint)
        if not self.max_prompt_length and self.max_sequence_length > self.max_new_tokens:
            object.__setattr__(self, "max_prompt_length",
                               self.max_sequence_length - self.max_new_tokens)
        self._resolve_lockstep()
        self.validate()

    # Resolution ------------------------------------------------------------------------------
    def _resolve_model(self) -> None:
        """`model` and `init_checkpoint` name the same directory; both end up holding it (the
        task's default when neither is given)."""
        if self.model and self.init_checkpoint and self.model != self.init_checkpoint:
            raise ConfigError(f"model={self.model!r} and init_checkpoint={self.init_checkpoint!r}"
                              " name different directories; they are one setting: give --model")
        object.__setattr__(self, "init_checkpoint", self.model or self.init_checkpoint)

    def _resolve_task_defaults(self) -> None:
        """Fills the fields left at 0 / "" with the task's defaults (its TaskSpec)."""
        if self.task not in task_names():
            return  # validate() names the bad task
        for field, value in resolved_defaults(self.task, self.actor_batch).items():
            if getattr(self, field) in (0, ""):
                object.__setattr__(self, field, value)

    def _resolve_lockstep(self) -> None:
        """lockstep=True sets max_staleness to 0; an explicit other value is an error."""
        if not self.lockstep:
            return
        default = type(self).__dataclass_fields__["max_staleness"].default
        if self.max_staleness not in (0, default):
            raise ConfigError(
                f"lockstep=True with max_staleness={self.max_staleness}: lock-step training is "
                "on-policy (max_staleness 0, which lockstep sets); drop --max_staleness, or drop "
                "--lockstep to train asynchronously with that staleness")
        object.__setattr__(self, "max_staleness", 0)

    # Sections, copies, JSON ------------------------------------------------------------------
    def section(self, cls: Type[S]) -> S:
        """The fields of section `cls` (e.g. LearnerConfig) as that section."""
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    def replace(self, **kwargs) -> "SAOConfig":
        return dataclasses.replace(self, **kwargs)

    @classmethod
    def from_profile(cls, profile: str, **given) -> "SAOConfig":
        """The config of profile `profile` ("" : none) with the `given` fields set explicitly:
        they win over the profile's values (precedence: profiles.py)."""
        if profile and profile not in PROFILES:
            raise ConfigError(f"profile={profile!r}: must be one of "
                              f"{', '.join(sorted(PROFILES))} or empty (no profile)")
        return cls(**apply_profile(profile, given))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SAOConfig":
        """A config from `to_json` output, also from earlier versions (REMOVED_FIELDS are
        ignored, RENAMED_FIELDS read as their new field)."""
        fields = json.loads(text)
        for name in REMOVED_FIELDS:
            fields.pop(name, None)
        for old, (new, value, _) in RENAMED_FIELDS.items():
            if old in fields:
                if new in fields:
                    raise ConfigError(f"config.json has both {old!r} (an earlier name) and "
                                      f"{new!r}; keep only {new!r}")
                fields[new] = value(fields.pop(old))
        return cls(**fields)

    # Validation ------------------------------------------------------------------------------
    def validate(self) -> None:
        """Each section's own checks, in section order, then the checks across sections."""
        for section in SECTIONS:
            section.check(self, raise_config_error)
        self.check_across_sections(raise_config_error)

    def check_across_sections(self, fail) -> None:
        """The first failing check calls `fail`; root causes come before what follows from them
        (the batch's groups before the queue capacity that is derived from batch_size)."""
        G = self.group_size
        if self.placement and self.launch == "local_mt":
            fail(f"placement={','.join(self.placement)} needs launch=local_mp (a process per "
                 "node); under local_mt every node is a thread of one process")
        critic_entries = [e for e in self.placement if str(e).strip().startswith("critic:")]
        if critic_entries and not self.critic_concurrent:
            fail(f"placement={','.join(critic_entries)} places the concurrent critic: add "
                 "--critic_concurrent=true or drop the critic entry")
        if not self.model:
            fail(f"task={self.task!r} has no default model: pass --model=DIR, a Hugging Face "
                 "model directory (config.json, weights, tokenizer)")
        if self.algorithm in GROUP_ALGORITHMS and G < 2:
            singles = " or ".join(a for a in ALGORITHM_NAMES if a not in GROUP_ALGORITHMS)
            fail(f"group_size={G} with algorithm={self.algorithm!r}: its baseline comes from the "
                 "other rollouts of a prompt's group and a group of one rollout has advantage 0, "
                 "so nothing would train; set --group_size>=2 (the paper's GRPO: 8) or use "
                 f"--algorithm={singles} for single rollouts")
        if self.batch_size % G:
            fail(f"batch_size={self.batch_size} is not a multiple of group_size={G}: a GRPO "
                 "batch is prompts x G whole groups; make batch_size a multiple of group_size")
        if self.actor_batch > self.effective_queue_capacity:
            fail(f"actor_batch={self.actor_batch} > queue capacity {self.effective_queue_capacity}: "
                 "an actor could never insert its whole batch; lower actor_batch")
        if self.max_new_tokens >= self.max_sequence_length:
            fail(f"max_new_tokens={self.max_new_tokens} >= max_sequence_length="
                 f"{self.max_sequence_length}: a turn could never fit after the prompt; raise "
                 "max_sequence_length or lower max_new_tokens")
        if self.effective_queue_capacity < G:
            fail(f"queue capacity {self.effective_queue_capacity} < group_size={G}: actors could "
                 "never insert a whole group, a deadlock; raise queue_capacity")
        if not 1 <= self.policy_minibatches <= self.batch_size // G:
            fail(f"policy_minibatches={self.policy_minibatches}: must be in [1, batch_size/"
                 f"group_size={self.batch_size // G}] (each minibatch needs at least one prompt)")
        if self.batch_size % self.learners:
            fail(f"batch_size={self.batch_size} is not a multiple of learners={self.learners}: "
                 "every rank trains the same number of rollouts; make it a multiple")
        if self.learners > 1 and (self.batch_size // self.learners) % G:
            fail(f"batch_size/learners={self.batch_size // self.learners} is not a multiple of "
                 f"group_size={G}: each rank needs whole groups")
        self._check_lean_choices(fail)
        check_transport(self, fail)   # TLS beyond loopback; split launches (config/network.py)
        if self.launch != "ray" and (self.ray_address or self.ray_resources):
            fail(f"ray_address={self.ray_address!r} / ray_resources={list(self.ray_resources)}: "
                 f"apply to --launch=ray only (launch={self.launch!r}); drop them or use ray")
        if not 0 < self.max_prompt_length < self.max_sequence_length:
            fail(f"max_prompt_length={self.max_prompt_length}: must be in [1, "
                 f"max_sequence_length={self.max_sequence_length}) so a response fits after it")
        check_task(self, fail)   # the task's own options (its TaskSpec, tasks/registry.py)
        check_drift(self, fail)  # the drift lab's knobs (config/drift.py)

    def _check_lean_choices(self, fail) -> None:
        """evaluator=in_learner and critic=shared_trunk against the rest of the config."""
        if self.evaluator == "in_learner":
            if self.learners > 1:
                fail(f"evaluator='in_learner' with learners={self.learners}: the group's other "
                     "ranks would wait at their next collective while rank 0 evaluates (and "
                     "under fsdp2 rank 0 holds only its shards); use --evaluator=node")
            if self.engine == "vllm" and self.vllm_evaluator:
                fail("evaluator='in_learner' with vllm_evaluator=True: the learner evaluates "
                     "with the torch engine in its own process; drop --vllm_evaluator or use "
                     "--evaluator=node")
        if self.critic == "shared_trunk" and self.critic_model:
            fail(f"critic='shared_trunk' with critic_model={self.critic_model!r}: the value "
                 "head sits on the policy's own trunk, there is no separate critic to load; "
                 "drop --critic_model or use --critic=separate")
