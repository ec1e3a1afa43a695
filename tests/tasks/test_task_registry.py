"""Tasks and engines describe themselves (tasks/registry.py, engines/registry.py): the config's
--task and --engine values, each task's defaults and checks, and what the builder builds all
come from the registries; a new task is one file plus one registration line."""
import dataclasses
import sys
import textwrap

import pytest

from sao_actor_learner import builder, core
from sao_actor_learner.config import SAOConfig, ConfigError
from sao_actor_learner.engines import registry as engine_registry
from sao_actor_learner.engines.vllm_requests import check_prompt, parse_choice, request_body
from sao_actor_learner.tasks import registry as task_registry

CONFIG_FIELDS = {f.name for f in dataclasses.fields(SAOConfig)}


def test_unknown_task_is_a_config_error_listing_the_registered_tasks():
    with pytest.raises(ConfigError) as e:
        SAOConfig(task="chess")
    assert "task='chess'" in str(e.value)
    for name in task_registry.task_names():
        assert name in str(e.value)


def test_unknown_engine_is_a_config_error_listing_the_registered_engines():
    with pytest.raises(ConfigError) as e:
        SAOConfig(engine="tpu")
    assert "engine='tpu'" in str(e.value)
    for name in engine_registry.engine_names():
        assert name in str(e.value)


def test_every_registered_task_and_engine_describes_itself():
    specs = [task_registry.task_spec(n) for n in task_registry.task_names()] + \
        [engine_registry.engine_spec(n) for n in engine_registry.engine_names()]
    for spec in specs:
        assert len(spec.description.split()) >= 15, spec.name   # a paragraph, not a label
        assert callable(spec.build) and callable(spec.check)
    for name in task_registry.task_names():
        spec = task_registry.task_spec(name)
        assert spec.name == name
        assert set(spec.defaults) <= CONFIG_FIELDS, name
        assert set(spec.exclusive_options) <= CONFIG_FIELDS, name


def test_online_shift_takes_the_arithmetic_defaults_and_the_dataset_its_own():
    arithmetic, shift = SAOConfig(task="arithmetic"), SAOConfig(task="online_shift")
    for field in ("init_checkpoint", "max_sequence_length", "max_new_tokens", "max_turns"):
        assert getattr(shift, field) == getattr(arithmetic, field)
    assert (arithmetic.max_sequence_length, arithmetic.max_new_tokens) == (64, 8)


def test_a_task_checks_only_its_own_options():
    SAOConfig(task="arithmetic", shift_every=0, tool_timeout_s=0.0)    # not arithmetic's options
    with pytest.raises(ConfigError, match="shift_every=0"):
        SAOConfig(task="online_shift", shift_every=0)
    with pytest.raises(ConfigError, match="tool_timeout_s=0.0"):
        SAOConfig(task="calculator_tool", tool_timeout_s=0.0)


def test_another_tasks_exclusive_option_is_a_config_error(tmp_path):
    rows = tmp_path / "train.jsonl"
    rows.write_text('{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}\n')
    with pytest.raises(ConfigError, match="train_files=.*applies only to --task=dataset"):
        SAOConfig(task="arithmetic", train_files=(str(rows),))
    with pytest.raises(ConfigError, match="task='dataset' needs --eval_files"):
        SAOConfig(task="dataset", model=str(tmp_path), train_files=(str(rows),))


TOY_TASK = textwrap.dedent('''
    """A toy task written for the registry test: one file, registered by one line."""
    from sao_actor_learner import core
    from sao_actor_learner.tasks.registry import TaskSpec


    class EchoTask(core.Task):
        name = "echo"

        def __init__(self, word, offset):
            self.word, self.offset = word, offset

        def sample_prompt(self, rng):
            return core.Prompt(self.offset, (1, 2), self.word)

        def eval_prompts(self):
            return []

        def make_environment(self, prompt):
            raise NotImplementedError

        def is_correct(self, prompt, completion_tokens):
            return False


    def check(config, fail):
        if config.shift_every > 100:
            fail(f"shift_every={config.shift_every}: the echo task takes at most 100")


    TASK_SPEC = TaskSpec(
        name="echo", build=lambda config, actor_id, tokenizer: EchoTask("hi", actor_id),
        description="Repeats a word: the smallest task there is, written to show that a new "
                    "task is one module plus one registration line, and nothing else.",
        defaults=dict(init_checkpoint="checkpoints/echo", max_sequence_length=40,
                      max_new_tokens=5, max_turns=1, env_threads="actor_batch"),
        check=check)
''')


