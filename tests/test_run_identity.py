"""The run id (run_identity.py): new for every fresh run, kept on resume, shared by split
launches through $SAO_RUN_ID; and a learner resumes only what its own run wrote, so a fresh
run never resumes from checkpoints another run left in its folder."""
import os

import numpy as np
import pytest

from sao_actor_learner.builder import prepare_run_dir
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.learner.checkpoint_files import LEARNER_STATE_FILE, checkpoint_path
from sao_actor_learner.learner.journal import ReaderJournal, ResumePoint, journal_dir
from sao_actor_learner.run_identity import (RUN_ID_ENV, begin_run, node_run_id, read_run_id)
from sao_actor_learner.types import Rollout

RUN_A = "a" * 32
RUN_B = "b" * 32


def rollout(k):
    mask = np.array([0, 1, 1], np.int8)
    return Rollout(tokens=np.arange(3), action_mask=mask, rollout_logp=np.zeros(3),
                   versions=np.where(mask, 0, -1), rewards=[0, 0, 1.0], prompt_id=k, seq=k)


def learner_left(root, run_id, step=2):
    """What a learner of run `run_id` leaves: journal segment 0, a checkpoint at `step` and
    the segment after it."""
    journal = ReaderJournal(journal_dir(root), 0, run_id)
    journal.record([rollout(0), rollout(1)])

    def commit():
        path = checkpoint_path(root, step)
        os.makedirs(path)
        with open(os.path.join(path, LEARNER_STATE_FILE), "wb") as f:
            f.write(b"state")
        return path

    journal.rotate(step, commit)
    journal.record([rollout(2)])
    journal.close()


def test_a_learner_resumes_only_what_its_own_run_wrote(tmp_path):
    root = str(tmp_path / "checkpoints")
    learner_left(root, RUN_A)
    same = ResumePoint(root, run_id=RUN_A)                 # a restart within run A
    assert same.checkpoint == checkpoint_path(root, 2) and same.resuming
    assert [r.prompt_id for record in same.replay for r in record] == [2]
    with pytest.raises(RuntimeError, match=r"names run '" + RUN_A + "', not this run '" +
                       RUN_B + "'.*start a fresh run"):
        ResumePoint(root, run_id=RUN_B)                    # a fresh run B finds A's leftovers
    fresh = ResumePoint(str(tmp_path / "empty"), run_id=RUN_B)   # nothing there: a fresh start
    assert not fresh.resuming


def test_a_fresh_run_gets_a_new_run_id_and_a_resumed_one_keeps_it(tmp_path):
    config = SAOConfig(run_dir=str(tmp_path / "run"))
    environ = {}
    prepare_run_dir(config)
    first = read_run_id(config.run_dir)
    assert len(first) >= 16
    assert begin_run(config.replace(resume=True), config.run_dir, environ) == first
    assert begin_run(config, config.run_dir, environ) not in ("", first)   # fresh: new
    assert node_run_id(config, config.run_dir, environ) == read_run_id(config.run_dir)


def test_split_launches_share_a_run_id_that_is_new_per_fresh_run(tmp_path):
    run_dir = str(tmp_path / "run")
    actors = SAOConfig(run_dir=run_dir, groups=("actor",),
                       service_addresses=("replay=10.0.0.1:1", "variables=10.0.0.1:2"),
                       insecure_transport=True)
    with pytest.raises(ConfigError, match=RUN_ID_ENV):
        node_run_id(actors, run_dir, {})
    environ = {RUN_ID_ENV: RUN_A}
    assert node_run_id(actors, run_dir, environ) == RUN_A
    learner = SAOConfig(run_dir=run_dir)
    assert begin_run(learner, run_dir, environ) == RUN_A
    with pytest.raises(ConfigError, match="earlier run .* used"):
        begin_run(learner, run_dir, environ)             # the same id for a new fresh run
    with pytest.raises(ConfigError, match="differs"):
        begin_run(learner.replace(resume=True), run_dir, {RUN_ID_ENV: RUN_B})
    with pytest.raises(ConfigError, match="16 random"):
        node_run_id(learner, run_dir, {RUN_ID_ENV: "short"})
