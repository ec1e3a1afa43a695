"""VLLMEngine against a real vLLM server (`.venv-vllm`, CPU) serving a tiny locally built Llama,
and a tiny Hugging Face Qwen3 model directory (tests/hf_fixtures.py: BPE tokenizer, chat
template, tied embeddings).

One server is started per model (the `served` and `served_qwen` fixtures); tests share it and
load the weights they need first (an update takes ~0.05 s). The Llama's LM head is scaled up
with the <eos> row zeroed, so <eos> is rarely sampled. The Llama server runs the tests' hold
scheduler (vllm_server/hold_scheduler.py): the keep/abort tests hold every in-flight request
at a known token count before the weight update, so they do not depend on machine speed.

Run by `make test`, which builds `.venv-vllm` first (`make vllm-env`); skipped only when it is
missing (a bare `pytest` without it).
"""
import copy
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hf_fixtures  # noqa: E402
import launch_fixtures as fx  # noqa: E402

from sao_actor_learner.config import ConfigError, SAOConfig  # noqa: E402
from sao_actor_learner.core import Engine, SamplingParams  # noqa: E402
from sao_actor_learner.distributions import nucleus_logprobs, sampling_logprobs  # noqa: E402
from sao_actor_learner.engines import VLLMEngine, VLLMServer, VLLMServerError  # noqa: E402
from sao_actor_learner.engines.vllm_engine import (SERVER_DIR,  # noqa: E402
                                                   resolve_vllm_python)
from sao_actor_learner.engines.vllm_server import procs  # noqa: E402
from sao_actor_learner.engines.vllm_weights import push_weights  # noqa: E402
from sao_actor_learner.models import CharTokenizer, make_tiny_model, save_checkpoint  # noqa: E402
from sao_actor_learner.models.checkpoint import (load_policy,  # noqa: E402
                                                 load_sync_state_dict, sync_state_dict)
from sao_actor_learner.models.hf_tokenizer import HFTokenizer  # noqa: E402

VLLM_PYTHON = resolve_vllm_python()
pytestmark = pytest.mark.skipif(not os.path.exists(VLLM_PYTHON),
                                reason=f"no vLLM environment at {VLLM_PYTHON}: `make vllm-env`")
torch.set_num_threads(1)
TOK = CharTokenizer()
PROMPTS = [TOK.encode(t) for t in ["1+2=", "37+45=", "9", "(a,b): [x/y] <z>?", "12*3-4="]]
ATOL = 1e-4          # vLLM log-probs vs a teacher-forced transformers forward (measured < 3e-5)
LONG = 40            # tokens per in-flight request in the keep/abort tests
HOLD = 8             # ... held (all of them) at this many tokens while the weights change
IN_FLIGHT = 24       # requests in flight in the keep/abort tests
MAX_POS = 512
HOLD_SCHEDULER = ("--scheduler-cls", "vllm_server.hold_scheduler.HoldScheduler")


def tiny_model(seed: int):
    model = make_tiny_model("llama", vocab_size=TOK.vocab_size, seed=seed,
                            max_position_embeddings=MAX_POS)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
        model.lm_head.weight[TOK.eos_id].zero_()
    return model


