"""A fresh run deletes only the folders this project made (run_dirs.py): a folder of one's own
data given as --replay_checkpoint_dir (or found where the run keeps its spools, checkpoints or
journal) is a ConfigError naming the flag and the folder, raised before launch and before
anything is deleted; folders the nodes made carry a marker and are cleared."""
import os
import subprocess
import sys

import pytest

from sao_actor_learner.builder import make_replay_server, prepare_run_dir
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.learner.journal import ReaderJournal, journal_dir
from sao_actor_learner.preflight import check_before_launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_owned_dir(path):
    from sao_actor_learner.run_dirs import make_owned_dir
    return make_owned_dir(path)


def is_owned(path, run_dir):
    from sao_actor_learner.run_dirs import is_owned
    return is_owned(path, run_dir)


def _marker():
    from sao_actor_learner.run_dirs import MARKER
    return MARKER


def _own_data(path):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "thesis.tex"), "w") as f:
        f.write("years of work\n")
    return path


def test_a_folder_of_ones_own_data_is_refused_not_deleted(warm_start, tmp_path):
    data = _own_data(str(tmp_path / "my_data"))
    config = SAOConfig(run_dir=str(tmp_path / "run"), replay_checkpoint_dir=data,
                       model=warm_start)
    with pytest.raises(ConfigError, match=r"--replay_checkpoint_dir: .*my_data.*did not make.*"
                                          r"empty or new folder.*remove"):
        prepare_run_dir(config)
    assert os.path.exists(os.path.join(data, "thesis.tex"))
    # Before launch.
    with pytest.raises(ConfigError, match="--replay_checkpoint_dir"):
        check_before_launch(config)
    assert os.path.exists(os.path.join(data, "thesis.tex"))


def test_the_run_folder_is_checked_after_the_inputs(tmp_path):
    """A wrong input is the root cause to report; the run folder's refusal must not hide it."""
    data = _own_data(str(tmp_path / "my_data"))
    config = SAOConfig(run_dir=str(tmp_path / "run"), replay_checkpoint_dir=data,
                       model=str(tmp_path / "no_model"))
    with pytest.raises(ConfigError, match="--model"):
        check_before_launch(config)
    assert os.path.exists(os.path.join(data, "thesis.tex"))


@pytest.mark.parametrize("where", ["spool", "checkpoints/step_000003", "checkpoints/journal",
                                   "checkpoints/replay", "checkpoints/variables"])
def test_unmarked_folders_in_the_run_dir_are_refused(tmp_path, where):
    run = tmp_path / "run"
    data = _own_data(str(run / where))
    config = SAOConfig(run_dir=str(run))
    with pytest.raises(ConfigError, match=f"--run_dir: .*{where}"):
        prepare_run_dir(config)
    assert os.path.exists(os.path.join(data, "thesis.tex"))


def test_nothing_is_deleted_when_any_folder_is_refused(tmp_path):
    run = tmp_path / "run"
    spool = make_owned_dir(str(run / "spool"))
    _own_data(spool)
    _own_data(str(tmp_path / "mine"))
    config = SAOConfig(run_dir=str(run), replay_checkpoint_dir=str(tmp_path / "mine"))
    with pytest.raises(ConfigError, match="--replay_checkpoint_dir"):
        prepare_run_dir(config)
    assert os.path.exists(os.path.join(spool, "thesis.tex"))


def test_folders_the_nodes_made_are_cleared_and_empty_ones_are_fine(tmp_path):
    run = tmp_path / "run"
    config = SAOConfig(run_dir=str(run), replay_checkpoint_dir=str(tmp_path / "replay_ckpt"))
    server = make_replay_server(config, run_dir=str(run))   # makes and records it (no start)
    # Recorded in the run folder, never marked inside: Reverb manages what is in there.
    assert not os.path.exists(os.path.join(server.checkpoint_dir, _marker()))
    assert is_owned(server.checkpoint_dir, str(run))
    _own_data(server.checkpoint_dir)
    journal = ReaderJournal(journal_dir(str(run / "checkpoints")), 0)   # the learner's journal
    journal.record([1, 2, 3])
    journal.close()
    spool = make_owned_dir(str(run / "spool"))          # what make_actor does
    _own_data(spool)
    os.makedirs(run / "checkpoints" / "variables")      # empty: fine (not ours: left)
    prepare_run_dir(config)
    for gone in (server.checkpoint_dir, str(run / "spool"), str(run / "checkpoints" / "journal")):
        assert not os.path.exists(gone), gone
    assert os.listdir(run / "checkpoints" / "variables") == []


def test_a_folder_that_already_holds_something_is_not_marked(tmp_path):
    data = _own_data(str(tmp_path / "data"))
    make_owned_dir(data)
    assert not os.path.exists(os.path.join(data, _marker()))
    with pytest.raises(ConfigError):
        prepare_run_dir(SAOConfig(run_dir=str(tmp_path / "run"), replay_checkpoint_dir=data))


