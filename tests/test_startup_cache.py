"""The start-up cache (disk_cache.py): rendered prompts and passed pre-launch verdicts are
reused only while every input is the same; a damaged, unwritable or disabled cache costs speed,
never correctness."""
import dataclasses
import os

import pytest

import hf_fixtures as fx
from sao_actor_learner import disk_cache, preflight
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.rewards import make_reward
from sao_actor_learner.tasks.dataset import DatasetTask, PromptRenderer
from test_dataset_task import model_dir, tok  # noqa: F401  (the tiny Qwen3 and its tokenizer)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv(disk_cache.ENV, str(folder))
    return folder


@pytest.fixture
def files(tmp_path):
    train = fx.write_parquet(str(tmp_path / "train.parquet"), fx.gsm_rows(30))
    test = fx.write_jsonl(str(tmp_path / "test.jsonl"), fx.gsm_rows(6, start=500))
    return train, test


def _task(tok, files, **renderer):
    return DatasetTask(tok, [files[0]], [files[1]], make_reward("gsm8k"),
                       renderer=PromptRenderer(tok, **renderer))


def _all_ids(task):
    return [task.prompt_at(i).token_ids for i in range(task.num_train)], \
        [p.token_ids for p in task.eval_prompts()]


# --- the store --------------------------------------------------------------------------------
def test_sequences_round_trip_and_a_damaged_entry_is_a_miss(cache):
    seqs = [(1, 2, 3), (), (7,), tuple(range(50))]
    disk_cache.save_sequences("prompts", "k", seqs)
    assert disk_cache.load_sequences("prompts", "k", 4) == seqs
    assert disk_cache.load_sequences("prompts", "k", 3) is None      # rows changed in number
    assert disk_cache.load_sequences("prompts", "other", 4) is None
    path = cache / "prompts" / "k.npz"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])                          # truncated
    assert disk_cache.load_sequences("prompts", "k", 4) is None
    disk_cache.save_json("preflight", "v", {"stats": {"a": 1}})
    assert disk_cache.load_json("preflight", "v") == {"stats": {"a": 1}}
    (cache / "preflight" / "v.json").write_text("{not json")
    assert disk_cache.load_json("preflight", "v") is None


def test_off_writes_nothing_and_an_unwritable_cache_only_warns(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.ENV, "off")
    assert disk_cache.cache_root() is None
    disk_cache.save_json("preflight", "v", {"x": 1})
    assert disk_cache.load_json("preflight", "v") is None
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(disk_cache.ENV, str(blocker))   # its kinds cannot be made under a file
    with pytest.warns(RuntimeWarning, match="could not write"):
        disk_cache.save_sequences("prompts", "k", [(1, 2)])
    assert disk_cache.load_sequences("prompts", "k", 1) is None


def test_an_entry_is_written_without_touching_the_process_umask(cache, monkeypatch):
    """The process-wide umask is never changed (another thread making a file meanwhile would
    get it): the entry gets 0o666 less the umask from the kernel."""
    real_umask = os.umask
    umask = os.umask(0o027)
    os.umask(umask | 0o027)
    try:
        def no_umask_calls(mask):
            raise AssertionError(f"os.umask({mask:#o}) called: process-wide, racy")
        monkeypatch.setattr(os, "umask", no_umask_calls)
        disk_cache.save_json("preflight", "v", {"x": 1})
        monkeypatch.setattr(os, "umask", real_umask)
        assert disk_cache.load_json("preflight", "v") == {"x": 1}
        [entry] = [p for p in (cache / "preflight").iterdir() if not p.name.startswith(".")]
        assert entry.stat().st_mode & 0o777 == 0o666 & ~(umask | 0o027)
        assert not [p for p in (cache / "preflight").iterdir() if p.name.startswith(".tmp")]
    finally:
        os.umask(umask)


def test_each_kind_keeps_its_newest_entries(cache, monkeypatch):
    monkeypatch.setattr(disk_cache, "MAX_ENTRIES", 3)
    for i in range(5):
        disk_cache.save_json("preflight", f"k{i}", {"i": i})
        os.utime(cache / "preflight" / f"k{i}.json", ns=(i * 10**9, i * 10**9))
    disk_cache.save_json("preflight", "k5", {"i": 5})
    assert sorted(os.listdir(cache / "preflight")) == ["k3.json", "k4.json", "k5.json"]