def perturbed(state_dict, seed: int, scale: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    out = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state_dict.items()}
    out["lm_head.weight"][TOK.eos_id] = 0.0  # <eos> stays (practically) never sampled
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(engine on version 7, the reference HF model, its state dict, the server log path)."""
    path = str(tmp_path_factory.mktemp("vllm_ckpt"))
    model = tiny_model(seed=3)
    save_checkpoint(model, TOK, path)
    log = os.path.join(path, "vllm_server.log")
    engine = VLLMEngine.from_checkpoint(path, version=7, log_path=log, max_restarts=3,
                                        start_timeout_s=600, extra_args=HOLD_SCHEDULER)
    yield engine, model, {k: v.clone() for k, v in model.state_dict().items()}, log
    pid = engine.server.pid
    group = procs.group_pids(pid)
    shm = procs.shm_files(group) | engine.server.shm_files
    assert len(group) >= 2 and shm, "expected an api server, an engine core and shared memory"
    engine.close()
    assert not [p for p in group if fx.pid_alive(p)], "close() left vLLM processes running"
    assert not [f for f in shm if os.path.exists(f)], "close() left vLLM's shared memory"


_VERSION = [100]


def load(engine, model, state_dict):
    """Loads `state_dict` into both the engine (a new version) and the reference model."""
    _VERSION[0] += 1
    engine.load_weights(state_dict, _VERSION[0])
    model.load_state_dict(state_dict)
    return _VERSION[0]


def teacher_forced(model, prompt, tokens, temperature=1.0, top_p=1.0):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt) + list(tokens)])).logits[0].float()
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    if top_p < 1.0:
        logp = nucleus_logprobs(logp, top_p)
    return logp[len(prompt) - 1:-1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]


# --- log-probs, sampling, prompts ----------------------------------------------------------------
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (0.0, 1.0), (1.3, 0.9)])
def test_logprobs_equal_teacher_forced_torch_forward(served, temperature, top_p):
    engine, model, base, _ = served
    assert isinstance(engine, Engine)
    version = load(engine, model, base)
    gens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=temperature,
                                                   top_p=top_p, seed=5))
    assert len(gens) == len(PROMPTS)
    for p, g in zip(PROMPTS, gens):
        assert len(g.tokens) == len(g.logprobs) == len(g.versions) == 12
        assert g.versions == [version] * 12 and g.finish_reason == "length"
        ref = teacher_forced(model, p, g.tokens, temperature, top_p)
        torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=ATOL, rtol=0)
    if top_p < 1.0:  # renormalised over the nucleus: a token alone in it has log-prob 0
        assert any(lp == 0.0 for g in gens for lp in g.logprobs)


def test_greedy_stop_tokens_seeds_and_bad_prompts(served):
    engine, model, base, _ = served
    load(engine, model, base)
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    free = engine.generate(PROMPTS, greedy)
    for p, g in zip(PROMPTS, free):  # greedy = argmax of a full forward, token by token
        seq = list(p)
        for t in g.tokens:
            with torch.no_grad():
                assert int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()) == t
            seq.append(t)
    # A stop token ends a row there, included, with finish_reason "stop".
    stop = free[1].tokens[3]
    stopped = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0,
                                                      stop_token_ids=(stop,)))
    for f, s in zip(free, stopped):
        if stop in f.tokens:
            assert s.tokens == f.tokens[:f.tokens.index(stop) + 1] and s.finish_reason == "stop"
        else:
            assert s.tokens == f.tokens and s.finish_reason == "length"
    seeded = SamplingParams(max_new_tokens=8, temperature=1.0, seed=11)
    a, b = engine.generate(PROMPTS, seeded), engine.generate(PROMPTS, seeded)
    c = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, seed=12))
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert [g.tokens for g in a] != [g.tokens for g in c]
    # Room left in max_model_len bounds the length.
    long_prompt = [TOK.bos_id] + [5] * (MAX_POS - 4)  # 3 tokens of room
    (g,) = engine.generate([long_prompt], SamplingParams(max_new_tokens=10, temperature=0.0))
    assert len(g.tokens) == 3 and g.finish_reason == "length"
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 4], []], greedy)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 999]], greedy)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * MAX_POS], greedy)


# --- weight updates ------------------------------------------------------------------------------
def test_weight_update_changes_generations_and_carries_the_version(served):
    engine, model, base, _ = served
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    load(engine, model, base)
    before = engine.generate(PROMPTS, params)
    version = load(engine, model, perturbed(base, seed=1))
    assert engine.version == version
    after = engine.generate(PROMPTS, params)   # same prompts: prefix-cache hits would be stale
    assert [g.tokens for g in after] != [g.tokens for g in before]
    for p, g in zip(PROMPTS, after):
        assert g.versions == [version] * len(g.tokens)
        torch.testing.assert_close(torch.tensor(g.logprobs), teacher_forced(model, p, g.tokens),
                                   atol=ATOL, rtol=0)
    assert engine.last_update_s is not None and engine.last_update_s < 30


def test_bad_weights_are_rejected_and_the_server_keeps_serving(served, tmp_path):
    engine, model, base, _ = served
    version = load(engine, model, base)
    pid = engine.server.pid
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = engine.generate(PROMPTS, params)
    bad = {
        "wrong shape": ({**base, "lm_head.weight": torch.zeros(TOK.vocab_size + 1, 128)},
                        r"lm_head.weight: shape \(56, 128\) != served \(55, 128\)"),
        "missing key": ({k: v for k, v in base.items() if k != "model.norm.weight"},
                        r"missing keys \[model.norm.weight\]"),
        "extra key": ({**base, "model.layers.9.mlp.up_proj.weight": torch.zeros(3)},
                      r"unexpected keys \[model.layers.9.mlp.up_proj.weight\]"),
        "wrong dtype": ({**base, "model.norm.weight": base["model.norm.weight"].double()},
                        r"model.norm.weight: dtype float64 != served float32"),
        "not finite": ({**base, "model.norm.weight": torch.full((128,), float("nan"))},
                       r"model.norm.weight: has non-finite values"),
    }
    for name, (state_dict, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            engine.load_weights(state_dict, version + 50)
    # The server's backend validates too (nothing is loaded): bypass the client's check.
    from safetensors.torch import save_file
    bad_file = str(tmp_path / "bad.safetensors")
    save_file({**base, "lm_head.weight": torch.zeros(3, 3)}, bad_file)
    with pytest.raises(Exception, match="weight update rejected"):
        push_weights(engine.server, bad_file, version + 60, "keep")
    assert engine.version == version and engine.server.pid == pid and engine.server.alive()
    after = engine.generate(PROMPTS, params)
    assert [g.tokens for g in after] == [g.tokens for g in before]
    assert {v for g in after for v in g.versions} == {version}
    assert engine.counters["rejected_weight_updates"] >= len(bad)


def _update_mid_flight(engine, model, old_state_dict, new_state_dict, tmp_path, n=IN_FLIGHT):
    """Loads old_state_dict, starts n generations of LONG tokens and loads new_state_dict while
    all n are held in flight (the server's hold scheduler: all n start in the same step and stop
    after HOLD tokens, in lockstep, until the update's /resume); returns (prompts, generations,
    old and new version). Deterministic: nothing races the update."""
    prompts = [TOK.encode(f"{i}+{i}=") for i in range(n)]
    params = SamplingParams(max_new_tokens=LONG, temperature=1.0, seed=0)
    old_version = load(engine, model, old_state_dict)
    signal_file = tmp_path / f"held_{uuid.uuid4().hex[:8]}.json"
    engine.request_extra_args = {"sao_hold": {"group": signal_file.name, "size": n,
                                              "tokens": HOLD, "signal_file": str(signal_file)}}
    out = {}

    def run():
        try:
            out["g"] = engine.generate(prompts, params)
        except BaseException as e:  # noqa: BLE001 - reported below
            out["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        deadline = time.time() + 300
        while not signal_file.exists():
            if not worker.is_alive() or time.time() > deadline:
                engine.server.call("POST", "/resume")   # let anything still held finish
                worker.join(timeout=120)
                pytest.fail(f"the requests were never held: {out.get('error')!r}; server log "
                            f"{engine.server.log_path}:\n{engine.server.log_tail()}")
            time.sleep(0.01)
        held = json.loads(signal_file.read_text())
        assert held["held"] and held["requests"] == n and held["finished"] == 0, held
        assert held["tokens"] == [HOLD] * n, held          # lockstep: all at HOLD tokens
        new_version = load(engine, model, new_state_dict)   # ... resumes them
    finally:
        engine.request_extra_args = None
    worker.join(timeout=300)
    assert "error" not in out, out.get("error")
    return prompts, out["g"], old_version, new_version


def _check_length(g):
    """A long generation runs to LONG tokens, or (rarely: <eos> is only made unlikely) ends at
    an <eos>."""
    if g.finish_reason == "length":
        assert len(g.tokens) == LONG
    else:
        assert g.finish_reason == "stop" and g.tokens[-1] == TOK.eos_id and len(g.tokens) <= LONG


def test_keep_mode_in_flight_requests_switch_weights_mid_generation(served, tmp_path):
    engine, model, base, _ = served
    engine.weight_sync_mode = "keep"
    old_model = tiny_model(seed=3)
    old_model.load_state_dict(base)
    prompts, gens, old_version, new_version = _update_mid_flight(
        engine, model, base, perturbed(base, seed=2), tmp_path)
    assert len(gens) == IN_FLIGHT
    for p, g in zip(prompts, gens):
        _check_length(g)
        # Every request switched exactly once, old then new, after the HOLD tokens it had.
        k = HOLD
        assert len(g.tokens) > k
        assert g.versions == [old_version] * k + [new_version] * (len(g.tokens) - k)
        # Tokens before the switch were sampled by the old weights, after it by the new ones
        # (with the KV of the whole prefix recomputed: no stale cache).
        lp = torch.tensor(g.logprobs)
        torch.testing.assert_close(lp[:k], teacher_forced(old_model, p, g.tokens)[:k],
                                   atol=ATOL, rtol=0)
        torch.testing.assert_close(lp[k:], teacher_forced(model, p, g.tokens)[k:],
                                   atol=ATOL, rtol=0)


def test_abort_mode_in_flight_requests_restart_on_new_weights(served, tmp_path):
    engine, model, base, _ = served
    engine.weight_sync_mode = "abort"
    resent0 = engine.counters["aborted_and_resent"]
    try:
        prompts, gens, _, new_version = _update_mid_flight(engine, model, base,
                                                           perturbed(base, seed=3), tmp_path)
    finally:
        engine.weight_sync_mode = "keep"
    # Every request was in flight when the update aborted it, and was re-sent once.
    assert engine.counters["aborted_and_resent"] - resent0 == len(prompts) == IN_FLIGHT
    for p, g in zip(prompts, gens):
        _check_length(g)
        assert g.versions == [new_version] * len(g.tokens)
        torch.testing.assert_close(torch.tensor(g.logprobs), teacher_forced(model, p, g.tokens),
                                   atol=ATOL, rtol=0)


def test_an_actor_pushes_a_version_published_mid_generation_into_its_requests(served,
                                                                              tmp_path):
    """The actor's weight thread (weight_sync_mode keep) pushes a version published while its
    batch is in flight; the rollouts record the switch token by token. The hold scheduler holds
    every request at HOLD tokens until the push's /resume: the version is published only then,
    so nothing races."""
    import weight_sync_fixtures as wf
    engine, model, base, _ = served
    engine.weight_sync_mode = "keep"
    batch = 8
    old_model, new_model = tiny_model(seed=3), tiny_model(seed=3)
    old_model.load_state_dict(base)
    new = perturbed(base, seed=5)
    new_model.load_state_dict(new)
    old_version = load(engine, model, base)
    _VERSION[0] += 1
    new_version = _VERSION[0]
    versions = wf.Versions(batch_size=batch, max_staleness=2)
    signal_file = tmp_path / "held_actor.json"
    engine.request_extra_args = {"sao_hold": {"group": "actor", "size": batch, "tokens": HOLD,
                                              "signal_file": str(signal_file)}}
    out = {}
    try:
        versions.publish(old_version, base)
        actor, sink = wf.make_actor(engine, versions, str(tmp_path / "spool"), batch,
                                    SamplingParams(max_new_tokens=LONG, temperature=1.0, seed=0),
                                    max_sequence_length=MAX_POS)

        def run():
            try:
                actor.run()
            except BaseException as e:  # noqa: BLE001 - reported below
                out["error"] = e
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        deadline = time.time() + 300
        while not signal_file.exists():
            if not worker.is_alive() or time.time() > deadline:
                engine.server.call("POST", "/resume")
                worker.join(timeout=120)
                pytest.fail(f"the actor's requests were never held: {out.get('error')!r}; "
                            f"log {engine.server.log_path}:\n{engine.server.log_tail()}")
            time.sleep(0.01)
        held = json.loads(signal_file.read_text())
        assert held["held"] and held["tokens"] == [HOLD] * batch, held
        versions.publish(new_version, new)   # the actor's weight thread pushes it: /resume
        worker.join(timeout=300)
    finally:
        engine.request_extra_args = None
        versions.close()
    assert not worker.is_alive() and "error" not in out, out.get("error")
    model.load_state_dict(new)                # the reference follows the served weights
    assert engine.version == new_version and actor.counters["weights_offered"] == 1
    assert len(sink.sent) == batch
    for r in sink.sent:
        prompt = [int(t) for t, m in zip(r.tokens, r.action_mask) if not m]
        tokens = wf.action_part(r, "tokens")
        assert len(tokens) == LONG or tokens[-1] == TOK.eos_id
        assert wf.action_part(r, "versions") == \
            [old_version] * HOLD + [new_version] * (len(tokens) - HOLD)
        lp = torch.tensor(wf.action_part(r, "rollout_logp"))
        torch.testing.assert_close(lp[:HOLD], teacher_forced(old_model, prompt, tokens)[:HOLD]
                                   .to(lp.dtype), atol=ATOL, rtol=0)
        torch.testing.assert_close(lp[HOLD:], teacher_forced(new_model, prompt, tokens)[HOLD:]
                                   .to(lp.dtype), atol=ATOL, rtol=0)
        assert r.staleness(new_version) == 1     # its oldest token's version decides
    assert engine.weight_sync_counters()["sequences_switched"] >= batch


def test_off_mode_loads_between_generate_calls(served, tmp_path):
    """weight_sync_mode off: a load waits for the generate call in flight. The call's requests
    are held mid-flight (hold scheduler) while a load is started, then resumed by hand: every
    token still has the old version, and the load lands after the call."""
    engine, model, base, _ = served
    old_version = load(engine, model, base)
    engine.weight_sync_mode = "off"
    signal_file = tmp_path / "held_off.json"
    engine.request_extra_args = {"sao_hold": {"group": "off", "size": len(PROMPTS),
                                              "tokens": HOLD, "signal_file": str(signal_file)}}
    out = {}

    def gen():
        out["g"] = engine.generate(PROMPTS, SamplingParams(max_new_tokens=LONG, seed=0))

    def update():
        out["v"] = load(engine, model, perturbed(base, seed=6))
    worker, loader = threading.Thread(target=gen, daemon=True), None
    try:
        worker.start()
        deadline = time.time() + 300
        while not signal_file.exists():
            assert worker.is_alive() and time.time() < deadline, "requests never held"
            time.sleep(0.01)
        loader = threading.Thread(target=update, daemon=True)
        loader.start()                          # waits for the call in flight
        engine.server.call("POST", "/resume")   # the held requests finish on the old weights
        worker.join(timeout=300)
        loader.join(timeout=300)
    finally:
        engine.request_extra_args = None
        engine.weight_sync_mode = "keep"
    assert not worker.is_alive() and not loader.is_alive()
    assert {v for g in out["g"] for v in g.versions} == {old_version}
    assert engine.version == out["v"] > old_version
    after = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=0))
    assert {v for g in after for v in g.versions} == {out["v"]}


# --- a Hugging Face model directory: tiny Qwen3, BPE tokenizer, chat template, tied head -----
CHATS = ["What is 2 plus 3?", "Hello there", "Say the number 7.", "Is 12 even? Answer yes or no."]


@pytest.fixture(scope="module")
def served_qwen(tmp_path_factory):
    """(engine serving tests/hf_fixtures.tiny_qwen3 on version 0, the transformers model and its
    tokenizer from load_policy, its sync state dict, the chat-template prompts)."""
    path = hf_fixtures.tiny_qwen3(str(tmp_path_factory.mktemp("tiny_qwen3")))
    model, tokenizer = load_policy(path)
    engine = VLLMEngine.from_checkpoint(path, version=0, start_timeout_s=600,
                                        log_path=os.path.join(path, "vllm_server.log"))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    try:
        yield engine, model, tokenizer, sync_state_dict(model), prompts
    finally:
        engine.close()


def _qwen_load(engine, model, state_dict):
    _VERSION[0] += 1
    engine.load_weights(state_dict, _VERSION[0])
    load_sync_state_dict(model, state_dict)
    return _VERSION[0]


def _qwen_logprobs(model, prompt, tokens, temperature=1.0, top_p=1.0):
    """The learner's log-probs of `tokens` (sampling_logprobs of a teacher-forced forward)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt) + list(tokens)])).logits[0]
    logp = sampling_logprobs(logits, temperature if temperature > 0 else 1.0, top_p)
    return logp[len(prompt) - 1:-1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_a_hugging_face_model_directory_is_served_with_its_tokenizer(served_qwen):
    engine, model, tokenizer, base, prompts = served_qwen
    _qwen_load(engine, model, base)
    assert isinstance(engine.tokenizer, HFTokenizer) and engine.tokenizer.bos_id is None
    # Stop ids from generation_config.json: <|im_end|> (eos, ends the turn) and <|endoftext|>.
    ids = tokenizer.hf.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert engine.tokenizer.stop_ids == tuple(ids) and engine.tokenizer.eos_id == ids[0]
    assert all(p[-1] != ids[0] for p in prompts)   # ends with the assistant header
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=7,
                                stop_token_ids=engine.tokenizer.stop_ids)
        gens = engine.generate(prompts, params)
        for p, g in zip(prompts, gens):
            assert 0 < len(g.tokens) <= 12 and len(g.logprobs) == len(g.tokens)
            if g.finish_reason == "stop":
                assert g.tokens[-1] in ids and not set(g.tokens[:-1]) & set(ids)
            else:
                assert len(g.tokens) == 12 and not set(g.tokens) & set(ids)
            torch.testing.assert_close(torch.tensor(g.logprobs),
                                       _qwen_logprobs(model, p, g.tokens, temperature),
                                       atol=ATOL, rtol=0)
            if temperature == 0.0:   # greedy: each token is the argmax of the forward
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([list(p) + g.tokens])).logits[0]
                assert logits[len(p) - 1:-1].argmax(-1).tolist() == g.tokens


