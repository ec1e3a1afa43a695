"""TorchEngine: cached batched sampling equals slow obvious computations."""
import pytest
import torch

from sao_actor_learner.core import Engine, SamplingParams
from sao_actor_learner.engines import TorchEngine
from sao_actor_learner.models import CharTokenizer, make_tiny_model, save_checkpoint

torch.set_num_threads(1)
TOK = CharTokenizer()
PROMPT_TEXTS = ["1+2=", "37+45=8", "9", "(a,b): [x/y] <z>?", "12*3-4="]


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def model(request):
    # seed 1 happens to give a few greedy <eos> early, so early stop is exercised too.
    return make_tiny_model(request.param, vocab_size=TOK.vocab_size, seed=1)


def prompts():
    return [TOK.encode(t) for t in PROMPT_TEXTS]


def teacher_forced_logprobs(model, prompt, tokens, temperature):
    """Log-probs of `tokens` after `prompt` from one unpadded, uncached forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    return logp[len(prompt) - 1:-1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_teacher_forcing(model, temperature):
    engine = TorchEngine(model, TOK.eos_id, TOK.pad_id, version=3)
    assert isinstance(engine, Engine)
    params = SamplingParams(max_new_tokens=10, temperature=temperature, seed=5)
    gens = engine.generate(prompts(), params)
    assert len(gens) == len(PROMPT_TEXTS)
    for p, g in zip(prompts(), gens):
        assert len(g.tokens) == len(g.logprobs) == len(g.versions) >= 1
        assert g.versions == [3] * len(g.tokens)
        ref = teacher_forced_logprobs(model, p, g.tokens, temperature)
        torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=1e-4, rtol=0)


def naive_greedy(model, prompt, max_new_tokens, stop):
    """Greedy decoding with a full forward pass per token, no cache, no padding."""
    seq = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            out.append(nxt)
            seq.append(nxt)
            if nxt in stop:
                break
    return out


def test_greedy_matches_naive_loop(model):
    engine = TorchEngine(model, TOK.eos_id, TOK.pad_id, max_batch_size=3)  # two chunks
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    first = engine.generate(prompts(), params)
    # An extra stop token that ends some rows early while others run on (rows leave the batch).
    extra = first[0].tokens[0]
    for stop_ids in ((), (extra,)):
        gens = engine.generate(prompts(), SamplingParams(max_new_tokens=12, temperature=0.0,
                                                         stop_token_ids=stop_ids))
        stops = {TOK.eos_id, *stop_ids}
        for p, g in zip(prompts(), gens):
            assert g.tokens == naive_greedy(model, p, 12, stops)
            assert g.finish_reason == ("stop" if g.tokens[-1] in stops else "length")
    assert {g.finish_reason for g in gens} == {"stop", "length"}


def test_stop_tokens_and_max_new_tokens(model):
    engine = TorchEngine(model, TOK.eos_id, TOK.pad_id)
    free = engine.generate(prompts(), SamplingParams(max_new_tokens=12, temperature=0.0))
    # Stop on the 3rd greedy token of the longest run: that row ends there with "stop".
    row = max(range(len(free)), key=lambda i: len(free[i].tokens))
    stop = free[row].tokens[2]
    stopped = engine.generate(prompts(), SamplingParams(max_new_tokens=12, temperature=0.0,
                                                        stop_token_ids=(stop,)))
    for f, s in zip(free, stopped):
        hits = [i for i, t in enumerate(f.tokens) if t == stop]
        if hits:
            assert s.tokens == f.tokens[:hits[0] + 1] and s.finish_reason == "stop"
        else:
            assert s.tokens == f.tokens and s.finish_reason == f.finish_reason
    short = engine.generate(prompts(), SamplingParams(max_new_tokens=2, temperature=1.0, seed=0))
    for g in short:
        assert 1 <= len(g.tokens) <= 2
        assert g.finish_reason == ("stop" if g.tokens[-1] == TOK.eos_id else "length")
        assert TOK.eos_id not in g.tokens[:-1]


def test_seeded_sampling_is_deterministic(model):
    engine = TorchEngine(model, TOK.eos_id, TOK.pad_id)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=11)
    a = engine.generate(prompts(), params)
    b = engine.generate(prompts(), params)
    c = engine.generate(prompts(), SamplingParams(max_new_tokens=8, temperature=1.0, seed=12))
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]
    assert [g.tokens for g in a] != [g.tokens for g in c]


def test_top_p_samples_inside_nucleus_with_renormalised_logprobs(model):
    engine = TorchEngine(model, TOK.eos_id, TOK.pad_id)
    prompt = TOK.encode("37+45=")
    gens = engine.generate([prompt] * 16, SamplingParams(max_new_tokens=1, temperature=1.0,
                                                         top_p=0.3, seed=0))
    with torch.no_grad():
        p = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1)
    order = p.argsort(descending=True)
    before = torch.cumsum(p[order], 0) - p[order]
    nucleus = order[before < 0.3]
    mass = p[nucleus].sum()
    for g in gens:
        assert g.tokens[0] in nucleus.tolist()
        assert g.logprobs[0] == pytest.approx(float(torch.log(p[g.tokens[0]] / mass)), abs=1e-4)


def test_load_weights_sets_version_and_rejects_bad_state_dicts():
    model = make_tiny_model("llama", vocab_size=TOK.vocab_size, seed=0)
    engine = TorchEngine(model, TOK.eos_id, TOK.pad_id, version=0)
    other = make_tiny_model("llama", vocab_size=TOK.vocab_size, seed=7).state_dict()
    engine.load_weights(other, version=5)
    assert engine.version == 5
    assert torch.equal(engine.model.state_dict()["lm_head.weight"], other["lm_head.weight"])
    gens = engine.generate([TOK.encode("1+1=")], SamplingParams(max_new_tokens=3, seed=0))
    assert set(gens[0].versions) == {5}

    wrong_shape = dict(other)
    wrong_shape["lm_head.weight"] = torch.zeros(TOK.vocab_size + 1, 128)
    with pytest.raises(ValueError, match=r"lm_head.weight: shape \(\d+, 128\) != expected"):
        engine.load_weights(wrong_shape, version=6)
    missing = {k: v for k, v in other.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="missing keys"):
        engine.load_weights(missing, version=6)
    assert engine.version == 5  # a rejected update changes nothing


def test_bad_inputs_are_rejected():
    engine = TorchEngine(make_tiny_model("llama", vocab_size=TOK.vocab_size), TOK.eos_id,
                         TOK.pad_id)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 4], []], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 999]], SamplingParams())


def test_from_checkpoint(tmp_path):
    model = make_tiny_model("llama", vocab_size=TOK.vocab_size, seed=2)
    save_checkpoint(model, TOK, str(tmp_path))
    engine = TorchEngine.from_checkpoint(str(tmp_path), version=4)
    assert engine.version == 4 and engine.tokenizer.vocab() == TOK.vocab()
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    direct = TorchEngine(model, TOK.eos_id, TOK.pad_id).generate(prompts(), params)
    assert [g.tokens for g in engine.generate(prompts(), params)] == [g.tokens for g in direct]


# --- weights offered while a generate call is in flight (docs/DESIGN.md "Weight sync modes") ---
SWITCH_AT = 4        # the offer lands after this many tokens of the rows in flight
LONG = 12


def long_model(kind: str, seed: int):
    """A tiny model whose <eos> is (practically) never sampled, so rows run to LONG tokens:
    LM head x20, <eos> row zeroed."""
    m = make_tiny_model(kind, vocab_size=TOK.vocab_size, seed=seed)
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(20.0)
        m.get_output_embeddings().weight[TOK.eos_id].zero_()
    return m


def offer_at(engine, step, state_dict, version):
    """Makes the engine offer itself `state_dict` after `step` tokens of its next rows in flight
    (the deterministic injection point: decode_step_hook runs in the generating thread)."""
    def hook(n):
        if n == step:
            engine.offer_weights(state_dict, version)
    engine.decode_step_hook = hook


def assert_logprobs_of_the_sampling_weights(gens, prompts_, by_version, temperature=1.0):
    """Each token's log-prob is the teacher-forced one of the weights of its version, given the
    whole prefix."""
    for p, g in zip(prompts_, gens):
        lp = torch.tensor(g.logprobs)
        for version, m in by_version.items():
            mine = torch.tensor(g.versions) == version
            if mine.any():
                ref = teacher_forced_logprobs(m, p, g.tokens, temperature)
                torch.testing.assert_close(lp[mine], ref[mine], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_keep_switches_rows_in_flight_at_the_next_token(kind):
    old, new = long_model(kind, seed=3), long_model(kind, seed=4)
    engine = TorchEngine(long_model(kind, seed=3), TOK.eos_id, TOK.pad_id, version=5,
                         max_batch_size=3, weight_sync_mode="keep")   # chunks of 3 and 2
    params = SamplingParams(max_new_tokens=LONG, temperature=1.0, seed=5)
    # A stop token that ends prompt 0 by its 2nd token, before the switch (sampled the same
    # way: same seed, same weights up to the switch).
    stop = TorchEngine(old, TOK.eos_id, TOK.pad_id, max_batch_size=3).generate(
        prompts(), params)[0].tokens[1]
    params = SamplingParams(max_new_tokens=LONG, temperature=1.0, seed=5, stop_token_ids=(stop,))
    offer_at(engine, SWITCH_AT, new.state_dict(), 6)
    head = engine.model.get_output_embeddings().weight
    pointers = {k: v.data_ptr() for k, v in engine.model.state_dict().items()}
    gens = engine.generate(prompts(), params)
    assert engine.version == 6 and engine.pending_version is None
    # Swapped in place (inside the call's inference mode): the same tensors, the new values.
    assert engine.model.get_output_embeddings().weight is head
    assert {k: v.data_ptr() for k, v in engine.model.state_dict().items()} == pointers
    assert torch.equal(head, new.get_output_embeddings().weight)
    first, second = gens[:3], gens[3:]
    for g in first:   # in flight at the switch: old, then new from the next token
        if g.finish_reason == "stop" and len(g.tokens) <= SWITCH_AT:
            assert g.versions == [5] * len(g.tokens)
        else:
            assert g.versions == [5] * SWITCH_AT + [6] * (len(g.tokens) - SWITCH_AT), g
    assert first[0].finish_reason == "stop" and len(first[0].tokens) <= 2
    assert sum(len(set(g.versions)) == 2 for g in first) >= 1
    for g in second:  # the next chunk started on the new weights
        assert set(g.versions) == {6}
    assert_logprobs_of_the_sampling_weights(gens, prompts(), {5: old, 6: new})
    c = engine.weight_sync_counters()
    switched = sum(len(set(g.versions)) == 2 for g in first)
    assert c["sequences_switched"] == switched and c["tokens_discarded"] == 0
    assert c["tokens"] == sum(len(g.tokens) for g in gens)
    assert c["tokens_recomputed"] == sum(len(p) + SWITCH_AT for p, g in zip(prompts(), first)
                                         if len(set(g.versions)) == 2)


def test_abort_restarts_rows_in_flight_from_their_prompts():
    old, new = long_model("llama", seed=3), long_model("llama", seed=4)
    engine = TorchEngine(long_model("llama", seed=3), TOK.eos_id, TOK.pad_id, version=0,
                         weight_sync_mode="abort")
    params = SamplingParams(max_new_tokens=LONG, temperature=1.0, seed=5)
    stop = TorchEngine(old, TOK.eos_id, TOK.pad_id).generate(prompts(), params)[0].tokens[1]
    params = SamplingParams(max_new_tokens=LONG, temperature=1.0, seed=5, stop_token_ids=(stop,))
    offer_at(engine, SWITCH_AT, new.state_dict(), 1)
    gens = engine.generate(prompts(), params)
    done_before = [g for g in gens if set(g.versions) == {0}]
    restarted = [g for g in gens if set(g.versions) == {1}]
    assert len(done_before) + len(restarted) == len(gens) and restarted
    assert gens[0] in done_before and len(gens[0].tokens) <= 2   # finished before the switch
    for g in done_before:
        assert g.finish_reason == "stop" and len(g.tokens) <= SWITCH_AT
    for g in restarted:   # a fresh budget: up to LONG tokens, all sampled by the new weights
        assert len(g.tokens) == LONG or g.finish_reason == "stop"
    assert_logprobs_of_the_sampling_weights(gens, prompts(), {0: old, 1: new})
    c = engine.weight_sync_counters()
    assert c["sequences_switched"] == len(restarted)
    assert c["tokens_discarded"] == SWITCH_AT * len(restarted) and c["tokens_recomputed"] == 0


def test_off_uses_an_offer_from_the_next_call_on():
    new = long_model("llama", seed=4)
    engine = TorchEngine(long_model("llama", seed=3), TOK.eos_id, TOK.pad_id, version=0,
                         weight_sync_mode="off")
    offer_at(engine, SWITCH_AT, new.state_dict(), 1)
    params = SamplingParams(max_new_tokens=LONG, temperature=1.0, seed=5)
    gens = engine.generate(prompts(), params)
    assert {v for g in gens for v in g.versions} == {0}
    assert engine.version == 0 and engine.pending_version == 1
    engine.decode_step_hook = None
    gens = engine.generate(prompts(), params)
    assert {v for g in gens for v in g.versions} == {1} and engine.version == 1
    assert_logprobs_of_the_sampling_weights(gens, prompts(), {1: new})
    assert engine.weight_sync_counters()["sequences_switched"] == 0


def test_offers_between_calls_stale_offers_and_bad_offers():
    a, b = long_model("llama", seed=3), long_model("llama", seed=4)
    engine = TorchEngine(long_model("llama", seed=5), TOK.eos_id, TOK.pad_id, version=2,
                         weight_sync_mode="keep")
    assert isinstance(engine, Engine) and engine.pending_version is None
    engine.offer_weights(a.state_dict(), 3)     # no call in flight: applied at once
    assert engine.version == 3 and engine.pending_version is None
    assert torch.equal(engine.model.lm_head.weight, a.lm_head.weight)
    engine.offer_weights(b.state_dict(), 3)     # not newer: ignored
    engine.offer_weights(b.state_dict(), 1)
    assert torch.equal(engine.model.lm_head.weight, a.lm_head.weight)
    weight = engine.model.lm_head.weight
    engine.offer_weights(b.state_dict(), 4)     # copied in place: the same tensors
    assert engine.model.lm_head.weight is weight and torch.equal(weight, b.lm_head.weight)
    bad = {k: v for k, v in a.state_dict().items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="missing keys"):
        engine.offer_weights(bad, 9)
    assert engine.version == 4 and engine.pending_version is None
    # An offer waiting while a load runs is dropped by a load at least as new.
    with engine._lock:                          # as if a call were in flight
        engine.offer_weights(a.state_dict(), 5)
    assert engine.pending_version == 5
    engine.load_weights(b.state_dict(), 6)
    assert engine.version == 6 and engine.pending_version is None
    with pytest.raises(ValueError, match="weight_sync_mode='pause'"):
        TorchEngine(a, TOK.eos_id, TOK.pad_id, weight_sync_mode="pause")


def test_an_engine_wrapper_delegates_the_whole_contract():
    """core.EngineWrapper forwards generation, both ways weights arrive, the sync mode and its
    counters, and keeps the tokenizer: a wrapper that changes only generate keeps the rest."""
    from sao_actor_learner.core import EngineWrapper
    from sao_actor_learner.models.checkpoint import sync_state_dict

    class Doubling(EngineWrapper):   # changes only generate
        def generate(self, prompts, params):
            return self._engine.generate([p + p for p in prompts], params)

    inner = TorchEngine(make_tiny_model("llama", vocab_size=TOK.vocab_size, seed=4), TOK.eos_id,
                        TOK.pad_id, weight_sync_mode="keep")
    inner.tokenizer = TOK
    wrapped = Doubling(inner)
    assert wrapped.tokenizer is TOK and wrapped.weight_sync_mode == "keep"
    params = SamplingParams(max_new_tokens=3, temperature=1.0, seed=0)
    assert [g.tokens for g in wrapped.generate([TOK.encode("1+")], params)] == \
        [g.tokens for g in inner.generate([TOK.encode("1+1+")], params)]
    weights = sync_state_dict(make_tiny_model("llama", vocab_size=TOK.vocab_size, seed=5))
    wrapped.load_weights(weights, 3)
    assert wrapped.version == inner.version == 3
    wrapped.offer_weights(weights, 4)   # no call in flight: applied at once
    assert inner.version == 4
    assert wrapped.weight_sync_counters() == inner.weight_sync_counters()
