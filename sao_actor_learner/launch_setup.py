"""What a launch sets up before any node starts: the run folder (fresh or resumed) and the
`launch()` arguments a config implies (restarts, placement, liveness, Ray).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from sao_actor_learner.config import SAOConfig
from sao_actor_learner.run_dirs import clear_fresh_run

__all__ = ["prepare_run_dir", "check_resumable", "previous_config", "launch_options"]


def prepare_run_dir(config: SAOConfig, run_dir: Optional[str] = None) -> None:
    """A fresh run (resume=False) clears what a resumed one would pick up from run_dir: learner
    checkpoints and journal, the replay checkpoint, the actors' spools and the variable server's
    state; only folders this project made (ConfigError naming the flag and folder otherwise,
    run_dirs.py). Then it keeps the run id there (run_identity.py): new for a fresh run, the
    folder's for a resumed one."""
    from sao_actor_learner.run_identity import begin_run
    run_dir = run_dir or config.run_dir
    if config.resume:
        check_resumable(config, run_dir)
    else:
        clear_fresh_run(config, run_dir)
    begin_run(config, run_dir)   # a fresh run's new run id, a resumed run's kept one


def check_resumable(config: SAOConfig, run_dir: str) -> None:
    """--resume: the replay checkpoint brings back its own rate limiter (docs/FACTS.md), so a changed
    queue capacity would silently not apply; refuse it before anything starts, and the other
    settings a resumed run cannot change (resume_checks.py)."""
    from sao_actor_learner.config import ConfigError
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        raise ConfigError(f"resume=True but {run_dir!r} holds no config.json: nothing to resume; "
                          "drop --resume to start a new run there")
    previous = previous_config(path)
    if config.replay_checkpoints and \
            previous.effective_queue_capacity != config.effective_queue_capacity:
        raise ConfigError(
            f"resume=True with queue capacity {config.effective_queue_capacity} (queue_capacity="
            f"{config.queue_capacity}, batch_size={config.batch_size}), but the run in "
            f"{run_dir!r} used {previous.effective_queue_capacity}: Reverb restores the replay "
            "checkpoint's rate limiter, so the new capacity would not apply; resume with "
            f"queue_capacity={previous.effective_queue_capacity}")
    from sao_actor_learner.resume_checks import check_resumed_settings
    check_resumed_settings(previous, config, run_dir)   # batch_size, model, ...: refused


def previous_config(path: str) -> SAOConfig:
    """The config a run folder's config.json holds (known renamed keys read as their new
    names, removed ones ignored: SAOConfig.from_json). Every resume check compares against
    it, so one that cannot be read is a ConfigError naming the file and what to do, never a
    reason to skip the checks."""
    import dataclasses
    import json

    from sao_actor_learner.config import REMOVED_FIELDS, RENAMED_FIELDS, ConfigError
    fresh = ("or start a fresh run in another --run_dir (a fresh run there would delete the "
             "checkpoints)")
    try:
        with open(path) as f:
            text = f.read()
        fields = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(
            f"resume=True: {path} cannot be read as JSON ({e}): the resume checks (batch_size, "
            "model, queue capacity, ...) compare against it, so nothing is resumed without "
            "it; restore the file as the run wrote it, " + fresh) from None
    if not isinstance(fields, dict):
        raise ConfigError(f"resume=True: {path} holds a JSON {type(fields).__name__}, not the "
                          "run's settings (an object); restore it as the run wrote it, " + fresh)
    known = {f.name for f in dataclasses.fields(SAOConfig)} | set(REMOVED_FIELDS) | \
        set(RENAMED_FIELDS)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(
            f"resume=True: {path} holds settings this version does not know: "
            f"{', '.join(unknown)} (neither a field nor a known earlier name of one): the "
            "resume checks cannot vouch for a run they cannot read; resume with the version "
            "that wrote it, or delete those keys from the file if you know they do not "
            "matter, " + fresh)
    try:
        return SAOConfig.from_json(text)
    except (TypeError, ValueError) as e:   # ConfigError is a ValueError
        raise ConfigError(f"resume=True: {path} does not make a valid config with this version "
                          f"({e}); fix that value in the file, " + fresh) from None


def launch_options(config: SAOConfig) -> dict:
    """The `launch()` arguments a config implies: restart policies, bind host, Ray cluster and
    per-group Ray resources."""
    from sao_actor_learner import launch as lp
    from sao_actor_learner.config import parse_ray_resources
    policy = lp.RestartPolicy(max_restarts=config.max_restarts,
                              backoff_s=config.restart_backoff_s,
                              max_backoff_s=max(30.0, config.restart_backoff_s))
    restart = {group: policy for group in config.restart_groups}
    if config.learners > 1 and "learner" in restart:   # a group of ranks dies and comes back whole
        restart["learner"] = dataclasses.replace(policy, together=True)
        restart["learner_store"] = policy   # a fresh store: the ranks fail and re-join it
    options = {"restart": restart, "bind_host": config.bind_host,
               "service_timeout_s": config.service_timeout_s}
    if config.launch == "ray":
        options["ray_address"] = config.ray_address or None
        options["resources"] = parse_ray_resources(config.ray_resources)
    from sao_actor_learner.config.sections import PROGRAM_GROUPS
    from sao_actor_learner.launch.placement import placement_launch_options
    options.update(placement_launch_options(config.placement, config.launch, PROGRAM_GROUPS))
    from sao_actor_learner.launch.loopback import local_mp_guards   # heartbeats, loopback binds
    options.update(local_mp_guards(config.launch, config.bind_host, config.node_timeout_s, options))
    return options

