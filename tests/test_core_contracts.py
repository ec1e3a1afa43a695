"""The loop's contracts in core.py and what implements them: the variable client is the actor's
core.ActorCoordination and the publisher a core.WeightPublisher; the values the interfaces pass
are one class wherever they are imported from; a Task's episode_success has a default the
evaluator uses; an Engine's tokenizer is kept by wrappers; and the Actor, split into its
generation loop (actors/actor.py), weight following (actors/engine_weights.py) and outbox
(actors/outbox.py), runs against any ActorCoordination with no attribute probes, reporting the
transport counters its coordination keeps. No timing is asserted."""
import json
import threading

import pytest

from sao_actor_learner import core
from sao_actor_learner.actors.actor import Actor
from sao_actor_learner.actors.evaluator import evaluate
from sao_actor_learner.actors.spool import RolloutSpool
from sao_actor_learner.models import CharTokenizer

TOK = CharTokenizer()
PARAMS = core.SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=(TOK.eos_id,))


def test_the_variable_server_clients_implement_the_contracts():
    from sao_actor_learner.variables import VariableClient, VariablePublisher

    client = VariableClient("localhost:1")   # connects at the first call, never here
    publisher = VariablePublisher("localhost:1", "token")
    assert isinstance(client, core.ActorCoordination) and isinstance(client, core.VariableSource)
    assert isinstance(publisher, core.WeightPublisher)
    assert client.get_variables() == (-1, None) and client.version == -1
    assert dict(client.counters) == {}
    # What the actor calls on its coordination is the contract, nothing more.
    assert core.ActorCoordination.__abstractmethods__ == {
        "get_variables", "version", "update", "update_and_wait", "wait_for_version",
        "fetch_version", "admit_details", "acknowledged"}
    assert core.WeightPublisher.__abstractmethods__ == {"publish", "report_progress"}
    assert core.Learner.__abstractmethods__ == {"get_variables", "run", "step"}
    client.close()
    publisher.close()


def test_the_values_are_one_class_wherever_they_are_imported_from():
    from sao_actor_learner import core_values, variables
    from sao_actor_learner.variables import client, publisher

    for name in ("AckInfo", "AdmitResult", "VersionInfo"):
        assert getattr(client, name) is getattr(core, name) is getattr(core_values, name)
        assert getattr(variables, name) is getattr(core, name)
    assert publisher.ProgressResult is core.ProgressResult is variables.ProgressResult
    for name in ("Prompt", "StepResult", "SamplingParams", "Generation"):
        assert getattr(core, name) is getattr(core_values, name)


class _OneTurnEnv(core.Environment):
    def __init__(self, reward):
        self._reward = reward

    def step(self, action_tokens):
        return core.StepResult([], self._reward, True, {})


class _Task(core.Task):
    """Prompt k has prompt_id k (1, 2, ...); every episode ends after one turn with `reward`."""
    name = "contracts"
    tokenizer = TOK

    def __init__(self, reward=1.0):
        self.reward, self.n = reward, 0

    def sample_prompt(self, rng):
        self.n += 1
        return core.Prompt(prompt_id=self.n, token_ids=tuple(TOK.encode("1+6=")), text="1+6=")

    def eval_prompts(self):
        return [self.sample_prompt(None) for _ in range(3)]

    def make_environment(self, prompt):
        return _OneTurnEnv(self.reward)

    def is_correct(self, prompt, completion_tokens):
        return False


class _Engine(core.Engine):
    """Answers "7<eos>" at version 0; has its tokenizer from construction."""

    def __init__(self):
        self.tokenizer = TOK
        self.calls = 0

    @property
    def version(self):
        return 0

    def generate(self, prompts, params):
        self.calls += 1
        return [core.Generation(tokens=[TOK.token_id("7"), TOK.eos_id], logprobs=[-0.1, -0.2],
                                versions=[0, 0], finish_reason="stop") for _ in prompts]

    def load_weights(self, state_dict, version):
        raise AssertionError("version 0 throughout: no weight load expected")