def test_a_sync_state_dict_update_follows_the_tied_head(served_qwen):
    engine, model, tokenizer, base, prompts = served_qwen
    assert "lm_head.weight" not in base and model.config.tie_word_embeddings
    assert set(base) == set(engine.expected_weights)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=9,
                            stop_token_ids=engine.tokenizer.stop_ids)
    _qwen_load(engine, model, base)
    g = torch.Generator().manual_seed(5)
    new = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) for k, v in base.items()}
    ref = copy.deepcopy(model)
    version = _qwen_load(engine, ref, new)          # accepted: no lm_head.weight needed
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    assert torch.equal(ref.lm_head.weight, new["model.embed_tokens.weight"])
    # The same update into an untied copy: new embedding, the old head.
    stale_head = copy.deepcopy(model)
    stale_head.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    stale_head.load_state_dict(new, strict=False)
    after = engine.generate(prompts, params)
    gaps = {"old weights": 0.0, "old head": 0.0}
    for p, gen in zip(prompts, after):
        assert gen.versions == [version] * len(gen.tokens)
        lp = torch.tensor(gen.logprobs)
        torch.testing.assert_close(lp, _qwen_logprobs(ref, p, gen.tokens), atol=ATOL, rtol=0)
        for name, other in (("old weights", model), ("old head", stale_head)):
            gaps[name] = max(gaps[name],
                             float((lp - _qwen_logprobs(other, p, gen.tokens)).abs().max()))
    assert min(gaps.values()) > 100 * ATOL, gaps   # vLLM's head followed the new embedding
    _qwen_load(engine, model, base)


