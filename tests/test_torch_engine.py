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