def test_episode_success_defaults_to_a_positive_reward_and_the_evaluator_asks_the_task():
    engine = _Engine()
    rewarded, unrewarded = _Task(reward=1.0), _Task(reward=0.0)
    assert evaluate(engine, rewarded, rewarded.eval_prompts(), PARAMS, max_turns=2) == 1.0
    assert evaluate(engine, unrewarded, unrewarded.eval_prompts(), PARAMS, max_turns=2) == 0.0

    class Lenient(_Task):
        def episode_success(self, rollout):
            return True

    lenient = Lenient(reward=0.0)
    assert evaluate(engine, lenient, lenient.eval_prompts(), PARAMS, max_turns=2) == 1.0


def test_an_engine_wrapper_keeps_the_tokenizer_of_the_engine_it_wraps():
    wrapped = core.EngineWrapper(_Engine())
    assert wrapped.tokenizer is TOK and wrapped.version == 0 and wrapped.weight_sync_mode == "off"


class _Coordination(core.ActorCoordination):
    """An ActorCoordination at version 0 that grants what is asked and acknowledges nothing;
    it says two versions came through shared memory."""

    def __init__(self):
        self.admitted = 0
        self.ack = core.AckInfo(loss_epoch=0, watermark=0, seqs=(), version=0, trained_total=0)

    @property
    def version(self):
        return 0

    @property
    def counters(self):
        return {"shm_loads": 2}

    def get_variables(self):
        return 0, None

    def update(self):
        pass

    def update_and_wait(self, timeout_s=60.0):
        return 0

    def wait_for_version(self, min_version, timeout_s=60.0):
        assert min_version <= 0, min_version
        return 0

    def fetch_version(self, version, timeout_s=60.0):
        raise AssertionError("no forced staleness here")

    def admit_details(self, actor_id, count=1, timeout_s=30.0, released=0):
        self.admitted += count
        return core.AdmitResult(count, 0, self.admitted, 1 << 20)

    def acknowledged(self, actor_id, timeout_s=10.0):
        return self.ack


class _ListSink(core.RolloutSink):
    def __init__(self):
        self.sent, self.closed = [], False

    def check(self, rollout):
        return None

    def send(self, rollouts, timeout_s):
        self.sent.extend(rollouts)
        return [True] * len(rollouts)

    def close(self):
        self.closed = True


def test_an_actor_runs_on_any_actor_coordination_and_reports_its_counters(tmp_path):
    sink, spool = _ListSink(), RolloutSpool(str(tmp_path / "spool"))
    stats = tmp_path / "stats.json"
    actor = Actor(0, _Task(), _Engine(), _Coordination(), sink, decode=None, params=PARAMS,
                  spool=spool, actor_batch=4, max_rollouts=8, stats_path=str(stats))
    thread = threading.Thread(target=actor.run, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert sorted(r.prompt_id for r in sink.sent) == list(range(1, 9)) and sink.closed
    written = json.loads(stats.read_text())
    assert written["weight_transport_counters"] == {"shm_loads": 2}
    for name, value in (("rollouts_generated", 8), ("rollouts_inserted", 8),
                        ("rollouts_resent", 0), ("rollouts_acknowledged", 0),
                        ("weight_updates", 0), ("weights_offered", 0), ("reward_sum", 8.0)):
        assert written[name] == actor.counters[name] == pytest.approx(value), name
    assert written["rollouts_held"] == 8 and written["loss_epoch"] == 0
    spool.close()


class _RefusingFirst(_Coordination):
    """Grants nothing the first `refusals` times it is asked (a staleness limit reached)."""

    def __init__(self, refusals):
        super().__init__()
        self.refusals = refusals

    def admit_details(self, actor_id, count=1, timeout_s=30.0, released=0):
        if self.refusals > 0:
            self.refusals -= 1
            return core.AdmitResult(0, 0, self.admitted, 1 << 20)
        return super().admit_details(actor_id, count, timeout_s, released)


def test_an_actor_counts_the_time_it_waits_for_admission(tmp_path):
    sink, spool = _ListSink(), RolloutSpool(str(tmp_path / "spool"))
    actor = Actor(0, _Task(), _Engine(), _RefusingFirst(3), sink, decode=None, params=PARAMS,
                  spool=spool, actor_batch=4, max_rollouts=4)
    thread = threading.Thread(target=actor.run, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive() and len(sink.sent) == 4
    assert actor.counters["admission_waits"] == 3
    assert actor.counters["admission_wait_s"] >= 3 * 0.02   # three sleeps of at least 20 ms
    assert actor.counters["weight_load_s"] == 0.0           # version 0 was the engine's
    spool.close()
