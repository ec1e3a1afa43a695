"""The run configuration: one flat frozen dataclass, validated when it is made.

Every check runs before any process starts and its message names the field, the value and what
to change (STYLE.md: "max_staleness=-1: must be >= 0; 0 means strictly on-policy").
Choices the SAO paper leaves open are marked (ours) in SAO.md and stay options here.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Optional, Tuple

LAUNCH_TYPES = ("local_mt", "local_mp", "ray")  # ray: launch/ray.py (issue 7)
ENGINES = ("torch",)
ENGINES += ("vllm",)  # engines/vllm_engine.py: a vLLM server in .venv-vllm (issue 5)
VLLM_WEIGHT_SYNC_MODES = ("keep", "abort")
GAE_MODES = ("skip_observation", "standard")
LOSS_NORMALIZATIONS = ("action_tokens", "kept_tokens")
POLICY_LOSSES = ("dis", "ppo_clip", "tis", "icepop", "none")  # learner/losses.py
# Baselines and the off-policy drift toolkit (issue 4).
ALGORITHMS = ("sao", "grpo", "critic_free")
CRITIC_FREE_BASELINES = ("running_mean", "per_prompt")
ACTOR_DELAYS = ("none", "fixed", "uniform", "heavy_tailed")
KERNEL_BACKENDS = ("auto", "triton", "torch")
TASKS = ("arithmetic", "online_shift")  # online_shift: tasks/online_shift.py (issue 4)
# Agentic multi-turn rollouts (issue 3): the calculator-tool task and per-task defaults for the
# fields left at 0 / "" ("the task's default"); tasks not listed take arithmetic's.
TASKS += ("calculator_tool",)  # tasks/calculator_tool.py
TASKS += ("dataset",)          # tasks/dataset.py: prompts from --train_files, a --reward
TASK_DEFAULTS = {
    "arithmetic": dict(init_checkpoint="checkpoints/warm_start", max_sequence_length=64,
                       max_new_tokens=8, max_turns=1, env_threads=1),
    "calculator_tool": dict(init_checkpoint="checkpoints/warm_start_calculator_tool",
                            max_sequence_length=96, max_new_tokens=16, max_turns=4,
                            env_threads="actor_batch"),
    # The reward runs in the environment step: off the generation thread (env_threads).
    "dataset": dict(max_sequence_length=512, max_new_tokens=128, max_turns=1,
                    env_threads="actor_batch"),
}


class ConfigError(ValueError):
    """An invalid configuration; the message says which field to change and why."""


@dataclasses.dataclass(frozen=True)
class SAOConfig:
    # --- program -------------------------------------------------------------------------------
    task: str = "arithmetic"
    seed: int = 0
    run_dir: str = "runs/default"
    launch: str = "local_mp"
    num_actors: int = 2
    model: str = ""                       # the policy's Hugging Face model directory (any causal
                                          # LM with its tokenizer); "": init_checkpoint
    init_checkpoint: str = ""             # the same directory under its older name; "": the
                                          # task's (checkpoints/warm_start[_calculator_tool])
    critic_model: str = ""                # the critic's start: a critic directory (ValueModel.save,
                                          # e.g. value-pretrained) or a causal LM; "": the policy's
    max_steps: int = 100
    threads_per_process: int = 1          # torch.set_num_threads in every node
    engine: str = "torch"

    # --- replay and staleness (SAO.md section 6) -------------------------------------------------
    batch_size: int = 32                  # rollouts (= distinct prompts) per learner step
    max_staleness: int = 4                # eta: nothing staler than this is trained on
    queue_capacity: int = 0               # Reverb rate limiter bound on queued rollouts; 0: 2*batch_size
    admission_control: bool = True        # actors start rollouts only while started <= (v+eta+1)*B
    max_sequence_length: int = 0          # longest rollout (longer are cut/rejected); 0: task's (64, 96)

    # --- actors --------------------------------------------------------------------------------
    actor_batch: int = 8                  # prompts an actor generates together (one rollout each)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 0               # per model turn; 0: the task's (arithmetic 8, calculator_tool 16)
    variable_update_period_s: float = 0.05  # how often actors poll the variable server

    # --- SAO learner (SAO.md sections 3-5) -----------------------------------------------------
    policy_loss: str = "dis"
    eps_low: float = 0.3
    eps_high: float = 5.0
    loss_normalization: str = "action_tokens"   # (ours); "kept_tokens" normalises by kept tokens
    policy_lr: float = 5e-5
    critic_lr: float = 2.5e-4                     # 5x the policy lr, as the public ports do
    critic_updates: int = 2                       # K critic steps per policy step
    critic_frozen_patterns: Tuple[str, ...] = ("self_attn", "embed_tokens", "norm")
    critic_warmup_steps: int = 0                  # first steps update only the critic
    value_pretrain_steps: int = 0                 # critic-only steps on the initial policy's rollouts
    value_pretrain_min_ev: float = 1.0            # stop pretraining early at this explained variance
    gamma: float = 1.0
    gae: str = "skip_observation"
    adaptive_lambda: bool = True                  # lambda_policy = 1 - 1/(alpha*n)
    lambda_alpha: float = 1.5
    lambda_policy: float = 0.95                   # used when adaptive_lambda is False
    lambda_critic: float = 1.0
    normalize_advantages: bool = True             # (ours) whiten advantages over the batch's action tokens
    max_grad_norm: float = 1.0
    value_clip: float = 0.0                       # 0: no value clipping
    checkpoint_every: int = 0                     # 0: only at the end

    # --- kernels (sao_actor_learner/kernels) ---------------------------------------------------
    kernel_backend: str = "auto"   # auto: Triton on CUDA tensors, torch elsewhere; triton; torch
    fused_logprobs: bool = True    # log-probs from hidden states + LM head, no [N, V] logits

    # --- baselines and the off-policy drift toolkit (issue 4; learner/grpo.py, baselines.py) -----
    algorithm: str = "sao"          # sao: critic + GAE; grpo: group-normalised; critic_free: tracked baseline
    group_size: int = 1             # G rollouts per prompt, inserted as a group; batch_size = prompts x G
    grpo_scale_by_std: bool = True  # grpo: divide by the group's reward std (False: Dr. GRPO)
    baseline: str = "running_mean"  # critic_free: running_mean | per_prompt value tracker
    baseline_decay: float = 0.9     # critic_free: EMA decay of the baseline tracker
    ppo_clip_low: float = 0.2       # PPO clip range [1 - low, 1 + high] (ppo_clip, tis, icepop)
    ppo_clip_high: float = 0.2
    tis_cap: float = 2.0            # tis: C in min(pi_old / mu, C)
    icepop_low: float = 0.5         # icepop: band [low, high] on pi_old / mu
    icepop_high: float = 5.0
    policy_minibatches: int = 1     # policy optimizer steps per learner step (the batch is split)
    actor_delay: str = "none"       # injected per-rollout delay: none | fixed | uniform | heavy_tailed
    actor_delay_mean_s: float = 0.0   # mean delay (fixed: the delay; uniform: U(0, 2*mean))
    actor_delay_max_s: float = 10.0   # cap on one delay (heavy tails)
    actor_delay_tail: float = 1.5     # heavy_tailed: Pareto (Lomax) shape, > 1 (smaller: heavier)
    forced_staleness: int = -1      # k >= 0: every rollout trained exactly k versions stale; -1: off
    shift_every: int = 20           # task=online_shift: the reward rule flips every N policy versions

    # --- agentic multi-turn rollouts (issue 3; actors/rollout.py, tasks/tools.py) ----------------
    max_turns: int = 0              # model turns per episode; 0: the task's (arithmetic 1, calculator_tool 4)
    env_threads: int = 0            # threads stepping environments per actor, so tool calls overlap
                                    # generation (1: inline); 0: the task's (arithmetic 1, calculator_tool actor_batch)
    tool_latency: str = "lognormal:0.02,1.0"  # delay per tool call, tasks/tools.py: none | constant:S |
                                    # uniform:LO,HI | exponential:MEAN | lognormal:MEDIAN,SIGMA | pareto:SCALE,ALPHA
    tool_timeout_s: float = 1.0     # a tool call slower than this becomes a timeout observation

    # --- vLLM engine (issue 5; engines/vllm_engine.py, used when engine="vllm") ------------------
    vllm_weight_sync_mode: str = "keep"   # keep: in-flight requests continue on the new weights
                                          # (per-token versions record the switch); abort: restarted
    vllm_python: str = ""                 # the vLLM env's python; "": $SAO_VLLM_PYTHON or .venv-vllm/bin/python
    vllm_start_timeout_s: float = 300.0   # a server not healthy by then is an error (with its log)
    vllm_max_restarts: int = 3            # restarts of a dead server per engine before errors propagate
    vllm_kv_cache_gb: int = 1             # VLLM_CPU_KVCACHE_SPACE of each server (CPU vLLM)
    vllm_enforce_eager: bool = True       # no torch.compile in the server: starts ~2x faster on CPU
    vllm_evaluator: bool = False          # the evaluator uses vLLM too (False: the torch engine)

    # --- lock-step (synchronous) training (issue 8 benchmark 2: programs/benchmarks/async_vs_sync.py)
    lockstep: bool = False          # True: synchronous RL, the baseline async is measured against:
                                    # actors generate exactly one batch per policy version, with it,
                                    # then sit idle while the learner trains on that batch (the
                                    # learner idles while they generate). Admission control with
                                    # max_staleness 0, which this sets; needs admission_control

    # --- dataset tasks (task=dataset; tasks/dataset.py, tasks/dataset_files.py, rewards/) --------
    train_files: Tuple[str, ...] = ()     # .jsonl / .parquet files of training prompts (verl's schema)
    eval_files: Tuple[str, ...] = ()      # held-out prompts, scored with the same reward
    prompt_key: str = "prompt"            # the column with the prompt (string or chat messages)
    answer_key: str = "reward_model.ground_truth"   # the ground-truth column; dots reach nested ones
    apply_chat_template: Optional[bool] = None   # render prompts with the tokenizer's chat
                                          # template; unset: when it has one
    chat_template_kwargs: str = ""        # JSON object for the template, e.g. {"enable_thinking": false}
    system_prompt: str = ""               # a system message before every prompt
    instruction_suffix: str = ""          # appended to the last user message of every prompt
    max_prompt_length: int = 0            # longer prompts are left out and counted; 0:
                                          # max_sequence_length - max_new_tokens
    shuffle: bool = True                  # a seeded permutation of the training rows per epoch
    reward: str = "gsm8k"                 # gsm8k | exact | math_verify | path/to/file.py:fn (verl's
                                          # compute_score(data_source, solution_str, ground_truth, extra_info))
    reward_timeout_s: float = 5.0         # a reward call slower than this scores 0 (counted)
    reward_workers: int = 2               # processes per node for math_verify and file:fn rewards

    # --- evaluation ------------------------------------------------------------------------------
    eval_every: int = 10
    eval_size: int = 200                  # held-out prompts (dataset task: the first of eval_files)
    eval_pass_k: int = 0                  # also report pass@k with k samples at --temperature; 0: off

    # --- scale-out, faults and security (issue 7: launch/ray.py, restarts in launch/local.py,
    #     learner/journal.py, actors/spool.py, variables/security.py) ----------------------------
    ray_address: str = ""           # launch=ray: "" a local Ray (or this process's ray.init());
                                    # "auto" / "ray://HEAD:10001" joins a running cluster
    ray_resources: Tuple[str, ...] = ()   # launch=ray: GROUP:CPUS[:GPUS] reserved by each node of
                                    # GROUP, e.g. learner:1:1,actor:1; unlisted groups reserve none
    restart_groups: Tuple[str, ...] = ("actor", "evaluator")  # crashed nodes of these groups are
                                    # restarted (learner: resumes from its checkpoint + journal)
    max_restarts: int = 3           # restarts per node; one crash more fails the run
    restart_backoff_s: float = 1.0  # wait before a node's first restart; doubles per restart (<= 30 s)
    resume: bool = False            # continue the run in run_dir (learner checkpoint and journal,
                                    # replay checkpoint, actor spools); False clears them first
    keep_checkpoints: int = 0       # newest learner checkpoints kept; 0: all
    replay_checkpoints: bool = True       # replay checkpoints Reverb periodically and on stop,
                                    # and restores the newest on (re)start
    replay_checkpoint_every_s: float = 30.0   # 0: only when the replay node stops
    replay_checkpoint_dir: str = ""       # "": <run_dir>/checkpoints/replay
    replay_exactly_once: bool = True      # the learner reads a rollout, journals it, then removes
                                    # it from replay (4 samples each): a killed learner loses none
    actor_spool: bool = True        # actors keep each completed rollout on disk until replay
                                    # confirms it (re-inserted after an actor crash)
    bind_host: str = "127.0.0.1"    # interface the variable server binds; another needs an auth
                                    # token (--auth_token or $SAO_AUTH_TOKEN, never in config.json)
    tls_cert: str = ""              # PEM certificate (chain): the variable server speaks TLS only
    tls_key: str = ""               # PEM private key of tls_cert

    def __post_init__(self):
        # Tuples from flags may arrive as lists.
        object.__setattr__(self, "critic_frozen_patterns", tuple(self.critic_frozen_patterns))
        for field in ("ray_resources", "restart_groups", "train_files", "eval_files"):
            object.__setattr__(self, field, tuple(getattr(self, field)))
        self._resolve_model()
        self._resolve_task_defaults()
        object.__setattr__(self, "model", self.init_checkpoint)
        if not self.max_prompt_length and self.max_sequence_length > self.max_new_tokens:
            object.__setattr__(self, "max_prompt_length",
                               self.max_sequence_length - self.max_new_tokens)
        self._resolve_lockstep()
        self.validate()

    def _resolve_task_defaults(self) -> None:
        """Fills the fields left at 0 / "" with the task's TASK_DEFAULTS (issue 3)."""
        if self.task not in TASKS:
            return  # validate() names the bad task
        for field, value in TASK_DEFAULTS.get(self.task, TASK_DEFAULTS["arithmetic"]).items():
            if getattr(self, field) in (0, ""):
                object.__setattr__(self, field,
                                   self.actor_batch if value == "actor_batch" else value)

    def _resolve_model(self) -> None:
        """`model` and `init_checkpoint` name the same directory; both end up holding it (the
        task's default when neither is given)."""
        if self.model and self.init_checkpoint and self.model != self.init_checkpoint:
            raise ConfigError(f"model={self.model!r} and init_checkpoint={self.init_checkpoint!r}"
                              " name different directories; they are one setting: give --model")
        object.__setattr__(self, "init_checkpoint", self.model or self.init_checkpoint)

    @property
    def template_kwargs(self) -> dict:
        """chat_template_kwargs parsed (validate() has checked it is a JSON object)."""
        return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}

    # Convenience -----------------------------------------------------------------------------
    @property
    def effective_queue_capacity(self) -> int:
        return self.queue_capacity or 2 * self.batch_size

    def replace(self, **kwargs) -> "SAOConfig":
        return dataclasses.replace(self, **kwargs)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SAOConfig":
        return cls(**json.loads(text))

    # Validation ------------------------------------------------------------------------------
    def validate(self) -> None:
        def fail(msg):
            raise ConfigError(msg)

        def choice(field, options):
            value = getattr(self, field)
            if value not in options:
                fail(f"{field}={value!r}: must be one of {', '.join(options)}")

        choice("task", TASKS)
        choice("launch", LAUNCH_TYPES)
        choice("engine", ENGINES)
        choice("gae", GAE_MODES)
        choice("loss_normalization", LOSS_NORMALIZATIONS)
        choice("policy_loss", POLICY_LOSSES)
        choice("kernel_backend", KERNEL_BACKENDS)
        for field in ("num_actors", "max_steps", "batch_size", "actor_batch", "max_new_tokens",
                      "critic_updates", "threads_per_process", "eval_size", "max_sequence_length"):
            if getattr(self, field) < 1:
                fail(f"{field}={getattr(self, field)}: must be >= 1")
        if self.max_staleness < 0:
            fail(f"max_staleness={self.max_staleness}: must be >= 0; 0 means strictly on-policy")
        if self.queue_capacity < 0:
            fail(f"queue_capacity={self.queue_capacity}: must be >= 0 (0 picks 2*batch_size)")
        if self.queue_capacity and self.queue_capacity < self.batch_size:
            fail(f"queue_capacity={self.queue_capacity} < batch_size={self.batch_size}: the learner "
                 f"waits for {self.batch_size} rollouts while actors block once {self.queue_capacity} "
                 "are queued, a deadlock; raise queue_capacity or lower batch_size")
        if self.actor_batch > self.effective_queue_capacity:
            fail(f"actor_batch={self.actor_batch} > queue capacity {self.effective_queue_capacity}: "
                 "an actor could never insert its whole batch; lower actor_batch")
        if not 0.0 < self.eps_low < 1.0:
            fail(f"eps_low={self.eps_low}: must be in (0, 1); the lower bound of the DIS band is "
                 "1 - eps_low and must stay positive (paper: 0.3 math, 0.8 coding)")
        if self.eps_high <= 0.0:
            fail(f"eps_high={self.eps_high}: must be > 0 (paper: 5.0 math, 3.0 coding)")
        if self.temperature <= 0.0:
            fail(f"temperature={self.temperature}: training rollouts need temperature > 0; "
                 "greedy sampling has no valid behaviour log-probs for importance sampling")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p={self.top_p}: must be in (0, 1]")
        for field in ("policy_lr", "critic_lr"):
            if not getattr(self, field) > 0:
                fail(f"{field}={getattr(self, field)}: must be > 0")
        if not 0.0 <= self.gamma <= 1.0:
            fail(f"gamma={self.gamma}: must be in [0, 1]")
        for field in ("lambda_policy", "lambda_critic"):
            if not 0.0 <= getattr(self, field) <= 1.0:
                fail(f"{field}={getattr(self, field)}: must be in [0, 1]")
        if self.lambda_alpha <= 0:
            fail(f"lambda_alpha={self.lambda_alpha}: must be > 0 (SAO review: 1.5; VAPO: 0.05)")
        for field in ("critic_warmup_steps", "value_pretrain_steps", "checkpoint_every",
                      "eval_every"):
            if getattr(self, field) < 0:
                fail(f"{field}={getattr(self, field)}: must be >= 0")
        if self.critic_warmup_steps >= self.max_steps:
            fail(f"critic_warmup_steps={self.critic_warmup_steps} >= max_steps={self.max_steps}: "
                 "the policy would never be trained; lower critic_warmup_steps")
        if self.max_grad_norm <= 0:
            fail(f"max_grad_norm={self.max_grad_norm}: must be > 0")
        if self.value_clip < 0:
            fail(f"value_clip={self.value_clip}: must be >= 0 (0 disables value clipping)")
        if self.variable_update_period_s <= 0:
            fail(f"variable_update_period_s={self.variable_update_period_s}: must be > 0")
        if not 0.0 < self.value_pretrain_min_ev <= 1.0:
            fail(f"value_pretrain_min_ev={self.value_pretrain_min_ev}: must be in (0, 1]")
        self._validate_baselines_and_drift(fail)
        self._validate_vllm(fail)
        self._validate_multi_turn(fail)
        self._validate_faults_and_scale_out(fail)
        self._validate_lockstep(fail)
        self._validate_dataset(fail)

    def _validate_dataset(self, fail) -> None:
        """Checks of the model and dataset-task fields that need no file reading."""
        if not self.model:
            fail(f"task={self.task!r} has no default model: pass --model=DIR, a Hugging Face "
                 "model directory (config.json, weights, tokenizer)")
        if self.chat_template_kwargs:
            try:
                kwargs = json.loads(self.chat_template_kwargs)
            except ValueError as e:
                fail(f"chat_template_kwargs={self.chat_template_kwargs!r} is not JSON ({e}); "
                     "give a JSON object, e.g. '{\"enable_thinking\": false}'")
            if not isinstance(kwargs, dict):
                fail(f"chat_template_kwargs={self.chat_template_kwargs!r}: must be a JSON object")
        if self.max_prompt_length < 0 or self.max_prompt_length >= self.max_sequence_length:
            fail(f"max_prompt_length={self.max_prompt_length}: must be in [1, "
                 f"max_sequence_length={self.max_sequence_length}) so a response fits after it")
        if not self.reward_timeout_s > 0:
            fail(f"reward_timeout_s={self.reward_timeout_s}: must be > 0 seconds")
        if self.reward_workers < 1:
            fail(f"reward_workers={self.reward_workers}: must be >= 1")
        if self.eval_pass_k < 0 or self.eval_pass_k == 1:
            fail(f"eval_pass_k={self.eval_pass_k}: must be 0 (off) or >= 2 samples per prompt")
        if self.task != "dataset":
            if self.train_files or self.eval_files:
                fail(f"train_files / eval_files apply to --task=dataset (task={self.task!r}); "
                     "add --task=dataset or drop them")
            return
        if not self.train_files:
            fail("task='dataset' needs --train_files=a.parquet[,b.jsonl] (training prompts)")
        if not self.eval_files:
            fail("task='dataset' needs --eval_files=test.parquet (held-out prompts, scored with "
                 "the same reward)")
        for field in ("train_files", "eval_files"):
            for path in getattr(self, field):
                if not path.endswith((".jsonl", ".parquet")):
                    fail(f"{field} entry {path!r}: must be a .jsonl or .parquet file")
                import os
                if not os.path.isfile(path):
                    fail(f"{field} entry {path!r}: no such file")
        if self.max_turns != 1:
            fail(f"max_turns={self.max_turns}: dataset prompts are single-turn; drop --max_turns")

    def _resolve_lockstep(self) -> None:
        """lockstep=True sets max_staleness to 0 (issue 8); an explicit other value is an error."""
        if not self.lockstep:
            return
        default = type(self).__dataclass_fields__["max_staleness"].default
        if self.max_staleness not in (0, default):
            raise ConfigError(
                f"lockstep=True with max_staleness={self.max_staleness}: lock-step training is "
                "on-policy (max_staleness 0, which lockstep sets); drop --max_staleness, or drop "
                "--lockstep to train asynchronously with that staleness")
        object.__setattr__(self, "max_staleness", 0)

    def _validate_lockstep(self, fail) -> None:
        """Checks of the lock-step mode (issue 8)."""
        if not self.lockstep:
            return
        if not self.admission_control:
            fail("lockstep=True with admission_control=False: lock-step is enforced by admission "
                 "(actors start one batch per policy version); set --admission_control")
        if self.forced_staleness >= 0:
            fail(f"lockstep=True with forced_staleness={self.forced_staleness}: forced staleness "
                 "trains every rollout k versions stale, lock-step trains on-policy; use one")
        if self.max_staleness != 0:
            fail(f"lockstep=True with max_staleness={self.max_staleness}: must be 0 (on-policy)")

    def _validate_faults_and_scale_out(self, fail) -> None:
        """Checks of the Ray, restart, checkpoint and security fields (issue 7)."""
        import os
        for group in self.restart_groups:
            if group not in PROGRAM_GROUPS:
                fail(f"restart_groups contains {group!r}: must name groups of the program "
                     f"({', '.join(PROGRAM_GROUPS)})")
        if self.max_restarts < 0:
            fail(f"max_restarts={self.max_restarts}: must be >= 0 (0: a crash fails the run)")
        if self.restart_backoff_s < 0:
            fail(f"restart_backoff_s={self.restart_backoff_s}: must be >= 0 seconds")
        if self.keep_checkpoints < 0:
            fail(f"keep_checkpoints={self.keep_checkpoints}: must be >= 0 (0 keeps all)")
        if self.replay_checkpoint_every_s < 0:
            fail(f"replay_checkpoint_every_s={self.replay_checkpoint_every_s}: must be >= 0 "
                 "(0: checkpoint only when the replay node stops)")
        if self.launch != "ray" and (self.ray_address or self.ray_resources):
            fail(f"ray_address={self.ray_address!r} / ray_resources={list(self.ray_resources)}: "
                 f"apply to --launch=ray only (launch={self.launch!r}); drop them or use ray")
        try:
            parse_ray_resources(self.ray_resources)
        except ValueError as e:
            fail(str(e))
        if bool(self.tls_cert) != bool(self.tls_key):
            fail(f"tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r}: give both (TLS on the "
                 "variable server) or neither")
        for field in ("tls_cert", "tls_key"):
            path = getattr(self, field)
            if path and not os.path.isfile(path):
                fail(f"{field}={path!r}: no such file (a PEM file)")
        if not self.bind_host or any(c in self.bind_host for c in " /"):
            fail(f"bind_host={self.bind_host!r}: must be an interface address such as 127.0.0.1 "
                 "or 0.0.0.0")

    def _validate_multi_turn(self, fail) -> None:
        """Checks of the agentic multi-turn fields (issue 3)."""
        from sao_actor_learner.tasks.tools import parse_latency  # numpy only
        for field in ("max_turns", "env_threads"):
            if getattr(self, field) < 1:
                fail(f"{field}={getattr(self, field)}: must be >= 1 (0 picks the task's default)")
        if self.max_new_tokens >= self.max_sequence_length:
            fail(f"max_new_tokens={self.max_new_tokens} >= max_sequence_length="
                 f"{self.max_sequence_length}: a turn could never fit after the prompt; raise "
                 "max_sequence_length or lower max_new_tokens")
        try:
            parse_latency(self.tool_latency)
        except ValueError as e:
            fail(f"tool_latency={self.tool_latency!r}: {e}")
        if not self.tool_timeout_s > 0:
            fail(f"tool_timeout_s={self.tool_timeout_s}: must be > 0 (seconds a tool call may take)")

    def _validate_baselines_and_drift(self, fail) -> None:
        """Checks of the baselines and drift-toolkit fields (issue 4)."""
        for field, options in (("algorithm", ALGORITHMS), ("baseline", CRITIC_FREE_BASELINES),
                               ("actor_delay", ACTOR_DELAYS)):
            if getattr(self, field) not in options:
                fail(f"{field}={getattr(self, field)!r}: must be one of {', '.join(options)}")
        G = self.group_size
        if G < 1:
            fail(f"group_size={G}: must be >= 1 (rollouts per prompt; 1 is single-rollout)")
        if self.algorithm == "grpo" and G < 2:
            fail(f"group_size={G} with algorithm='grpo': a group of one rollout has advantage 0 "
                 "(its reward minus its own mean), so nothing would train; set --group_size>=2 "
                 "(the paper's GRPO: 8) or use --algorithm=critic_free or sao for single rollouts")
        if self.batch_size % G:
            fail(f"batch_size={self.batch_size} is not a multiple of group_size={G}: a GRPO "
                 "batch is prompts x G whole groups; make batch_size a multiple of group_size")
        if self.actor_batch % G:
            fail(f"actor_batch={self.actor_batch} is not a multiple of group_size={G}: actors "
                 "generate whole groups; make actor_batch a multiple of group_size")
        if self.effective_queue_capacity < G:
            fail(f"queue capacity {self.effective_queue_capacity} < group_size={G}: actors could "
                 "never insert a whole group, a deadlock; raise queue_capacity")
        if not 0.0 < self.ppo_clip_low < 1.0:
            fail(f"ppo_clip_low={self.ppo_clip_low}: must be in (0, 1); the clip range starts at "
                 "1 - ppo_clip_low, which must stay positive (PPO/GRPO: 0.2)")
        if self.ppo_clip_high <= 0.0:
            fail(f"ppo_clip_high={self.ppo_clip_high}: must be > 0 (PPO/GRPO: 0.2; DAPO: 0.28)")
        if self.tis_cap <= 0.0:
            fail(f"tis_cap={self.tis_cap}: the truncation C of min(pi_old/mu, C) must be > 0 "
                 "(typical: 2)")
        if not 0.0 < self.icepop_low <= 1.0 <= self.icepop_high:
            fail(f"icepop_low={self.icepop_low}, icepop_high={self.icepop_high}: need "
                 "0 < icepop_low <= 1 <= icepop_high so on-policy tokens (ratio 1) are kept "
                 "(IcePop: 0.5 and 5)")
        if not 0.0 <= self.baseline_decay < 1.0:
            fail(f"baseline_decay={self.baseline_decay}: must be in [0, 1)")
        if not 1 <= self.policy_minibatches <= self.batch_size // G:
            fail(f"policy_minibatches={self.policy_minibatches}: must be in [1, batch_size/"
                 f"group_size={self.batch_size // G}] (each minibatch needs at least one prompt)")
        if self.algorithm != "sao" and (self.value_pretrain_steps or self.critic_warmup_steps):
            fail(f"algorithm={self.algorithm!r} has no critic: value_pretrain_steps="
                 f"{self.value_pretrain_steps} and critic_warmup_steps={self.critic_warmup_steps}"
                 " must be 0 (or use --algorithm=sao)")
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
        if self.shift_every < 1:
            fail(f"shift_every={self.shift_every}: must be >= 1 (policy versions per reward phase)")

    def _validate_vllm(self, fail) -> None:
        """Checks of the vLLM engine fields (issue 5)."""
        if self.vllm_weight_sync_mode not in VLLM_WEIGHT_SYNC_MODES:
            fail(f"vllm_weight_sync_mode={self.vllm_weight_sync_mode!r}: must be one of "
                 f"{', '.join(VLLM_WEIGHT_SYNC_MODES)} (keep: in-flight requests continue on the "
                 "new weights; abort: they are aborted and restarted)")
        if not self.vllm_start_timeout_s > 0:
            fail(f"vllm_start_timeout_s={self.vllm_start_timeout_s}: must be > 0 seconds")
        if self.vllm_max_restarts < 0:
            fail(f"vllm_max_restarts={self.vllm_max_restarts}: must be >= 0 (0: never restart)")
        if self.vllm_kv_cache_gb < 1:
            fail(f"vllm_kv_cache_gb={self.vllm_kv_cache_gb}: must be >= 1 (GiB of KV cache)")
        if self.engine == "vllm":
            import os

            from sao_actor_learner.engines.vllm_engine import resolve_vllm_python  # no torch
            python = resolve_vllm_python(self.vllm_python)
            if not os.path.exists(python):
                fail(f"engine='vllm' needs the vLLM environment: vllm_python={python!r} does not "
                     "exist; build it with `make vllm-env` or set --vllm_python to a python with "
                     "vllm installed")


