"""Named profiles: sets of config values chosen together, applied under what a user sets.

Precedence, highest first:
  1. what the user sets: flags given on the command line (`programs/sao.py --num_actors=2`),
     keyword arguments of `SAOConfig.from_profile(name, **given)`;
  2. the profile's values (`--profile=lean`);
  3. the task's defaults (its `TaskSpec.defaults`, tasks/registry.py, for fields left at 0 / "");
  4. the field defaults of the sections.
A value given explicitly always wins, also when it equals the field's default
(`--profile=lean --num_actors=2` runs two actors). The profile is applied once, when the config
is made from flags or by `from_profile`; the resolved config records the profile's name and
every resolved value, so config.json, `SAOConfig.from_json` and `replace` never apply it again.
`SAOConfig(profile=...)` alone only records the name.

What each profile buys and costs, measured: docs/DESIGN.md (The lean profile) and
BENCHMARKS.md.
Standard library only (the launcher validates configs without torch).
"""
from __future__ import annotations

from typing import Any, Dict, Mapping

PROFILES: Dict[str, Dict[str, Any]] = {
    # Small models, where the program's fixed costs (processes, the second network, the
    # evaluator) outweigh generation and training: fewer processes on few cores and one network.
    # Not SAO's critic (critic=shared_trunk departs from the method: docs/METHOD.md section 6).
    "lean": {
        "num_actors": 1,                 # one actor process: the learner gets a core
        "critic": "shared_trunk",        # one network; no critic forward/backward passes
        "evaluator": "in_learner",       # no evaluator process; evaluates in the learner
    },
}


def profile_values(name: str) -> Dict[str, Any]:
    """The values of profile `name` ("" : none); a KeyError names the known profiles."""
    if not name:
        return {}
    if name not in PROFILES:
        raise KeyError(f"profile={name!r}: must be one of {', '.join(sorted(PROFILES))} or empty")
    return dict(PROFILES[name])


def apply_profile(name: str, given: Mapping[str, Any]) -> Dict[str, Any]:
    """The config fields of profile `name` under the explicitly `given` ones (which win), plus
    `profile=name`: the keyword arguments of the config."""
    return {**profile_values(name), **given, "profile": name}