def test_the_program_runs_twice_into_one_run_folder(warm_start, tmp_path):
    """The real program with the real replay server, whose checkpointer deletes what it did not
    write in the replay checkpoint folder: a second fresh run into the same --run_dir clears
    the first's folders and runs (it used to refuse the project's own replay folder)."""
    run = tmp_path / "run"
    args = [sys.executable, os.path.join(REPO, "programs", "sao.py"), "--task=arithmetic",
            f"--init_checkpoint={warm_start}", f"--run_dir={run}", "--max_steps=2",
            "--batch_size=4", "--actor_batch=4", "--num_actors=1", "--eval_every=0",
            "--eval_size=4", "--launch=local_mt", "--noprogress"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    replay = run / "checkpoints" / "replay"
    for attempt in (1, 2):
        proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env,
                              timeout=300)
        assert proc.returncode == 0, (attempt, proc.stderr[-3000:])
        assert "held-out accuracy" in proc.stdout and "(warm start)" in proc.stdout
        assert 'README.md, section "Reading a run"' in proc.stdout   # where a run ends
        assert os.listdir(replay), "the replay node wrote no checkpoint"   # Reverb's own files
    assert is_owned(str(replay), str(run))


def test_a_run_dir_with_glob_characters_clears_only_its_own_folders(tmp_path):
    """--run_dir=g/x[1]: the folders a fresh run clears are found by listing the run's own
    checkpoints folder, not by a glob pattern ("[1]" would match the neighbour g/x1)."""
    mine, neighbour = tmp_path / "g" / "x[1]", tmp_path / "g" / "x1"
    theirs = make_owned_dir(str(neighbour / "checkpoints" / "step_000001"))
    _own_data(theirs)
    own = make_owned_dir(str(mine / "checkpoints" / "step_000001"))
    own_journal = make_owned_dir(str(mine / "checkpoints" / "journal"))
    prepare_run_dir(SAOConfig(run_dir=str(mine)))
    assert os.path.exists(os.path.join(theirs, "thesis.tex"))   # another run's: untouched
    assert not os.path.exists(own) and not os.path.exists(own_journal)


def test_a_users_empty_folder_is_used_but_never_marked(tmp_path):
    """An empty folder given as --replay_checkpoint_dir is used, but it is the user's: it is
    not marked, so once it holds something a fresh run refuses to delete it."""
    data = tmp_path / "my_empty_folder"
    os.makedirs(data)
    config = SAOConfig(run_dir=str(tmp_path / "run"), replay_checkpoint_dir=str(data))
    prepare_run_dir(config)                              # empty: fine, and left alone
    server = make_replay_server(config, run_dir=str(tmp_path / "run"))
    assert server.checkpoint_dir == str(data) and os.path.isdir(data)
    assert not os.path.exists(os.path.join(data, _marker()))
    _own_data(str(data))
    with pytest.raises(ConfigError, match="--replay_checkpoint_dir"):
        prepare_run_dir(config)
    assert os.path.exists(os.path.join(data, "thesis.tex"))


def test_temporary_siblings_are_deleted_only_when_ours(tmp_path):
    """`<x>.tmp-<pid>` (checkpoints, a critic) and `<x>.partial` (a conversion): a crashed
    writer's marked one is replaced; someone else's folder of that name is never deleted."""
    from sao_actor_learner.learner.checkpoint_files import (begin_checkpoint, checkpoint_path,
                                                            prune_checkpoints)
    from sao_actor_learner.run_dirs import remove_if_ours
    root = str(tmp_path / "checkpoints")
    path = checkpoint_path(root, 3)
    theirs = _own_data(f"{path}.tmp-{os.getpid()}")
    with pytest.raises(RuntimeError, match=r"step_000003\.tmp-.*not a folder this project"):
        begin_checkpoint(path)
    assert os.path.exists(os.path.join(theirs, "thesis.tex"))
    prune_checkpoints(root, keep=1)                       # leaves it alone too
    assert os.path.exists(os.path.join(theirs, "thesis.tex"))
    os.remove(os.path.join(theirs, "thesis.tex"))         # empty: may go
    ours = begin_checkpoint(path)
    assert os.path.exists(os.path.join(ours, _marker()))
    _own_data(ours)                                       # a crashed writer's, marked
    assert begin_checkpoint(path) == ours and not os.path.exists(
        os.path.join(ours, "thesis.tex"))
    prune_checkpoints(root, keep=1)
    assert not os.path.exists(ours)
    partial = _own_data(str(tmp_path / "model.partial"))
    with pytest.raises(RuntimeError, match="the conversion"):
        remove_if_ours(partial, "the conversion")
    assert os.path.exists(os.path.join(partial, "thesis.tex"))


def test_a_model_path_with_glob_characters_is_read_as_written(tmp_path):
    """--model=g/x[1]: its weights are looked for in g/x[1], never in a neighbour g/x1."""
    from sao_actor_learner.models.model_dir import ModelDirError, check_model_dir
    mine, neighbour = tmp_path / "x[1]", tmp_path / "x1"
    for folder in (mine, neighbour):
        os.makedirs(folder)
        (folder / "config.json").write_text("{}")
        (folder / "tokenizer.json").write_text("{}")
    (neighbour / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelDirError, match=r"x\[1\].*holds no weights"):
        check_model_dir(str(mine))
