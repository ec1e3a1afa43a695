"""Profiles and the lean choices in the config: precedence (explicit flags win, also at the
default value), config.json round trips that do not apply a profile twice, the errors for
unsupported combinations, and short real runs of the lean profile (local_mp: no evaluator
process, the learner evaluates, the value head in its checkpoint) and of evaluator=off."""
import json
import os

import pytest
import torch
from absl import flags

from sao_actor_learner.builder import make_program
from sao_actor_learner.config import PROFILES, ConfigError, SAOConfig
from sao_actor_learner.flags import config_from_flags, define_flags_from_dataclass
from sao_actor_learner.observers import read_metrics
from sao_actor_learner.run import run_program

LEAN = PROFILES["lean"]


def parse(*argv):
    """SAOConfig from command-line flags, as programs/sao.py makes it."""
    values = flags.FlagValues()
    define_flags_from_dataclass(SAOConfig, flag_values=values)
    values(["sao.py", *argv])
    return config_from_flags(SAOConfig, flag_values=values)


def test_the_lean_profile_sets_its_fields_and_nothing_else():
    config = SAOConfig.from_profile("lean")
    default = SAOConfig()
    assert config.profile == "lean"
    assert (config.num_actors, config.critic, config.evaluator) == (1, "shared_trunk",
                                                                    "in_learner")
    differ = {f for f in default.__dataclass_fields__ if getattr(config, f) != getattr(default, f)}
    assert differ == set(LEAN) | {"profile"}
    assert parse("--profile=lean") == config
    assert parse() == default and default.profile == ""


def test_explicit_flags_win_over_the_profile_even_at_their_default():
    # --num_actors=2 is the field's default: given explicitly it still beats lean's 1.
    config = parse("--profile=lean", "--num_actors=2", "--critic=separate")
    assert (config.num_actors, config.critic, config.evaluator) == (2, "separate", "in_learner")
    assert SAOConfig.from_profile("lean", num_actors=2, evaluator="node").evaluator == "node"
    # Overrides passed to config_from_flags count as given too.
    values = flags.FlagValues()
    define_flags_from_dataclass(SAOConfig, flag_values=values)
    values(["sao.py", "--profile=lean"])
    assert config_from_flags(SAOConfig, flag_values=values, num_actors=3).num_actors == 3
    # Flags without a profile: exactly as given.
    assert parse("--num_actors=3").num_actors == 3 and parse("--num_actors=3").profile == ""


def test_a_resolved_config_never_applies_its_profile_again():
    config = SAOConfig.from_profile("lean", num_actors=2)
    assert SAOConfig.from_json(config.to_json()) == config
    assert config.replace(max_steps=7).num_actors == 2          # replace keeps what was given
    # The bare constructor records the name only (profiles.py).
    assert SAOConfig(profile="lean").num_actors == SAOConfig().num_actors


@pytest.mark.parametrize("kwargs, message", [
    (dict(profile="fast"), "profile='fast': must be one of lean"),
    (dict(critic="tiny"), "critic='tiny': must be one of separate, shared_trunk"),
    (dict(evaluator="thread"),
     "evaluator='thread': must be one of node, in_learner, record, off"),
    (dict(critic="shared_trunk", algorithm="grpo", group_size=2, actor_batch=8),
     "only sao has a critic"),
    (dict(critic="shared_trunk", critic_model="/tmp/critic"), "drop --critic_model"),
    (dict(critic="shared_trunk", value_pretrain_rollouts=30), "critic-only steps"),
    (dict(critic="shared_trunk", critic_warmup_steps=1), "critic-only steps"),
    (dict(critic="shared_trunk", loss_normalization="kept_tokens"), "kept-token"),
    (dict(critic="shared_trunk", value_loss_coef=0.0), "value_loss_coef=0.0"),
    (dict(evaluator="in_learner", learners=2), "use --evaluator=node"),
])
def test_unsupported_combinations_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        SAOConfig(**kwargs)


def test_an_unknown_profile_fails_on_every_path():
    with pytest.raises(ConfigError, match="profile='fast'"):
        SAOConfig.from_profile("fast")
    with pytest.raises(ConfigError, match="profile='fast'"):
        parse("--profile=fast")


