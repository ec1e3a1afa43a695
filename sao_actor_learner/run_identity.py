"""The run id: which run a run folder, its learner checkpoints and its replay items belong to.

A fresh run gets a new random run id; a resumed one keeps its folder's. It is kept in
`<run_dir>/run_id` (RUN_ID_FILE, plain text). It is not a secret: it binds what the run signs and
writes to this run.
- Rollout items carry its tag in their signed header, and each actor signs with a key derived
  from the rollout secret, the run id and its actor id (replay/validation.py): an item of an
  earlier run does not verify in a new one, even under the same `$SAO_ROLLOUT_SECRET`.
- The learner's journal segments record it (learner/segments.py), and a learner resumes only
  from checkpoints whose journal names this run (learner/journal.py ResumePoint): a fresh run
  never resumes from what another run left.

A launch split over hosts (`--groups`) that runs the actors without the learner (or the other
way round) must share the run id as it shares the rollout secret: `$SAO_RUN_ID`, the same new
random value in both launches' environments for every fresh run (the learner's launch refuses
one its run folder already used).

Standard library only (the launcher runs it).
"""
from __future__ import annotations

import os
import secrets
from typing import Mapping, Optional

from sao_actor_learner.config import ConfigError, NetworkConfig, SAOConfig

RUN_ID_FILE = "run_id"
RUN_ID_ENV = "SAO_RUN_ID"
_MIN_CHARS = 16


def read_run_id(run_dir: str) -> str:
    """The run id kept in `run_dir` ("" when there is none)."""
    try:
        with open(os.path.join(run_dir, RUN_ID_FILE)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def write_run_id(run_dir: str, run_id: str) -> str:
    """Keeps `run_id` in `run_dir` (written whole: a temporary file renamed into place)."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, RUN_ID_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(run_id + "\n")
    os.replace(tmp, path)
    return run_id


def _given(environ: Mapping[str, str]) -> str:
    value = environ.get(RUN_ID_ENV, "").strip()
    if value and (len(value) < _MIN_CHARS or not value.isprintable() or " " in value):
        raise ConfigError(f"${RUN_ID_ENV} has {len(value)} characters: use at least "
                          f"{_MIN_CHARS} random ones without spaces (e.g. `python -c 'import "
                          "secrets; print(secrets.token_hex(16))'`), new for every fresh run")
    return value


def begin_run(config: SAOConfig, run_dir: str,
              environ: Optional[Mapping[str, str]] = None) -> str:
    """The launcher's run id for `run_dir`, kept there: a fresh run's is new ($SAO_RUN_ID when
    given, refused when it is the one the folder's earlier run used; else random), a resumed
    run keeps the folder's (a folder of a version before run ids gets a new one; a
    $SAO_RUN_ID that differs from the folder's is refused)."""
    environ = os.environ if environ is None else environ
    given, kept = _given(environ), read_run_id(run_dir)
    if config.resume:
        if given and kept and given != kept:
            raise ConfigError(
                f"resume=True: ${RUN_ID_ENV} differs from the run id of the run in {run_dir!r} "
                f"({os.path.join(run_dir, RUN_ID_FILE)}): a resumed run keeps its run id; set "
                f"${RUN_ID_ENV} to that file's value in every launch of this run, or unset it")
        return kept if kept else write_run_id(run_dir, given or secrets.token_hex(16))
    if given and given == kept:
        raise ConfigError(
            f"${RUN_ID_ENV} is the run id the earlier run in {run_dir!r} used: a fresh run needs "
            "a new one, else that run's rollouts would verify in this one; set a new random "
            f"value (in every launch of this run), or pass --resume to continue that run")
    return write_run_id(run_dir, given or secrets.token_hex(16))


def node_run_id(config: SAOConfig, run_dir: str,
                environ: Optional[Mapping[str, str]] = None) -> str:
    """The run id a program's nodes are given: $SAO_RUN_ID when set, else the one kept in
    `run_dir` (begin_run's), else (a program built without run_program) a new one, not written
    (building a program writes nothing). A launch that runs the actors without the learner (or
    the other way round) needs $SAO_RUN_ID."""
    environ = os.environ if environ is None else environ
    given = _given(environ)
    if given:
        return given
    runs = config.section(NetworkConfig).runs
    if runs("learner") != runs("actor"):
        raise ConfigError(
            f"this launch runs only one of the actors and the learner (--groups): they must "
            f"share the run id, so set ${RUN_ID_ENV} to the same new random value (at least "
            f"{_MIN_CHARS} characters, new for every fresh run) in the environment of both "
            "launches")
    return read_run_id(run_dir) or secrets.token_hex(16)
