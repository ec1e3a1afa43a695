"""`--resume` with other settings (resume_checks.py): a changed batch_size, --model (or a model
directory whose architecture is no longer the checkpoint's) is refused before anything
launches, naming the flags; a changed max_staleness carries over. The admission arithmetic
behind the refusal and the carry-over is simulated on the real `Admission` rule."""
import os

import pytest

from sao_actor_learner.builder import prepare_run_dir
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.models import CharTokenizer, make_tiny_model
from sao_actor_learner.models import checkpoint as ckpt
from sao_actor_learner.run import run_program
from sao_actor_learner.variables.admission import Admission

TOK = CharTokenizer()


def _model_dir(path, hidden_size=64):
    ckpt.save_checkpoint(make_tiny_model("llama", vocab_size=TOK.vocab_size,
                                         hidden_size=hidden_size, num_heads=2,
                                         intermediate_size=64, seed=1), TOK, str(path))
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return _model_dir(root / "a"), _model_dir(root / "b", hidden_size=128)


def _launched_run(tmp_path, model):
    """A run folder as a launched run leaves it: its config.json and a learner checkpoint of
    `model`'s architecture (a model directory, as the learner writes it)."""
    config = SAOConfig(run_dir=str(tmp_path / "run"), model=model, batch_size=8,
                       max_staleness=2, replay_checkpoints=False, evaluator="off")
    os.makedirs(config.run_dir)
    with open(os.path.join(config.run_dir, "config.json"), "w") as f:
        f.write(config.to_json())
    step = os.path.join(config.run_dir, "checkpoints", "step_000004")
    _model_dir(step)
    with open(os.path.join(step, "learner_state.pt"), "wb") as f:
        f.write(b"state")
    return config


def _with_model(config, model, **changes):
    return config.replace(model=model, init_checkpoint=model, **changes)


def _never_launched(config):
    raise AssertionError("the program was built: the refusal came after launch")


def test_a_changed_batch_size_is_refused_before_launch(models, tmp_path):
    config = _launched_run(tmp_path, models[0])
    halved = config.replace(resume=True, batch_size=4)
    with pytest.raises(ConfigError) as e:
        run_program(halved, _never_launched, progress=False)
    message = str(e.value)
    assert "--batch_size=4 (the run used 8)" in message
    assert "Resume with --batch_size=8" in message
    assert "step_000004" in message              # or a new run from the newest checkpoint
    with open(os.path.join(config.run_dir, "config.json")) as f:   # nothing was rewritten
        assert SAOConfig.from_json(f.read()).batch_size == 8


def test_another_model_is_refused_before_launch(models, tmp_path):
    config = _launched_run(tmp_path, models[0])
    with pytest.raises(ConfigError, match=r"--model=.*/b' \(the run used .*/a'\).*restart "
                                          r"loop"):
        run_program(_with_model(config, models[1], resume=True), _never_launched,
                    progress=False)
    both = _with_model(config, models[1], resume=True, batch_size=16)
    with pytest.raises(ConfigError, match=r"--batch_size=16 .*--model="):  # every flag named
        prepare_run_dir(both)


def test_a_model_directory_rebuilt_with_another_architecture_is_refused(models, tmp_path):
    """Same --model path, but what it holds now is not the checkpoint's architecture."""
    config = _launched_run(tmp_path, models[0])
    same_path = str(tmp_path / "model")
    _model_dir(same_path)
    config = _with_model(config, same_path)
    with open(os.path.join(config.run_dir, "config.json"), "w") as f:
        f.write(config.to_json())
    prepare_run_dir(config.replace(resume=True))              # same architecture: resumes
    _model_dir(same_path, hidden_size=128)                     # rebuilt in place
    with pytest.raises(ConfigError, match=r"not the architecture of the checkpoint .*"
                                          r"step_000004' \(hidden_size 64 vs 128"):
        prepare_run_dir(config.replace(resume=True))


def test_max_staleness_and_other_settings_carry_over(models, tmp_path):
    config = _launched_run(tmp_path, models[0])
    for changed in (dict(max_staleness=0), dict(max_staleness=6), dict(max_steps=500)):
        prepare_run_dir(config.replace(resume=True, **changed))
    prepare_run_dir(_with_model(config, os.path.join(models[0], ".", ""), resume=True))
    assert os.path.isdir(os.path.join(config.run_dir, "checkpoints", "step_000004"))