def test_top_p_logprobs_are_the_learners_nucleus_logprobs(served_qwen):
    """top_p=0.6: vLLM's processed log-probs equal sampling_logprobs(logits, T, 0.6) of the
    same weights, so on-policy importance ratios are 1."""
    engine, model, _, base, prompts = served_qwen
    version = _qwen_load(engine, model, base)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.6, seed=3,
                            stop_token_ids=engine.tokenizer.stop_ids)
    gens = engine.generate(prompts * 2, params)
    for p, g in zip(prompts * 2, gens):
        assert g.versions == [version] * len(g.tokens)
        learner = _qwen_logprobs(model, p, g.tokens, 1.0, 0.6)
        assert torch.isfinite(learner).all()        # every sampled token is in the nucleus
        torch.testing.assert_close(torch.tensor(g.logprobs), learner, atol=ATOL, rtol=0)
        ratio = torch.exp(learner - torch.tensor(g.logprobs))
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=2 * ATOL, rtol=0)


@pytest.mark.timeout(900)
def test_a_whole_dataset_run_with_the_vllm_engine(tmp_path):
    from sao_actor_learner.builder import make_program
    from sao_actor_learner.observers import read_metrics
    from sao_actor_learner.run import run_program

    model = hf_fixtures.tiny_qwen3(str(tmp_path / "model"))
    data = hf_fixtures.write_jsonl(str(tmp_path / "gsm.jsonl"), hf_fixtures.gsm_rows(16))
    config = SAOConfig(task="dataset", model=model, train_files=(data,), eval_files=(data,),
                       engine="vllm", max_steps=2, batch_size=4, actor_batch=4, num_actors=1,
                       eval_size=4, eval_every=0, max_new_tokens=16, max_sequence_length=96,
                       launch="local_mp", run_dir=str(tmp_path / "run"),
                       vllm_start_timeout_s=600)
    summary = run_program(config, make_program, progress=False)
    assert summary["steps"] == 2 and summary["rollouts_trained"] == 8, summary
    train = read_metrics(config.run_dir, "train")
    assert [r["step"] for r in train] == [1, 2]
    for row in train:
        losses = {k: v for k, v in row.items() if k.endswith("_loss")}
        assert "policy_loss" in losses and all(math.isfinite(v) for v in losses.values()), row
    with open(os.path.join(config.run_dir, "logs", "vllm_actor_0.log")) as f:   # vLLM sampled
        assert "=== sao: starting vLLM server" in f.read()


