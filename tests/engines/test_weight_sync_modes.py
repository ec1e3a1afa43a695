"""Weight sync modes in the actor (docs/DESIGN.md "Weight sync modes"): with keep or abort a
version published while the actor is generating reaches its generations in flight, and the
rollouts' per-token versions and log-probs record exactly where.

A real Actor, TorchEngine, VariableServer, VariablePublisher and VariableClient (weight_sync_
fixtures.py). Deterministic: the engine's decode_step_hook stops generation after SWITCH_AT
tokens, publishes version 1 and waits until the actor's weight thread has offered it to the
engine; the engine takes it right there. Nothing races; the deadline only bounds a hang.
"""
import json
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import weight_sync_fixtures as wf  # noqa: E402

from sao_actor_learner.config import ConfigError, SAOConfig  # noqa: E402
from sao_actor_learner.core import SamplingParams  # noqa: E402
from sao_actor_learner.engines import TorchEngine  # noqa: E402
from sao_actor_learner.models import make_tiny_model  # noqa: E402
from sao_actor_learner.models.checkpoint import sync_state_dict  # noqa: E402

torch.set_num_threads(1)
TOK = wf.TOK
BATCH = 4
LONG = 12
SWITCH_AT = 5
DEADLINE_S = 120.0


def long_model(seed: int):
    """A tiny Llama whose <eos> is (practically) never sampled: rows run to LONG tokens."""
    m = make_tiny_model("llama", vocab_size=TOK.vocab_size, seed=seed)
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)
        m.lm_head.weight[TOK.eos_id].zero_()
    return m


def teacher_forced(model, prompt, tokens):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt) + list(tokens)])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp[len(prompt) - 1:-1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.fixture()
def versions():
    v = wf.Versions(batch_size=BATCH, max_staleness=2)
    yield v
    v.close()


@pytest.mark.parametrize("mode", ["keep", "abort", "off"])
def test_a_version_published_mid_generation_reaches_the_rollouts_in_flight(
        mode, versions, tmp_path):
    old, new = long_model(seed=3), long_model(seed=4)
    versions.publish(0, sync_state_dict(old))
    engine = TorchEngine(long_model(seed=3), TOK.eos_id, TOK.pad_id, version=0,
                         weight_sync_mode=mode)
    params = SamplingParams(max_new_tokens=LONG, temperature=1.0, seed=1,
                            stop_token_ids=(TOK.eos_id,))
    actor, sink = wf.make_actor(engine, versions, str(tmp_path / "spool"), BATCH, params)
    seen = []

    def hook(n):   # in the actor's generating thread, after n tokens of the rows in flight
        if n != SWITCH_AT or seen:
            return
        seen.append(n)
        versions.publish(1, sync_state_dict(new))
        if mode == "off":
            return   # nothing is offered mid-generation: nothing to wait for
        deadline = time.monotonic() + DEADLINE_S
        while engine.pending_version != 1:   # the weight thread fetched and offered it
            assert time.monotonic() < deadline, "version 1 was never offered to the engine"
            time.sleep(0.01)
    engine.decode_step_hook = hook

    actor.run()   # one batch of BATCH rollouts, then returns
    assert seen == [SWITCH_AT] and len(sink.sent) == BATCH
    assert sink.closed   # the actor closes what it owns (an open Reverb writer hangs at exit)
    expected = {"keep": [0] * SWITCH_AT + [1] * (LONG - SWITCH_AT), "abort": [1] * LONG,
                "off": [0] * LONG}[mode]
    for r in sink.sent:
        prompt = [int(t) for t, m in zip(r.tokens, r.action_mask) if not m]
        tokens = wf.action_part(r, "tokens")
        versions_ = wf.action_part(r, "versions")
        assert versions_ == expected, (mode, versions_)
        # Each token's log-prob is the one of the weights that sampled it (teacher forcing of
        # the whole prefix with those weights).
        lp = torch.tensor(wf.action_part(r, "rollout_logp"))
        ref = torch.where(torch.tensor(versions_) == 0, teacher_forced(old, prompt, tokens),
                          teacher_forced(new, prompt, tokens))
        torch.testing.assert_close(lp, ref.to(lp.dtype), atol=1e-4, rtol=0)
        # Staleness is that of the oldest token: at learner version 1, 1 unless every token
        # was sampled by version 1 (abort).
        assert r.min_version() == expected[0] and r.staleness(1) == 1 - expected[0]
    counters = engine.weight_sync_counters()
    with open(tmp_path / "spool" / "stats.json") as f:
        stats = json.load(f)
    assert stats["engine_counters"] == counters
    # The fixture's publisher streams (no shared memory): every version came over gRPC.
    transport = stats["weight_transport_counters"]
    assert transport.get("grpc_loads", 0) >= 1 and transport.get("shm_loads", 0) == 0
    assert stats["weight_sync_mode"] == mode
    if mode == "off":
        assert actor.counters["weights_offered"] == 0 and counters["sequences_switched"] == 0
        assert engine.version == 0      # loaded only before the actor's next batch
    else:
        assert actor.counters["weights_offered"] == 1 and engine.version == 1
        assert counters["sequences_switched"] == BATCH
        assert counters["tokens_discarded"] == (SWITCH_AT * BATCH if mode == "abort" else 0)
    assert actor.counters["weight_updates"] == 0   # version 0 was the engine's from the start


def test_forced_staleness_keeps_the_weight_thread_off(versions, tmp_path):
    engine = TorchEngine(long_model(seed=3), TOK.eos_id, TOK.pad_id, weight_sync_mode="keep")
    actor, _ = wf.make_actor(engine, versions, str(tmp_path / "a"), BATCH, SamplingParams())
    assert actor._feeding
    from sao_actor_learner.actors.actor import Actor
    forced = Actor(0, wf.OneTurnTask(), engine, versions.client(), wf.ListSink(64), decode=None,
                   params=SamplingParams(), spool=wf.RolloutSpool(str(tmp_path / "b")),
                   forced_staleness=1)
    assert not forced._feeding


def test_weight_sync_mode_config_and_the_earlier_name(tmp_path):
    assert SAOConfig().weight_sync_mode == "off"   # opt-in: every rollout one version by default
    for mode in ("off", "keep", "abort"):
        config = SAOConfig(weight_sync_mode=mode)
        assert SAOConfig.from_json(config.to_json()) == config
    with pytest.raises(ConfigError, match="weight_sync_mode='pause'.*off, keep, abort"):
        SAOConfig(weight_sync_mode="pause")
    # A config.json of an earlier version: vllm_weight_sync_mode is read as what those runs did
    # (actors loaded weights between batches only).
    old = json.loads(SAOConfig(engine="torch").to_json())
    del old["weight_sync_mode"]
    old["vllm_weight_sync_mode"] = "keep"
    assert SAOConfig.from_json(json.dumps(old)).weight_sync_mode == "off"
    both = dict(old, weight_sync_mode="keep")
    with pytest.raises(ConfigError, match="both 'vllm_weight_sync_mode'.*and 'weight_sync_mode'"):
        SAOConfig.from_json(json.dumps(both))


def test_builder_gives_actors_the_mode_and_the_evaluator_off(warm_start):
    from sao_actor_learner.builder import make_engine
    config = SAOConfig(init_checkpoint=warm_start, weight_sync_mode="abort")
    assert make_engine(config, role="actor_0").weight_sync_mode == "abort"
    assert make_engine(config, role="evaluator").weight_sync_mode == "off"
    forced = config.replace(forced_staleness=1, max_staleness=1)
    assert make_engine(forced, role="actor_0").weight_sync_mode == "off"