# The groups of the SAO program (builder.make_program), for restart_groups and ray_resources.
PROGRAM_GROUPS = ("replay", "variables", "learner", "actor", "evaluator")


def parse_ray_resources(entries) -> dict:
    """{group: {"num_cpus": c, "num_gpus": g}} from entries "GROUP:CPUS[:GPUS]" (issue 7)."""
    out = {}
    for entry in entries:
        parts = str(entry).split(":")
        if len(parts) not in (2, 3) or parts[0] not in PROGRAM_GROUPS:
            raise ValueError(f"ray_resources entry {entry!r}: must be GROUP:CPUS[:GPUS] with "
                             f"GROUP one of {', '.join(PROGRAM_GROUPS)}, e.g. learner:1:1")
        try:
            amounts = [float(x) for x in parts[1:]]
        except ValueError:
            raise ValueError(f"ray_resources entry {entry!r}: CPUS and GPUS must be numbers, "
                             "e.g. actor:1 or learner:2:1") from None
        if any(a < 0 for a in amounts):
            raise ValueError(f"ray_resources entry {entry!r}: amounts must be >= 0")
        if parts[0] in out:
            raise ValueError(f"ray_resources names group {parts[0]!r} twice")
        out[parts[0]] = {"num_cpus": amounts[0], "num_gpus": amounts[1] if len(amounts) > 1
                         else 0.0}
    return out