# --- server failures -----------------------------------------------------------------------------
def test_dead_server_is_restarted_with_the_latest_weights(served):
    engine, model, base, log = served
    version = load(engine, model, perturbed(base, seed=4))
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = engine.generate(PROMPTS, params)
    old_pid = engine.server.pid
    # vLLM's engine core (a child of the api server) dies: the api server answers 500 / 503.
    children = subprocess.run(["pgrep", "-P", str(old_pid)], capture_output=True,
                              text=True).stdout.split()
    assert children, "the vLLM api server has no child processes"
    for child in map(int, children):
        if not procs.is_resource_tracker(child):
            os.kill(child, signal.SIGKILL)
    after = engine.generate(PROMPTS, params)              # restarts the server, then re-sends
    assert engine.server.pid != old_pid and engine.server.alive()
    assert engine.counters["server_restarts"] == 1
    assert not fx.pid_alive(old_pid)
    # The whole server goes the same way; its shared memory is unlinked all the same. (Its
    # resource tracker survives, as it would a crash, and unlinks its semaphores.)
    shm = set(engine.server.shm_files)
    assert shm
    for pid in procs.group_pids(engine.server.pid):
        if not procs.is_resource_tracker(pid):
            os.kill(pid, signal.SIGKILL)
    engine.server.process.wait(timeout=30)
    again = engine.generate(PROMPTS, params)
    assert not [f for f in shm if os.path.exists(f)]
    assert engine.counters["server_restarts"] == 2 and engine.server.alive()
    assert [g.tokens for g in again] == [g.tokens for g in before]
    assert [g.tokens for g in after] == [g.tokens for g in before]
    assert {v for g in after for v in g.versions} == {version} and engine.version == version
    with open(log) as f:
        assert f.read().count("=== sao: starting vLLM server") == 3