@pytest.fixture
def echo_task(tmp_path, monkeypatch):
    (tmp_path / "echo_task_module.py").write_text(TOY_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(task_registry.TASK_MODULES, "echo", "echo_task_module")  # the one line
    yield
    sys.modules.pop("echo_task_module", None)


def test_a_new_task_is_one_module_and_one_registration_line(echo_task):
    config = SAOConfig(task="echo", actor_batch=4)
    assert (config.init_checkpoint, config.max_sequence_length, config.max_new_tokens,
            config.env_threads) == ("checkpoints/echo", 40, 5, 4)   # its defaults
    with pytest.raises(ConfigError, match="the echo task takes at most 100"):
        SAOConfig(task="echo", shift_every=101)                      # its checks
    task = builder.make_task(config, actor_id=3)                     # its build
    assert isinstance(task, core.Task) and (task.word, task.offset) == ("hi", 3)
    with pytest.raises(ConfigError, match="echo"):   # listed among the known tasks
        SAOConfig(task="chess")


class _FakeEngine(core.Engine):
    def __init__(self, role, sync):
        self.role, self.weight_sync_mode, self.tokenizer = role, sync, "the tokenizer"

    def generate(self, prompts, params):
        return []

    def load_weights(self, state_dict, version):
        pass

    @property
    def version(self):
        return 0


def test_make_engine_builds_the_registered_engine(monkeypatch):
    spec = engine_registry.EngineSpec(
        name="fake", description="An engine for the test.",
        build=lambda config, role, run_dir, sync: _FakeEngine(role, sync))
    monkeypatch.setitem(engine_registry.ENGINE_SPECS, "fake", spec)
    config = SAOConfig(engine="fake", weight_sync_mode="keep")
    actor = builder.make_engine(config, role="actor_1")
    assert (actor.role, actor.weight_sync_mode, actor.tokenizer) == ("actor_1", "keep",
                                                                     "the tokenizer")
    staled = builder.make_engine(config.replace(forced_staleness=0), role="actor_0")
    assert staled.weight_sync_mode == "off"     # forced staleness: weights old on purpose


def test_the_torch_engine_keeps_the_tokenizer_it_is_given():
    from sao_actor_learner.engines import TorchEngine
    from sao_actor_learner.models import CharTokenizer, make_tiny_model
    tok = CharTokenizer()
    engine = TorchEngine(make_tiny_model("llama", vocab_size=tok.vocab_size, seed=0),
                         tok.eos_id, tok.pad_id, tokenizer=tok)
    assert engine.tokenizer is tok


def test_vllm_requests_clip_the_budget_and_read_versions_per_token():
    params = core.SamplingParams(max_new_tokens=10, temperature=0.7, seed=None)
    body = request_body([1, 2, 3], params, [0], seed=5, max_model_len=8,
                        extra_args={"hold": 1})
    assert body["sampling_params"]["max_tokens"] == 5                # 8 - 3 prompt tokens
    assert (body["sampling_params"]["seed"], body["sampling_params"]["extra_args"]) == \
        (5, {"hold": 1})
    with pytest.raises(ValueError, match="max_model_len is 8"):
        check_prompt(0, list(range(8)), vocab=64, max_model_len=8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        check_prompt(1, [70], vocab=64, max_model_len=None)
    choice = {"token_ids": [4, 5, 6], "finish_reason": "stop",
              "logprobs": {"content": [{"logprob": -0.5}] * 3},
              "weight_versions": [{"start": 0, "end": 1, "version": "default"},
                                  {"start": 1, "end": 3, "version": "7"}]}
    g = parse_choice(choice, initial_version=3)
    assert (g.tokens, g.versions, g.finish_reason) == ([4, 5, 6], [3, 7, 7], "stop")
    with pytest.raises(Exception, match="processed_logprobs"):
        parse_choice({"token_ids": [1], "logprobs": {"content": []}}, 0)
