"""The critic probe and the value-pretrained critic directory, end to end on the arithmetic warm
start with tiny budgets: output format, the directory's contents, loading it as --critic_model,
the learner's yardstick from it, and the pre-launch check against a mismatched policy. Nothing
here asserts a learning outcome."""
import json
import os
import subprocess
import sys

import pytest

from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.critic import fit as fit_lib
from sao_actor_learner.critic import probe
from sao_actor_learner.critic.pretrain import REPORT_FILE, pretrain_critic
from sao_actor_learner.learner.value_pretraining import HELDOUT_ROLLOUTS_FILE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_probe_reports_every_variant_by_segment_and_reuses_its_rollout_set(warm_start,
                                                                           tmp_path):
    path = str(tmp_path / "set.npz")
    out = str(tmp_path / "probe.json")
    cmd = [sys.executable, os.path.join(REPO, "programs", "critic_probe.py"),
           "--workload=arithmetic", f"--model={warm_start}", "--train_prompts=24",
           "--heldout_prompts=12", "--samples=2", f"--rollouts_file={path}",
           "--fixed_epochs=1", "--threads=1", f"--out_json={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    result = json.loads(first.stdout.strip().splitlines()[-1])
    assert set(result["heldout_ev"]) == {"ceiling", "ridge", "today", "fixed"}
    assert result["rollouts"]["train"] == 48 and result["rollouts"]["heldout"] == 24
    for name in ("ridge", "today", "fixed"):
        assert "all" in result["by_segment"][name] and "first" in result["by_segment"][name]
    assert result["fixed_fit"]["max_epochs"] == 1 and result["fixed_curve"][0]["step"] == 0
    assert json.loads(open(out).read()) == result
    assert "ceiling" in first.stdout and "fixed fit:" in first.stdout
    again = subprocess.run(cmd + ["--variants=ceiling"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"rollout set: {path} (72 rollouts)" in again.stderr      # sampled once, reused
    assert json.loads(again.stdout.strip().splitlines()[-1])["heldout_ev"]["ceiling"] == \
        result["heldout_ev"]["ceiling"]


def test_probe_refuses_unknown_variants():
    with pytest.raises(ValueError, match="unknown variants"):
        probe.run_probe({}, "x.npz", train_prompts=1, heldout_prompts=1, samples=2,
                        variants=["ceiling", "oracle"], today_lr=1e-4,
                        fixed=probe.FixedRecipe.make())


@pytest.fixture(scope="module")
def critic_dir(warm_start, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("critic") / "critic")
    config = SAOConfig(task="arithmetic", init_checkpoint=warm_start, seed=0)
    report = pretrain_critic(config, out, prompts=16, samples=2,
                             settings=fit_lib.FitSettings(max_epochs=1, minibatch_size=8),
                             lr=1e-3, log=lambda s: None)
    return out, report, warm_start


def test_pretrained_critic_directory_loads_as_critic_model(critic_dir):
    import torch

    from sao_actor_learner.builder import make_critic
    from sao_actor_learner.models.checkpoint import load_policy
    from sao_actor_learner.models.value import ValueModel
    out, report, warm_start = critic_dir
    for name in ("config.json", "value_head.safetensors", HELDOUT_ROLLOUTS_FILE, REPORT_FILE):
        assert os.path.exists(os.path.join(out, name)), name
    assert report["rollouts"] == 32 and report["heldout_rollouts"] + \
        report["train_rollouts"] == 32
    assert report["fit"]["optimizer_steps"] >= 1 and len(report["curve"]) == 2
    assert json.load(open(os.path.join(out, REPORT_FILE)))["heldout_ev"] == report["heldout_ev"]
    saved = ValueModel.load(out)
    config = SAOConfig(task="arithmetic", init_checkpoint=warm_start, critic_model=out)
    critic = make_critic(config, load_policy(warm_start)[0])
    for (n, p), (_, q) in zip(saved.state_dict().items(), critic.state_dict().items()):
        assert torch.equal(p, q), n
    assert not any(p.requires_grad for n, p in critic.body.named_parameters()
                   if "self_attn" in n)


def test_the_learner_measures_its_critic_on_the_directory_heldout_rollouts(critic_dir):
    from sao_actor_learner.learner_builder import _critic_yardstick
    from sao_actor_learner.learner import distributed
    out, report, warm_start = critic_dir
    config = SAOConfig(task="arithmetic", init_checkpoint=warm_start, critic_model=out,
                       critic_eval_every=3)
    yardstick = _critic_yardstick(config, distributed.SINGLE, pad_id=0)
    assert len(yardstick.rollouts) == report["heldout_rollouts"]
    assert [v for v in range(8) if yardstick.due(v)] == [0, 3, 6]
    assert yardstick.due(7, final=True)
    assert _critic_yardstick(config.replace(algorithm="grpo", group_size=2), distributed.SINGLE,
                             0) is None


def test_a_critic_directory_of_another_model_fails_before_launch(critic_dir, tmp_path):
    from sao_actor_learner.preflight import check_before_launch
    out, _, warm_start = critic_dir
    other = tmp_path / "other"
    subprocess.run([sys.executable, os.path.join(REPO, "programs", "make_tiny_model.py"),
                    f"--out_dir={other}"], cwd=REPO, check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    config = SAOConfig(task="arithmetic", init_checkpoint=warm_start, critic_model=str(other),
                       run_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError) as e:
        check_before_launch(config)
    assert str(other) in str(e.value) and warm_start in str(e.value)


def test_a_missing_heldout_file_fails_before_launch(warm_start, tmp_path):
    from sao_actor_learner.preflight import check_before_launch
    config = SAOConfig(task="arithmetic", init_checkpoint=warm_start,
                       critic_heldout_file=str(tmp_path / "none.npz"),
                       run_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="critic_heldout_file"):
        check_before_launch(config)


def test_pretraining_never_replaces_a_folder_it_did_not_make(tmp_path):
    from sao_actor_learner.config import ConfigError, SAOConfig
    from sao_actor_learner.critic import fit as fit_lib
    from sao_actor_learner.critic.pretrain import pretrain_critic
    mine = tmp_path / "my_critic"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="--out_dir: .* a folder this project did not make"):
        pretrain_critic(SAOConfig(), str(mine), prompts=4, samples=2,
                        settings=fit_lib.FitSettings(), lr=1e-3)
    assert (mine / "notes.txt").read_text() == "mine"