def test_server_start_failures_are_actionable(tmp_path, served):
    _, _, _, _ = served  # reuse the module's checkpoint folder
    ckpt = os.path.dirname(served[3])
    missing = VLLMServer(ckpt, python=str(tmp_path / "nope" / "python"))
    with pytest.raises(VLLMServerError, match="make vllm-env"):
        missing.start()
    slow = VLLMServer(ckpt, log_path=str(tmp_path / "slow.log"), start_timeout_s=1.0)
    with pytest.raises(VLLMServerError, match="did not answer /health within start_timeout_s=1"):
        slow.start()
    assert not fx.pid_alive(slow.pid)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    dead = VLLMServer(str(broken), log_path=str(tmp_path / "dead.log"), start_timeout_s=300)
    with pytest.raises(VLLMServerError, match="exited with code .* during start-up") as info:
        dead.start()
    assert "last lines" in str(info.value) and "no_such_architecture" in str(info.value)


def test_server_stops_when_its_parent_is_killed(tmp_path, served):
    """The watchdog in serve.py ends the server when the process that started it dies."""
    ckpt = os.path.dirname(served[3])
    log = tmp_path / "orphan.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time\n"
            "from sao_actor_learner.engines.vllm_engine import VLLMServer, free_port\n"
            f"s = VLLMServer({ckpt!r}, log_path={str(log)!r})\n"
            "s.port = free_port()\n"
            "import subprocess\n"
            "p = subprocess.Popen(s.command(), env=s.environment(), start_new_session=True,\n"
            "                     stdout=open(s.log_path, 'a'), stderr=subprocess.STDOUT)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(600)\n")],
        stdout=subprocess.PIPE, text=True)
    server_pid = int(parent.stdout.readline())
    time.sleep(2.0)
    assert fx.pid_alive(server_pid)
    parent.kill()
    parent.wait()
    deadline = time.time() + 30
    while time.time() < deadline and fx.pid_alive(server_pid):
        time.sleep(0.2)
    assert not fx.pid_alive(server_pid)
    assert "is gone; stopping the server" in log.read_text()
    assert not procs.group_pids(server_pid)


