"""Checks that run before a program launches, so bad input fails before any node starts.

`check_before_launch(config)` runs in the launcher process. Its cheap part needs only the file
system: the model directory has a config (a JSON object), a tokenizer and intact weights
(every safetensors header read, the file's size checked against it, the embedding against
vocab_size); a critic directory has a config and intact weights, the policy's model_type, sizes
and vocab_size, and no tokenizer or the policy's (models/model_dir.check_critic_dir); with
critic_concurrent, neither config.json sets a dropout above 0 (`check_no_dropout`). Checks
that need the model's tokenizer or architecture (which import torch and transformers, ~300 MB the
launcher would keep for the whole run) run in a short-lived subprocess (`python -m
sao_actor_learner.preflight`, the config as JSON on stdin):
  - the critic's frozen-parameter patterns each match a parameter of the critic's body;
  - LoRA (lora_rank > 0): peft is installed and each --lora_target_modules pattern matches a
    linear layer of the model (empty: the architecture has default targets);
  - the tokenizer fits the model (no more ids than the model has rows);
  - task=dataset: the reward spec imports with the right signature, every dataset row is
    well-formed, prompts render (chat template) and fit max_prompt_length (over-long ones are
    counted; none left is an error).
Each `--tracker` must import (else the error names its pip extra) and be able to start
(observers/trackers.check_trackers); the packages of trackers not chosen are never imported.
The subprocess runs only when such a check applies: a dataset task, a model directory that is
not one of this project's char-level checkpoints (their architecture is the factory's, whose
names the default patterns are tested against), a critic directory, non-default patterns, or
LoRA. A verdict it passed is kept in the start-up cache (disk_cache.py), keyed by the config
fields it reads (MODEL_CHECK_FIELDS), the model and critic directories' files and the dataset
files' stamps: a second launch on the same inputs (a benchmark's repeats, a resumed run) starts
without it (~7 s of imports and tokenizing). A failed verdict is never kept, and a reward from
a file ("file.py:fn") always runs the checks (what that file imports is not tracked).
Last of all, after every input (so a refusal there never hides a wrong input): a fresh run
would delete only folders this project made (run_dirs.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict

from sao_actor_learner import disk_cache
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.learner import registry
from sao_actor_learner.models.model_dir import (CHAR_TOKENIZER_FILE, ModelDirError,
                                                check_critic_dir, check_model_dir)
from sao_actor_learner.observers.trackers import check_trackers
from sao_actor_learner.run_dirs import check_fresh_run

DEFAULT_FROZEN_PATTERNS = SAOConfig.__dataclass_fields__["critic_frozen_patterns"].default
# What model_checks reads of the config (tests/test_preflight.py records its reads and holds
# them to this list): the cached verdict's key.
MODEL_CHECK_FIELDS = (
    "algorithm", "answer_key", "apply_chat_template", "critic_frozen_patterns", "critic_model",
    "eval_files", "eval_size", "instruction_suffix", "lora_rank", "lora_target_modules",
    "max_prompt_length", "model", "num_actors", "prompt_key", "reward", "reward_timeout_s",
    "reward_workers", "seed", "shuffle", "system_prompt", "task", "template_kwargs",
    "train_files")


def _model_hint(config: SAOConfig) -> str:
    if config.task in ("arithmetic", "calculator_tool", "online_shift", "preference_drift"):
        return (f" (build the warm start with `make warm-start` or `python programs/sft.py "
                f"--task={config.task} --out_dir={config.model}`)")
    return ""


def needs_model_checks(config: SAOConfig) -> bool:
    """Whether the subprocess checks apply (see the module docstring)."""
    char_checkpoint = os.path.exists(os.path.join(config.model, CHAR_TOKENIZER_FILE))
    return (config.task == "dataset" or not char_checkpoint or bool(config.critic_model) or
            config.lora_rank > 0 or (config.algorithm in registry.CRITIC_ALGORITHMS and
             tuple(config.critic_frozen_patterns) != tuple(DEFAULT_FROZEN_PATTERNS)))


def check_before_launch(config: SAOConfig) -> Dict:
    """Raises ConfigError naming what to change; returns what the checks measured (dataset
    row counts, over-long prompts left out). The inputs are checked first, the run folder last:
    a refusal to clear it is about where the run goes, and must not hide a wrong input."""
    stats = check_inputs(config)
    check_fresh_run(config)   # a fresh run deletes only folders this project made
    return stats


def check_inputs(config: SAOConfig) -> Dict:
    """The checks of check_before_launch but the run folder's."""
    check_trackers(config)    # each --tracker imports (else: the pip extra) and can start
    try:
        check_model_dir(config.model, "--model")
    except ModelDirError as e:
        raise ConfigError(str(e) + _model_hint(config)) from None
    if config.critic_heldout_file and not os.path.isfile(config.critic_heldout_file):
        raise ConfigError(f"--critic_heldout_file={config.critic_heldout_file!r} is not a file "
                          "(held-out rollouts saved by critic/rollout_set.save_rollouts, e.g. a "
                          "critic directory's heldout_rollouts.npz); fix the path or drop it")
    if config.critic_model and not os.path.isdir(config.critic_model):
        raise ConfigError(f"--critic_model={config.critic_model!r} is not a directory (a critic "
                          "directory written by ValueModel.save, or a causal-LM directory)")
    if config.critic_model:
        try:
            check_critic_dir(config.critic_model, config.model)
        except ModelDirError as e:
            raise ConfigError(str(e)) from None
    if config.critic_concurrent:
        check_no_dropout(config)
    if not needs_model_checks(config):
        return {}
    key = verdict_key(config)
    cached = disk_cache.load_json("preflight", key) if key else None
    if cached is not None and isinstance(cached.get("stats"), dict):
        return cached["stats"]
    stats = run_model_checks(config)
    if key:
        disk_cache.save_json("preflight", key, {"stats": stats})
    return stats