# --- rendered prompts -------------------------------------------------------------------------
def test_a_second_task_reads_the_rendered_prompts_and_gets_the_same_ids(tok, files, monkeypatch):
    first = _task(tok, files)
    assert first.prompt_cache_hits == 0
    second = _task(tok, files)
    assert second.prompt_cache_hits == 2           # train and eval
    assert _all_ids(second) == _all_ids(first)
    assert second.stats == first.stats
    monkeypatch.setenv(disk_cache.ENV, "off")
    assert _all_ids(_task(tok, files)) == _all_ids(first)


def test_changed_rows_or_settings_render_again(tok, files):
    _task(tok, files)
    assert _task(tok, files, system_prompt="Be brief.").prompt_cache_hits == 0
    assert _task(tok, files, instruction_suffix=" Think.").prompt_cache_hits == 0
    rows = fx.gsm_rows(30)
    rows[4]["prompt"][0]["content"] = "What is 1 plus 1? Answer after ####."   # same file size
    fx.write_parquet(files[0], rows)
    changed = _task(tok, files)
    assert changed.prompt_cache_hits == 1          # eval only
    expect = PromptRenderer(tok).render(rows[4]["prompt"])
    assert any(changed.prompt_at(i).token_ids == tuple(expect) for i in range(30))


# --- pre-launch verdicts ----------------------------------------------------------------------
def _dataset_config(model_dir, files, tmp_path, **kw):
    kw = {"eval_size": 4, "reward": "gsm8k", **kw}
    return SAOConfig(task="dataset", model=model_dir, train_files=[files[0]],
                     eval_files=[files[1]], run_dir=str(tmp_path / "run"), **kw)


def test_a_passed_verdict_is_reused_while_its_inputs_are_the_same(model_dir, files, tmp_path,
                                                                   monkeypatch):
    config = _dataset_config(model_dir, files, tmp_path)
    stats = preflight.check_before_launch(config)
    assert stats["train_rows"] == 30 and stats["eval_rows"] == 6

    def must_not_run(config):
        raise AssertionError("the checks ran again")
    with monkeypatch.context() as m:
        m.setattr(preflight, "run_model_checks", must_not_run)
        assert preflight.check_before_launch(config) == stats
        # Fields the checks do not read (the learning rate, the run folder) share the verdict.
        other = dataclasses.replace(config, policy_lr=1e-3, run_dir=str(tmp_path / "run2"))
        assert preflight.check_before_launch(other) == stats
    # A field they read, or a file they read, makes the checks run again.
    assert preflight.verdict_key(dataclasses.replace(config, eval_size=5)) != \
        preflight.verdict_key(config)
    fx.write_parquet(files[0], fx.gsm_rows(31))
    assert preflight.check_before_launch(config)["train_rows"] == 31


def test_a_failed_verdict_is_never_kept(model_dir, files, tmp_path):
    config = _dataset_config(model_dir, files, tmp_path, eval_size=50)   # only 6 eval rows
    for _ in range(2):
        with pytest.raises(ConfigError, match="eval_size"):
            preflight.check_before_launch(config)
    assert not (tmp_path / "cache" / "preflight").exists() or \
        not os.listdir(tmp_path / "cache" / "preflight")


def test_a_reward_from_a_file_is_never_cached(model_dir, files, tmp_path):
    reward = tmp_path / "my_reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0\n")
    config = _dataset_config(model_dir, files, tmp_path, reward=f"{reward}:score")
    assert preflight.verdict_key(config) is None
    assert preflight.verdict_key(_dataset_config(model_dir, files, tmp_path)) is not None


def test_the_key_covers_every_field_the_checks_read(model_dir, files, tmp_path):
    """MODEL_CHECK_FIELDS is the verdict's key: a field model_checks reads but the key left
    out would let a changed config reuse a verdict given to another."""
    config = _dataset_config(model_dir, files, tmp_path)
    read = set()

    class Recording:
        def __getattr__(self, name):
            read.add(name)
            return getattr(config, name)

    preflight.model_checks(Recording())
    assert read and read <= set(preflight.MODEL_CHECK_FIELDS), \
        sorted(read - set(preflight.MODEL_CHECK_FIELDS))
