"""A real Actor on a real variable server, for the weight-sync-mode tests (torch and vLLM).

`Versions` runs a VariableServer (admission on), publishes versions with a VariablePublisher
as the learner does (sync state dict -> safetensors buffers) and gives the actor a real
VariableClient. The actor's task is one-turn (prompt "i+i=", reward 1) and its sink keeps what
it sends in a list, after the replay's own column checks (replay/validation.py), so no Reverb
server is needed.
"""
import os

from sao_actor_learner import core
from sao_actor_learner.actors.actor import Actor
from sao_actor_learner.actors.spool import RolloutSpool
from sao_actor_learner.models import CharTokenizer
from sao_actor_learner.models.checkpoint import (bytes_to_state_dict_views,
                                                 state_dict_to_buffers)
from sao_actor_learner.replay.validation import check_columns, rollout_columns
from sao_actor_learner.variables import VariableClient, VariablePublisher, VariableServer

TOK = CharTokenizer()
TOKEN = "weight-sync-test-token"


class OneTurnTask(core.Task):
    """Prompt k (1, 2, ...) is "k+k="; one model turn, reward 1."""
    name = "one_turn"
    tokenizer = TOK

    def __init__(self):
        self.n = 0

    def sample_prompt(self, rng):
        self.n += 1
        text = f"{self.n}+{self.n}="
        return core.Prompt(prompt_id=self.n, token_ids=tuple(TOK.encode(text)), text=text)

    def eval_prompts(self):
        return []

    def make_environment(self, prompt):
        return _Done()

    def is_correct(self, prompt, completion_tokens):
        return True


class _Done(core.Environment):
    def step(self, action_tokens):
        return core.StepResult([], 1.0, True, {})


class ListSink(core.RolloutSink):
    """Keeps every rollout it is sent; refuses what replay would refuse."""

    def __init__(self, max_sequence_length: int):
        self.max_sequence_length = max_sequence_length
        self.sent = []
        self.closed = False

    def check(self, rollout):
        return check_columns(rollout_columns(rollout), TOK.vocab_size,
                             self.max_sequence_length)[1]

    def send(self, rollouts, timeout_s):
        assert not self.closed, "a rollout sent to a closed sink"
        self.sent.extend(rollouts)
        return [True] * len(rollouts)

    def close(self):
        self.closed = True


class Versions:
    """A variable server (admission: batch_size, max_staleness), its publisher, and clients."""

    def __init__(self, batch_size: int, max_staleness: int):
        self.server = VariableServer(publisher_token=TOKEN, batch_size=batch_size,
                                     max_staleness=max_staleness).start()
        self.publisher = VariablePublisher(self.server.address, TOKEN)
        self.clients = []

    def publish(self, version: int, state_dict: dict) -> None:
        self.publisher.publish(version, state_dict_to_buffers(state_dict))

    def client(self) -> VariableClient:
        c = VariableClient(self.server.address, update_period_s=0.02)
        self.clients.append(c)
        return c

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.publisher.close()
        self.server.stop(grace_s=0.1)


def make_actor(engine: core.Engine, versions: Versions, spool_dir: str, batch: int,
               params: core.SamplingParams, max_sequence_length: int = 96):
    """(actor, sink): an Actor that generates one batch of `batch` rollouts and returns."""
    sink = ListSink(max_sequence_length)
    actor = Actor(0, OneTurnTask(), engine, versions.client(), sink,
                  decode=bytes_to_state_dict_views, params=params,
                  spool=RolloutSpool(spool_dir), actor_batch=batch, admission_control=True,
                  max_rollouts=batch, max_total_tokens=max_sequence_length,
                  stats_path=os.path.join(spool_dir, "stats.json"), weight_poll_s=0.02)
    return actor, sink


def action_part(rollout, column):
    """The action tokens' entries of a per-token column, as a list."""
    return [x.item() for x, m in zip(getattr(rollout, column), rollout.action_mask) if m]
