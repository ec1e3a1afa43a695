"""absl flags generated from a config dataclass: every field is a flag with its default and
its one-sentence help (declared with `config.sections.option`); `key_flags_help`, the text of
`--help`: the flags that matter, by section (`--helpfull` lists all)."""
from __future__ import annotations

import dataclasses
import textwrap
import typing

from absl import flags


def define_flags_from_dataclass(cls, flag_values=flags.FLAGS, skip=()) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        t = hints[f.name]
        default = f.default
        help_ = f.metadata.get("help")
        if not help_:
            raise TypeError(f"{cls.__name__}.{f.name} has no help: declare it with "
                            "config.sections.option(default, help)")
        if t is bool or t == typing.Optional[bool]:   # Optional: None until given
            flags.DEFINE_bool(f.name, default, help_, flag_values=flag_values)
        elif t is int:
            flags.DEFINE_integer(f.name, default, help_, flag_values=flag_values)
        elif t is float:
            flags.DEFINE_float(f.name, default, help_, flag_values=flag_values)
        elif t is str:
            flags.DEFINE_string(f.name, default, help_, flag_values=flag_values)
        elif typing.get_origin(t) is tuple:
            flags.DEFINE_list(f.name, list(default), help_, flag_values=flag_values)
        else:
            raise TypeError(f"no flag type for {cls.__name__}.{f.name}: {t}")


def config_from_flags(cls, flag_values=flags.FLAGS, **overrides):
    """Builds (and so validates) the config from parsed flags.

    A config class with `from_profile` (SAOConfig) and `--profile` set: only the flags given
    (on the command line, or assigned) and `overrides` are passed, so they win over the
    profile's values even when they equal the field's default, and the profile's values win
    over the defaults of the flags left out (config/profiles.py)."""
    names = [f.name for f in dataclasses.fields(cls) if f.name in flag_values]
    profile = overrides.get("profile", flag_values["profile"].value if "profile" in names
                            else "")
    if profile and hasattr(cls, "from_profile"):
        given = {n: flag_values[n].value for n in names if n != "profile" and
                 (flag_values[n].present or not flag_values[n].using_default_value)}
        given.update({k: v for k, v in overrides.items() if k != "profile"})
        return cls.from_profile(profile, **given)
    kwargs = {n: flag_values[n].value for n in names}
    kwargs.update(overrides)
    return cls(**kwargs)


# What `--help` shows, by section: the flags a first run and its usual changes need.
KEY_FLAGS = (
    ("run", ("run_dir", "max_steps", "seed", "resume", "profile", "progress", "eval_every",
             "eval_size")),
    ("task", ("task", "model", "train_files", "eval_files", "reward", "max_new_tokens",
              "max_sequence_length")),
    ("algorithm", ("algorithm", "group_size", "batch_size", "policy_lr", "critic_lr", "critic",
                   "lora_rank")),
    ("staleness", ("max_staleness", "admission_control", "lockstep", "forced_staleness",
                   "queue_capacity")),
    ("engine", ("engine", "dtype", "actor_batch", "temperature", "weight_sync_mode")),
    ("launch", ("launch", "num_actors", "learners", "evaluator", "threads_per_process",
                "auth_token")),
)


def key_flags_help(flag_values=flags.FLAGS, usage: str = "") -> str:
    """`usage`, then KEY_FLAGS by section with each flag's default and help, then where the
    rest are (`--helpfull`)."""
    lines = [usage.rstrip(), ""] if usage else []
    for section, names in KEY_FLAGS:
        lines.append(f"{section}:")
        for name in names:
            flag = flag_values[name]
            shown = f"--[no]{name}" if flag.boolean else f"--{name}"
            default = flag.default_as_str or "''"
            lines.append(f"  {shown} (default: {default})")
            lines.extend(textwrap.wrap(flag.help, width=96, initial_indent="      ",
                                       subsequent_indent="      "))
        lines.append("")
    lines.append("--helpfull lists every flag. README.md, \"Reading a run\", explains the "
                 "progress line\nand the metrics.")
    return "\n".join(lines) + "\n"
