"""What a run tells its user: the phase it is in while no step shows progress (run.phase), the
pointer to README's "Reading a run" at its end, and that section's content; on a GPU machine,
that generation stays on the CPU with the torch engine."""
import os
import re

from sao_actor_learner import __main__ as entry
from sao_actor_learner.__main__ import is_warm_start
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.run import phase

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(kind, versions, key="policy_version"):
    return [{"kind": kind, key: v} for v in versions]


def test_the_phase_names_what_a_slow_start_and_end_are_spent_on(tmp_path):
    config = SAOConfig(max_steps=6, eval_size=20, batch_size=8, model=str(tmp_path))
    train = [{"kind": "train", "step": s} for s in (1, 2)]
    assert "initial evaluation of version 0 on 20 problems" in phase(config, [], [], [])
    assert "first batch (8 rollouts)" in phase(config, [], _rows("eval", [0]), [])
    assert phase(config, train, _rows("eval", [0]), []) == ""   # training: the metrics show
    done = [{"kind": "train", "step": 6}]
    assert phase(config, done, _rows("eval", [0]), []) == "final evaluation on 20 problems"
    assert phase(config, done, _rows("eval", [0, 6]), []) == ""
    assert phase(config, [], [], [{"kind": "value_pretrain"}]) == "value pretraining"
    off = config.replace(evaluator="off")
    assert "initial evaluation" not in phase(off, [], [], [])
    assert phase(off, done, [], []) == ""


def test_a_pretrained_model_is_not_called_a_warm_start(tmp_path, warm_start):
    assert is_warm_start(SAOConfig(model=warm_start))
    assert not is_warm_start(SAOConfig(model=str(tmp_path)))


def _readme_section(title):
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.M | re.S)
    assert match, f"README.md has no section {title!r}"
    return match.group(1)


def test_readme_explains_the_progress_line_alarms_and_tensorboard():
    section = _readme_section("Reading a run")
    for part in ("step", "reward", "stale", "kl", "ev", "eval@"):
        assert f"`{part}" in section, part
    assert "tensorboard --logdir" in section and "drift_alarm" in section


def test_a_gpu_machine_is_told_when_generation_stays_on_the_cpu(monkeypatch):
    config = SAOConfig()
    monkeypatch.setattr(entry.shutil, "which", lambda name: None)    # no GPU: nothing to say
    assert entry.cpu_generation_note(config) == ""
    monkeypatch.setattr(entry.shutil, "which", lambda name: "/usr/bin/" + name)
    assert "--engine=vllm" in entry.cpu_generation_note(config)
    vllm = config.replace(engine="vllm")
    assert "--vllm_evaluator" in entry.cpu_generation_note(vllm)
    assert entry.cpu_generation_note(vllm.replace(vllm_evaluator=True)) == ""