def test_the_lean_profile_runs_the_whole_program(warm_start, tmp_path):
    """local_mp, --profile=lean: replay, variables, the learner and one actor (no evaluator
    process); the learner writes the eval rows; its checkpoint holds the shared value head."""
    config = SAOConfig.from_profile(
        "lean", init_checkpoint=warm_start, run_dir=str(tmp_path / "run"), max_steps=4,
        batch_size=8, actor_batch=4, max_staleness=2, eval_every=2, eval_size=20)
    summary = run_program(config, make_program, progress=False)
    with open(os.path.join(config.run_dir, "nodes.json")) as f:
        nodes = json.load(f)["nodes"]
    assert sorted(n["name"] for n in nodes) == ["actor_0", "learner_0", "replay_0",
                                                "variables_0"]
    assert all(n["status"] == "finished" for n in nodes)
    train = read_metrics(config.run_dir, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for row in train:
        for key in ("estimate_s", "policy_step_s", "critic_step_s", "publish_s", "wait_s",
                    "in_learner_eval_s", "value_loss", "explained_variance"):
            assert key in row, key
        assert row["staleness_max"] <= config.max_staleness
    assert sorted(r["policy_version"] for r in read_metrics(config.run_dir, "eval")) == [0, 2, 4]
    assert summary["initial_eval_accuracy"] is not None
    assert summary["final_eval_accuracy"] is not None
    assert summary["rollouts_trained"] == 4 * config.batch_size
    with open(os.path.join(config.run_dir, "config.json")) as f:
        assert SAOConfig.from_json(f.read()) == config
    from sao_actor_learner.learner.checkpointing import read_learner_state
    state = read_learner_state(os.path.join(config.run_dir, "checkpoints", "step_000004",
                                            "learner_state.pt"))
    assert set(state["estimator"]) >= {"value_head", "value_head_opt"}
    assert "critic" not in state["estimator"]                  # no second network saved


def test_evaluator_off_runs_without_any_evaluation(warm_start, tmp_path):
    config = SAOConfig(init_checkpoint=warm_start, run_dir=str(tmp_path / "run"), max_steps=2,
                       batch_size=8, actor_batch=4, num_actors=1, evaluator="off",
                       launch="local_mt")
    summary = run_program(config, make_program, progress=False)
    assert [r["step"] for r in read_metrics(config.run_dir, "train")] == [1, 2]
    assert read_metrics(config.run_dir, "eval") == []
    assert summary["initial_eval_accuracy"] is None and summary["final_eval_accuracy"] is None


class _Versions:
    """A variable-client stand-in: versions 0, then `later` (version, safetensors bytes)."""

    def __init__(self, later):
        self._later = later
        self._calls = 0

    def update(self, wait=False):
        self._calls += 1

    def get_variables(self):
        return self._later if self._calls > 1 else (0, None)


def test_in_learner_evaluation_writes_the_evaluator_nodes_rows(warm_start, tmp_path):
    """The same two versions (the warm start and a perturbed one) through the evaluator node's
    loop and through the learner's in-process evaluation: the same rows, timings and the
    sampled pass@k value aside (the engine samples from its own generator)."""
    from sao_actor_learner.actors.evaluator import Evaluator
    from sao_actor_learner.builder import make_engine, make_in_learner_evaluation, make_task
    from sao_actor_learner.builder import sampling_params
    from sao_actor_learner.models import checkpoint as ckpt
    from sao_actor_learner.observers import MetricsLogger
    config = SAOConfig(init_checkpoint=warm_start, max_steps=2, eval_every=0, eval_size=30,
                       eval_pass_k=2)
    policy, _ = ckpt.load_policy(warm_start)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    later = ckpt.sync_state_dict(policy)
    node_dir, learner_dir = str(tmp_path / "node"), str(tmp_path / "learner")
    engine = make_engine(config, role="evaluator")
    node = Evaluator(make_task(config), engine, variables=_Versions(
        (2, ckpt.state_dict_to_bytes(later))), decode=ckpt.bytes_to_state_dict_views,
        params=sampling_params(config, greedy=True, stop_ids=engine.tokenizer.stop_ids),
        pass_k=2, sample_params=sampling_params(config, stop_ids=engine.tokenizer.stop_ids),
        eval_every=0, max_steps=2, logger=MetricsLogger(node_dir, "evaluator"))
    node.run()
    in_learner = make_in_learner_evaluation(config, learner_dir)
    assert in_learner(0, lambda: pytest.fail("version 0 is the engine's own checkpoint"))
    assert not in_learner(1, lambda: later)             # not due (eval_every 0)
    assert in_learner(2, lambda: later)
    in_learner.close()

    def rows(run_dir):
        out = read_metrics(run_dir, "eval")
        assert all(0 <= r.pop("eval_pass_at_2") <= 1 for r in out)
        return [{k: v for k, v in r.items() if k not in ("eval_time_s", "time")} for r in out]
    assert [r["policy_version"] for r in rows(node_dir)] == [0, 2]
    assert rows(learner_dir) == rows(node_dir)
    assert in_learner.results == node.results