# --- the admission arithmetic -------------------------------------------------------------------
def _resumed_pipeline(batch, eta, new_batch, new_eta, version=10, steps=60):
    """Admission counters of a run stopped at `version` with every slot it allowed taken
    (started = (version + eta + 1) * batch, the learner has used version * batch), restored
    under (new_batch, new_eta); then an actor asks for new_batch slots whenever the learner
    waits, and the learner trains new_batch per step on rollouts no staler than new_eta
    (older ones are dropped and credited). Returns (the learner's version after `steps`
    rounds, whether it stopped early waiting with nothing admitted: a deadlock)."""
    old = Admission(batch, eta)
    old.admit("a", (version + eta + 1) * batch, released=0, version=version)
    admission = Admission.from_state(old.state(), new_batch, new_eta)
    # Rollouts in flight, by the version they were started at: batch j of the eta + 1 batches
    # in flight (trained at version + j) started at version - eta + j, as early as allowed.
    in_flight = [version - eta + j for j in range(eta + 1) for _ in range(batch)]
    for _ in range(steps):
        fresh = [r for r in in_flight if version - r <= new_eta]
        stale = len(in_flight) - len(fresh)
        if stale:                                       # dropped: admission credit
            admission.add_credit(admission.credit + stale)
            in_flight = fresh
        if len(in_flight) >= new_batch:
            in_flight = in_flight[new_batch:]
            version += 1
            continue
        granted = admission.admit("a", new_batch, released=0, version=version).granted
        if not granted:
            return version, True                        # waits for rollouts nobody may start
        in_flight += [version] * granted
    return version, False


def test_the_admission_counters_carry_a_new_staleness_bound_but_not_a_new_batch_size():
    for new_eta in (2, 0, 5):            # unchanged, smaller, larger eta: training goes on
        version, deadlocked = _resumed_pipeline(8, 2, 8, new_eta, steps=60)
        assert not deadlocked and version >= 10 + 25, new_eta
    # Halved batch: the old counters hold (10 + 2 + 1) * 8 = 104 started rollouts. The learner
    # trains 4 of each 8 in flight and drops the other 4 as too stale (credit 12) by version
    # 13, where the capacity (13 + 2 + 1) * 4 + 12 = 76 < 104: nothing may start, ever.
    assert _resumed_pipeline(8, 2, 4, 2, steps=60) == (13, True)


def test_changed_lora_settings_are_refused_before_launch(models, tmp_path):
    config = _launched_run(tmp_path, models[0])
    with pytest.raises(ConfigError) as e:
        run_program(config.replace(resume=True, lora_rank=8), _never_launched, progress=False)
    assert "--lora_rank=8 (the run used 0)" in str(e.value)


def _rewrite_config(config, edit):
    path = os.path.join(config.run_dir, "config.json")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(edit(text))
    return path


@pytest.mark.parametrize("edit, why", [
    (lambda text: text[:len(text) // 2], "cannot be read as JSON"),             # torn
    (lambda text: text.replace("{", '{\n  "from_a_newer_version": 1,', 1),       # one unknown key
     "from_a_newer_version"),
    (lambda text: "[1, 2]", "JSON list"),
])
def test_an_unreadable_config_json_refuses_the_resume(models, tmp_path, edit, why):
    """A config.json the resume checks cannot read is refused, naming the file; it never
    lets a changed batch_size through."""
    config = _launched_run(tmp_path, models[0])
    path = _rewrite_config(config, edit)
    with pytest.raises(ConfigError) as e:
        prepare_run_dir(config.replace(resume=True, batch_size=4))
    assert path in str(e.value) and why in str(e.value) and "--run_dir" in str(e.value)


def test_a_renamed_key_is_migrated_and_the_checks_still_run(models, tmp_path):
    """An earlier name of a field (config.RENAMED_FIELDS) is read as the new one: the
    resume checks run on the rest (a halved batch_size is still refused)."""
    config = _launched_run(tmp_path, models[0])
    _rewrite_config(config, lambda text: text.replace(
        '"weight_sync_mode"', '"vllm_weight_sync_mode"'))
    with pytest.raises(ConfigError, match="batch_size"):
        prepare_run_dir(config.replace(resume=True, batch_size=4))
    prepare_run_dir(config.replace(resume=True))    # unchanged settings: resumes