# --- the vLLM-side code and the config -----------------------------------------------------------
def test_server_code_imports_nothing_from_the_main_environment():
    code = ("import sys\n"
            "import vllm_server.weight_transfer as wt, vllm_server.worker_extension as we\n"
            "import vllm_server.hold_scheduler as hs\n"
            "from vllm.v1.core.sched.scheduler import Scheduler\n"
            "assert issubclass(hs.HoldScheduler, Scheduler)\n"
            "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory\n"
            "assert wt.BACKEND_NAME in WeightTransferEngineFactory._registry\n"
            "assert not [m for m in sys.modules if m.startswith(('sao_actor_learner', 'absl',"
            " 'reverb', 'tensorflow'))]\n"
            "e = {'a': ((2, 3), 'float32'), 'b': ((4,), 'float32')}\n"
            "print(wt.compare_weights(e, {'a': ((3, 2), 'float32'), 'c': ((4,), 'float16')}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.path.dirname(SERVER_DIR)
    out = subprocess.run([VLLM_PYTHON, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("['missing [b] (1)', 'unexpected [c] (1)', 'a: shape (3, 2) != served (2, 3)']"
            in out.stdout)


def test_the_vllm_server_gets_none_of_the_runs_secrets(tmp_path, monkeypatch):
    """The vLLM server runs a third party's code: no secret of the launch's environment."""
    from sao_actor_learner.secret_env import SECRET_ENV_VARS
    for name in SECRET_ENV_VARS:
        monkeypatch.setenv(name, "secret-value-" + "x" * 16)
    env = VLLMServer(str(tmp_path), python=str(tmp_path / "python")).environment()
    assert not [k for k, v in env.items() if "secret-value" in v]
    assert env["HF_HUB_OFFLINE"] == "1"


def test_config_validates_the_vllm_fields(tmp_path):
    with pytest.raises(ConfigError, match="vllm_python=.*does not exist.*make vllm-env"):
        SAOConfig(engine="vllm", vllm_python=str(tmp_path / "no_python"))
    with pytest.raises(ConfigError, match="weight_sync_mode='pause'"):
        SAOConfig(engine="vllm", weight_sync_mode="pause")
    config = SAOConfig(engine="vllm", weight_sync_mode="abort")
    assert SAOConfig.from_json(config.to_json()) == config


def test_the_evaluator_keeps_the_torch_engine_unless_asked(served):
    from sao_actor_learner.builder import make_engine
    from sao_actor_learner.engines import TorchEngine
    ckpt = os.path.dirname(served[3])
    config = SAOConfig(engine="vllm", init_checkpoint=ckpt)
    assert config.vllm_evaluator is False
    assert isinstance(make_engine(config, role="evaluator"), TorchEngine)
