"""The run configuration's sections: one frozen dataclass per component, each validating itself.

Every field is declared with `option(default, help)`: the help sentence is the flag's help
(`programs/sao.py --helpfull`). A section's `check(fail)` validates its own fields and names the
field, the value and what to change; checks that relate fields of several sections live in
`config.SAOConfig`, the flat combination of all sections that flags and config.json use.
Components take their section (`config.section(LearnerConfig)`) or explicit arguments, never the
whole run configuration.

The sections of the engine and of scale-out live in engine.py and launch.py. The allowed
--task and --engine values come from the task and engine registries (tasks/registry.py,
engines/registry.py), which own each task's and engine's defaults and checks.

Only the standard library, `core` and the two registries are imported here: the launcher
validates configs without loading torch or an engine (a task's checks load its module: numpy).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Optional, Tuple

from sao_actor_learner.core import WEIGHT_SYNC_MODES  # noqa: F401  (re-exported)
from sao_actor_learner.engines.registry import engine_names
from sao_actor_learner.launch.program import LAUNCH_TYPES  # noqa: F401  (the launcher's list)
from sao_actor_learner.tasks.registry import task_names

# The registered tasks and engines when this module was imported (the checks ask the registries).
TASKS = task_names()
ENGINES = engine_names()
GAE_MODES = ("skip_observation", "standard")
LOSS_NORMALIZATIONS = ("action_tokens", "kept_tokens")
LR_SCHEDULES = ("constant", "linear", "cosine")
CRITIC_FREE_BASELINES = ("running_mean", "per_prompt")
ACTOR_DELAYS = ("none", "fixed", "uniform", "heavy_tailed")
# How weights reach actors (variables/client.py takes this list from here).
WEIGHT_TRANSPORTS = ("auto", "grpc", "shm")
KERNEL_BACKENDS = ("auto", "triton", "torch")
DTYPES = ("float32", "bfloat16")
LEARNER_STRATEGIES = ("ddp", "fsdp2")
CRITICS = ("separate", "shared_trunk")
EVALUATORS = ("node", "in_learner", "record", "off")
# The groups of the SAO program (builder.make_program), for restart_groups and ray_resources.
PROGRAM_GROUPS = ("replay", "variables", "learner", "learner_store", "actor", "evaluator")

Fail = Callable[[str], None]


class ConfigError(ValueError):
    """An invalid configuration; the message says which field to change and why."""


def option(default: Any, help: str) -> Any:
    """A config field with its default and its one-sentence help (the flag's help)."""
    if isinstance(default, (list, tuple)):
        return dataclasses.field(default=tuple(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def raise_config_error(msg: str) -> None:
    raise ConfigError(msg)


class Section:
    """A frozen dataclass of options that checks itself when made (and `check` in SAOConfig)."""

    def __post_init__(self) -> None:
        type(self).check(self, raise_config_error)

    def check(self, fail: Fail) -> None:
        """Calls `fail(message)` for the first invalid field of this section."""


def choice(section: Any, field: str, options: Tuple[str, ...], fail: Fail) -> None:
    value = getattr(section, field)
    if value not in options:
        fail(f"{field}={value!r}: must be one of {', '.join(options)}")


def at_least(section: Any, fields: Tuple[str, ...], low: float, fail: Fail,
             why: str = "") -> None:
    for field in fields:
        value = getattr(section, field)
        if value < low:
            fail(f"{field}={value}: must be >= {low:g}{why}")


@dataclasses.dataclass(frozen=True)
class ProgramConfig(Section):
    """What runs: the task, the model, how many actors, for how long."""
    task: str = option("arithmetic", "The task: arithmetic, calculator_tool, online_shift, "
                       "preference_drift, or dataset (prompts from --train_files scored by "
                       "--reward).")
    seed: int = option(0, "Seeds the task split, the prompt order and the models.")
    run_dir: str = option("runs/default", "Where the run writes config.json, metrics, "
                          "checkpoints, logs and summary.json.")
    launch: str = option("local_mp", "How nodes run: local_mp (a process each), local_mt "
                         "(threads of one process) or ray.")
    num_actors: int = option(2, "Actor nodes generating rollouts.")
    max_steps: int = option(100, "Learner steps, i.e. policy versions, to train.")
    threads_per_process: int = option(1, "torch.set_num_threads in every node (several "
                                      "processes share the cores).")
    model: str = option("", "The policy's Hugging Face model directory (any causal LM with its "
                        "tokenizer); empty: --init_checkpoint or the task's warm start.")
    init_checkpoint: str = option("", "The same directory as --model under its older name; "
                                  "empty: the task's warm start (checkpoints/warm_start...).")
    critic_model: str = option("", "Where the critic starts: a critic directory (e.g. value-"
                               "pretrained) or a causal-LM directory; empty: the policy's.")

    profile: str = option("", "A named set of settings applied under the flags given "
                          "explicitly (lean: one actor, a shared-trunk value head, evaluation "
                          "in the learner; docs/DESIGN.md, The lean profile); empty: none.")

    def check(self, fail: Fail) -> None:
        from sao_actor_learner.config.profiles import PROFILES
        if self.profile and self.profile not in PROFILES:
            fail(f"profile={self.profile!r}: must be one of {', '.join(sorted(PROFILES))} or "
                 "empty (no profile)")
        choice(self, "task", task_names(), fail)
        choice(self, "launch", LAUNCH_TYPES, fail)
        at_least(self, ("num_actors", "max_steps", "threads_per_process"), 1, fail)


@dataclasses.dataclass(frozen=True)
class ReplayConfig(Section):
    """The replay table, the staleness bound and replay's durability."""
    batch_size: int = option(32, "Rollouts (distinct prompts, or prompts x group_size) per "
                             "learner step.")
    max_staleness: int = option(4, "eta: no rollout staler than this many versions is trained "
                                "on; 0 is strictly on-policy.")
    queue_capacity: int = option(0, "Reverb rate-limiter bound on queued rollouts; 0: twice "
                                 "batch_size.")
    admission_control: bool = option(True, "Actors start a rollout only while started <= "
                                     "(v + eta + 1) * batch_size + dropped.")
    max_sequence_length: int = option(0, "The longest rollout in tokens, prompt included; "
                                      "0: the task's default.")
    lockstep: bool = option(False, "Synchronous RL on the same program: one batch per version, "
                            "actors idle while the learner trains (sets max_staleness 0).")
    forced_staleness: int = option(-1, "k >= 0 trains every rollout exactly k versions stale "
                                   "(a drift experiment; the mean lag with "
                                   "--forced_staleness_distribution); -1: off.")
    replay_checkpoints: bool = option(True, "Replay checkpoints Reverb periodically and on stop "
                                      "and restores the newest when it (re)starts.")
    replay_checkpoint_every_s: float = option(30.0, "Seconds between replay checkpoints; 0: "
                                              "only when the replay node stops.")
    replay_checkpoint_dir: str = option("", "Where replay checkpoints go; empty: "
                                        "<run_dir>/checkpoints/replay.")
    replay_loss_timeout_s: float = option(5.0, "Items that left the replay table without "
                                          "reaching the learner for this long (sampled or "
                                          "deleted by another client, a reset) start a loss "
                                          "epoch: actors re-send them; one learner only; 0: off.")
    reverb_without_tensorflow: bool = option(True, "launch=local_mp: nodes load Reverb's C++ "
                                             "client (and the replay node its server) without "
                                             "the TensorFlow Python module "
                                             "(replay/client.py; ~0.3 s and ~60 MB instead of "
                                             "~3 s and ~500 MB per process).")

    def check(self, fail: Fail) -> None:
        at_least(self, ("batch_size", "max_sequence_length"), 1, fail)
        if self.max_staleness < 0:
            fail(f"max_staleness={self.max_staleness}: must be >= 0; 0 means strictly on-policy")
        if self.queue_capacity < 0:
            fail(f"queue_capacity={self.queue_capacity}: must be >= 0 (0 picks 2*batch_size)")
        if self.queue_capacity and self.queue_capacity < self.batch_size:
            fail(f"queue_capacity={self.queue_capacity} < batch_size={self.batch_size}: the learner "
                 f"waits for {self.batch_size} rollouts while actors block once {self.queue_capacity} "
                 "are queued, a deadlock; raise queue_capacity or lower batch_size")
        if self.replay_checkpoint_every_s < 0:
            fail(f"replay_checkpoint_every_s={self.replay_checkpoint_every_s}: must be >= 0 "
                 "(0: checkpoint only when the replay node stops)")
        if not self.replay_loss_timeout_s >= 0:
            fail(f"replay_loss_timeout_s={self.replay_loss_timeout_s}: must be >= 0 seconds "
                 "(0: the learner does not check the table's counters)")
        if self.forced_staleness < -1:
            fail(f"forced_staleness={self.forced_staleness}: staleness cannot be negative; use "
                 "k >= 0 (every rollout exactly k versions stale) or -1 (off)")
        if self.forced_staleness > self.max_staleness:
            fail(f"forced_staleness={self.forced_staleness} > max_staleness={self.max_staleness}:"
                 " the learner would drop every rollout as too stale; raise max_staleness to at "
                 "least forced_staleness")
        if self.forced_staleness >= 0 and not self.admission_control:
            fail(f"forced_staleness={self.forced_staleness} needs admission_control=True: actors "
                 "make exactly one batch per policy version, which admission enforces")
        if self.lockstep:
            if not self.admission_control:
                fail("lockstep=True with admission_control=False: lock-step is enforced by "
                     "admission (actors start one batch per policy version); set "
                     "--admission_control")
            if self.forced_staleness >= 0:
                fail(f"lockstep=True with forced_staleness={self.forced_staleness}: forced "
                     "staleness trains every rollout k versions stale, lock-step trains "
                     "on-policy; use one")
            if self.max_staleness != 0:
                fail(f"lockstep=True with max_staleness={self.max_staleness}: must be 0 "
                     "(on-policy)")

    @property
    def effective_queue_capacity(self) -> int:
        return self.queue_capacity or 2 * self.batch_size


@dataclasses.dataclass(frozen=True)
class ActorConfig(Section):
    """How actors sample, group, delay and step environments."""
    actor_batch: int = option(8, "Prompts an actor generates together (one rollout each).")
    temperature: float = option(1.0, "Sampling temperature of training rollouts (the learner "
                                "scores with the same).")
    top_p: float = option(1.0, "Nucleus sampling mass of training rollouts; 1: off.")
    max_new_tokens: int = option(0, "Tokens a model turn may generate; 0: the task's default.")
    variable_update_period_s: float = option(0.05, "How often actors poll the variable server "
                                             "for a new version.")
    weight_transport: str = option(
        "auto", "How weights reach actors: auto (the learner writes each version once into "
        "shared memory, actors on its host map it, the rest fetch over gRPC), shm (actors "
        "always try shared memory first) or grpc (gRPC only).")
    weight_shm_dir: str = option("/dev/shm", "The tmpfs directory shared-memory versions go "
                                 "under (weight_transport auto or shm).")
    group_size: int = option(1, "G rollouts per prompt, inserted as a group (GRPO); 1 is "
                             "single-rollout.")
    actor_delay: str = option("none", "An injected per-rollout delay: none, fixed, uniform or "
                              "heavy_tailed (a drift experiment).")
    actor_delay_mean_s: float = option(0.0, "Mean injected delay in seconds (fixed: the delay; "
                                       "uniform: U(0, 2 * mean)).")
    actor_delay_max_s: float = option(10.0, "Cap on one injected delay in seconds.")
    actor_delay_tail: float = option(1.5, "heavy_tailed: the Pareto (Lomax) shape, > 1; "
                                     "smaller is heavier.")
    max_turns: int = option(0, "Model turns per episode; 0: the task's default.")
    env_threads: int = option(0, "Threads stepping environments per actor so tool calls and "
                              "rewards overlap generation (1: inline); 0: the task's default.")
    tool_latency: str = option("lognormal:0.02,1.0", "Delay per tool call: none, constant:S, "
                               "uniform:LO,HI, exponential:MEAN, lognormal:MEDIAN,SIGMA or "
                               "pareto:SCALE,ALPHA.")
    tool_timeout_s: float = option(1.0, "A tool call slower than this becomes a timeout "
                                   "observation.")
    shift_every: int = option(20, "task=online_shift: the reward rule flips every this many "
                              "policy versions.")
    actor_spool: bool = option(True, "Actors keep each completed rollout on disk until the "
                               "learner acknowledges it (re-inserted after any crash).")

    def check(self, fail: Fail) -> None:
        at_least(self, ("actor_batch", "max_new_tokens"), 1, fail)
        if self.temperature <= 0.0:
            fail(f"temperature={self.temperature}: training rollouts need temperature > 0; "
                 "greedy sampling has no valid behaviour log-probs for importance sampling")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p={self.top_p}: must be in (0, 1]")
        if self.variable_update_period_s <= 0:
            fail(f"variable_update_period_s={self.variable_update_period_s}: must be > 0")
        choice(self, "actor_delay", ACTOR_DELAYS, fail)
        choice(self, "weight_transport", WEIGHT_TRANSPORTS, fail)
        if self.weight_transport != "grpc" and not os.path.isabs(self.weight_shm_dir):
            fail(f"weight_shm_dir={self.weight_shm_dir!r}: must be an absolute path (a tmpfs "
                 "such as /dev/shm), or set weight_transport=grpc")
        G = self.group_size
        if G < 1:
            fail(f"group_size={G}: must be >= 1 (rollouts per prompt; 1 is single-rollout)")
        if self.actor_batch % G:
            fail(f"actor_batch={self.actor_batch} is not a multiple of group_size={G}: actors "
                 "generate whole groups; make actor_batch a multiple of group_size")
        if self.actor_delay_mean_s < 0:
            fail(f"actor_delay_mean_s={self.actor_delay_mean_s}: must be >= 0")
        if self.actor_delay != "none" and self.actor_delay_mean_s <= 0:
            fail(f"actor_delay={self.actor_delay!r} with actor_delay_mean_s="
                 f"{self.actor_delay_mean_s}: set actor_delay_mean_s > 0, or actor_delay=none")
        if self.actor_delay_max_s <= 0:
            fail(f"actor_delay_max_s={self.actor_delay_max_s}: must be > 0")
        if self.actor_delay_tail <= 1.0:
            fail(f"actor_delay_tail={self.actor_delay_tail}: the Pareto shape must be > 1 (a "
                 "shape <= 1 has no finite mean, so actor_delay_mean_s could not be its mean)")
        for field in ("max_turns", "env_threads"):
            if getattr(self, field) < 1:
                fail(f"{field}={getattr(self, field)}: must be >= 1 (0 picks the task's default)")


@dataclasses.dataclass(frozen=True)
class DatasetConfig(Section):
    """task=dataset: the files, how prompts are rendered, and the reward."""
    train_files: Tuple[str, ...] = option((), "Training prompts: .jsonl / .parquet files in "
                                          "verl's schema (or mapped with --prompt_key).")
    eval_files: Tuple[str, ...] = option((), "Held-out prompts, scored with the same reward.")
    prompt_key: str = option("prompt", "The column with the prompt (a string or chat "
                             "messages).")
    answer_key: str = option("reward_model.ground_truth", "The ground-truth column; dots reach "
                             "into nested columns.")
    apply_chat_template: Optional[bool] = option(None, "Render prompts with the tokenizer's "
                                                 "chat template; unset: when it has one.")
    chat_template_kwargs: str = option("", "A JSON object for the chat template, e.g. "
                                       "{\"enable_thinking\": false}.")
    system_prompt: str = option("", "A system message put before every prompt.")
    instruction_suffix: str = option("", "Text appended to the last user message of every "
                                     "prompt.")
    max_prompt_length: int = option(0, "Longer prompts (tokens) are left out and counted; 0: "
                                    "max_sequence_length - max_new_tokens.")
    shuffle: bool = option(True, "A seeded permutation of the training rows in every epoch.")
    reward: str = option("gsm8k", "gsm8k, final_number, exact, math_verify, or "
                         "path/to/file.py:fn with verl's compute_score(data_source, "
                         "solution_str, ground_truth, extra_info).")
    reward_timeout_s: float = option(5.0, "A reward call slower than this scores 0 (counted).")
    reward_workers: int = option(2, "Worker processes per node for math_verify and file.py:fn "
                                 "rewards.")

    def check(self, fail: Fail) -> None:
        if self.chat_template_kwargs:
            try:
                kwargs = json.loads(self.chat_template_kwargs)
            except ValueError as e:
                fail(f"chat_template_kwargs={self.chat_template_kwargs!r} is not JSON ({e}); "
                     "give a JSON object, e.g. '{\"enable_thinking\": false}'")
            if not isinstance(kwargs, dict):
                fail(f"chat_template_kwargs={self.chat_template_kwargs!r}: must be a JSON object")
        if not self.reward_timeout_s > 0:
            fail(f"reward_timeout_s={self.reward_timeout_s}: must be > 0 seconds")
        if self.reward_workers < 1:
            fail(f"reward_workers={self.reward_workers}: must be >= 1")
        for field in ("train_files", "eval_files"):
            for path in getattr(self, field):
                if not path.endswith((".jsonl", ".parquet")):
                    fail(f"{field} entry {path!r}: must be a .jsonl or .parquet file")
                if not os.path.isfile(path):
                    fail(f"{field} entry {path!r}: no such file")

    @property
    def template_kwargs(self) -> dict:
        """chat_template_kwargs parsed (check() has made sure it is a JSON object)."""
        return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}


@dataclasses.dataclass(frozen=True)
class EvalConfig(Section):
    """The evaluator: held-out accuracy of the newest policy."""
    eval_every: int = option(10, "Evaluate every this many versions (versions 0 and max_steps "
                             "always); 0: only those two.")
    eval_size: int = option(200, "Held-out prompts (dataset task: the first of --eval_files).")
    eval_pass_k: int = option(0, "Also report pass@k with k samples at --temperature; 0: off.")
    evaluator: str = option("node", "Where held-out evaluation runs: node (a process of its "
                            "own), in_learner (the learner's process, after it publishes a due "
                            "version, while it waits), record (a process that writes each "
                            "due version to run_dir/policy_versions/ for "
                            "programs/evaluate_versions.py to evaluate after the run: nothing "
                            "evaluates during training) or off (none).")

    def check(self, fail: Fail) -> None:
        choice(self, "evaluator", EVALUATORS, fail)
        if self.eval_every < 0:
            fail(f"eval_every={self.eval_every}: must be >= 0")
        at_least(self, ("eval_size",), 1, fail)
        if self.eval_pass_k < 0 or self.eval_pass_k == 1:
            fail(f"eval_pass_k={self.eval_pass_k}: must be 0 (off) or >= 2 samples per prompt")