def check_no_dropout(config: SAOConfig) -> None:
    """critic_concurrent: the model's (and the critic's) config.json sets no dropout above 0
    (the two threads' training-mode forwards would draw from torch's one generator in an order
    that changes from run to run; learner/critic_worker.py)."""
    for flag, directory in (("--model", config.model), ("--critic_model", config.critic_model)):
        path = os.path.join(directory, "config.json") if directory else ""
        if not path or not os.path.isfile(path):
            continue
        with open(path) as f:
            fields = json.load(f)
        found = [f"{k}={v}" for k, v in fields.items() if ("dropout" in k or "pdrop" in k)
                 and isinstance(v, (int, float)) and v > 0]
        if found:
            raise ConfigError(f"--critic_concurrent=true with {flag}={directory!r}, whose "
                              f"config.json sets {', '.join(found)}: dropout draws from torch's "
                              "one generator in both threads, in an order that changes from "
                              "run to run; drop --critic_concurrent or use a model without "
                              "dropout")


def verdict_key(config: SAOConfig):
    """The start-up cache's key of `config`'s model checks, or None (caching off, or a reward
    from a file, whose imports are not tracked)."""
    from sao_actor_learner.rewards import BUILTINS

    if disk_cache.cache_root() is None or (config.task == "dataset"
                                           and config.reward not in BUILTINS):
        return None
    try:
        files = {"model": disk_cache.directory_fingerprint(config.model)}
        if config.critic_model:
            files["critic"] = disk_cache.directory_fingerprint(config.critic_model)
        if config.task == "dataset":
            files["data"] = [disk_cache.file_fingerprint(f)
                             for f in list(config.train_files) + list(config.eval_files)]
    except OSError:   # a missing file: the checks say which
        return None
    fields = {name: getattr(config, name) for name in MODEL_CHECK_FIELDS}
    return disk_cache.make_key("preflight", [fields, files])


def run_model_checks(config: SAOConfig) -> Dict:
    """model_checks in a short-lived subprocess (torch and transformers stay out of the
    launcher); ConfigError with its verdict."""
    proc = subprocess.run([sys.executable, "-m", "sao_actor_learner.preflight"],
                          input=config.to_json(), capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                               "OMP_NUM_THREADS": "1",   # nothing else runs yet: the dataset
                               "TOKENIZERS_PARALLELISM": "true"})   # is tokenized on every core
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise ConfigError(f"the pre-launch checks crashed (exit {proc.returncode}):\n"
                          f"{proc.stderr[-3000:]}")
    reply = json.loads(lines[-1])
    if "error" in reply:
        raise ConfigError(reply["error"])
    return reply["stats"]


def model_checks(config: SAOConfig) -> Dict:
    """The checks that need torch and transformers (run by the subprocess)."""
    from sao_actor_learner.models.checkpoint import load_tokenizer
    from sao_actor_learner.models.value import critic_parameter_names, match_frozen_patterns

    stats: Dict = {}
    try:
        tokenizer = load_tokenizer(config.model)
    except Exception as e:
        raise ConfigError(f"--model={config.model!r}: its tokenizer does not load ({e})") from None
    with open(os.path.join(config.model, "config.json")) as f:
        rows = json.load(f).get("vocab_size")
    if isinstance(rows, int) and tokenizer.vocab_size > rows:
        raise ConfigError(f"--model={config.model!r}: the tokenizer has {tokenizer.vocab_size} "
                          f"ids but config.json's vocab_size is {rows}: they do not belong "
                          "together")
    stats["tokenizer_vocab_size"] = tokenizer.vocab_size
    if config.algorithm in registry.CRITIC_ALGORITHMS:
        source = config.critic_model or config.model
        try:
            match_frozen_patterns(config.critic_frozen_patterns, critic_parameter_names(source))
        except ValueError as e:
            raise ConfigError(f"{e} (critic from {source!r}; --critic_frozen_patterns)") from None
    if config.lora_rank > 0:
        stats["lora_target_modules"] = len(lora_checks(config))
    if config.task == "dataset":
        stats.update(dataset_checks(config, tokenizer))
    return stats


def lora_checks(config: SAOConfig):
    """LoRA: peft installed, every target pattern matches a linear layer of the model (or the
    architecture has default targets); the adapted module names."""
    from sao_actor_learner.models.lora import check_target_patterns
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigError(f"--lora_rank={config.lora_rank} needs the peft package: "
                          "pip install -e '.[lora]' (make venv installs it)") from None
    try:
        return check_target_patterns(config.model, config.lora_target_modules)
    except ValueError as e:
        raise ConfigError(f"{e} (--model={config.model!r}; --lora_target_modules)") from None


def dataset_checks(config: SAOConfig, tokenizer) -> Dict:
    """Builds the dataset task once (every row read, checked and rendered); its counts."""
    from sao_actor_learner.builder import make_dataset_task
    from sao_actor_learner.rewards import check_reward_spec
    from sao_actor_learner.tasks.dataset_files import DatasetError

    try:
        check_reward_spec(config.reward)
    except ValueError as e:
        raise ConfigError(f"--reward={config.reward!r}: {e}") from None
    try:
        task = make_dataset_task(config, tokenizer)
    except (DatasetError, ValueError) as e:
        raise ConfigError(str(e)) from None
    try:
        return dict(task.stats)
    finally:
        task.close()


def main() -> int:
    config = SAOConfig.from_json(sys.stdin.read())
    try:
        print(json.dumps({"stats": model_checks(config)}))
    except ConfigError as e:
        print(json.dumps({"error": str(e)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
