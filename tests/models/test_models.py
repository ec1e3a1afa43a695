"""Tokenizer, tiny-model factory and checkpoint I/O."""
import subprocess
import sys

import pytest
import torch

from sao_actor_learner.models import (KINDS, CharTokenizer, bytes_to_state_dict, check_compatible,
                                      load_policy, make_tiny_model, save_checkpoint,
                                      state_dict_to_bytes)

torch.set_num_threads(1)
TEXT = "37+45=82 (a, b): [x/y] <z>?\nfoo - 3*4"


@pytest.fixture(scope="module")
def tok():
    return CharTokenizer()


def test_tokenizer_round_trip_and_special_ids(tok):
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:]
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == TEXT
    assert tok.decode([tok.bos_id, tok.token_id("7"), tok.eos_id],
                      skip_special=False) == "<bos>7<eos>"
    assert tok.encode("12", add_bos=False) == [tok.token_id("1"), tok.token_id("2")]
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(set(TEXT) | set("0123456789abcdefghijklmnopqrstuvwxyz()[]<>/,:?"))
    assert len(set(tok.vocab().values())) == tok.vocab_size


def test_tokenizer_rejects_unknown_characters(tok):
    with pytest.raises(ValueError, match="'A'"):
        tok.encode("1+A")
    with pytest.raises(ValueError, match="not in the tokenizer"):
        tok.token_id("%")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_tokenizer_save_load(tok, tmp_path):
    tok.save(str(tmp_path))
    again = CharTokenizer.load(str(tmp_path))
    assert again.vocab() == tok.vocab()
    with pytest.raises(FileNotFoundError, match="char_tokenizer.json"):
        CharTokenizer.load(str(tmp_path / "nope"))


def test_hf_fast_tokenizer_has_our_ids(tok, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    hf = tok.to_hf()
    assert isinstance(hf, PreTrainedTokenizerFast)
    assert hf(TEXT)["input_ids"] == tok.encode(TEXT)
    assert hf.encode(TEXT, add_special_tokens=False) == tok.encode(TEXT, add_bos=False)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (tok.pad_id, tok.bos_id, tok.eos_id)
    assert hf.decode(tok.encode(TEXT) + [tok.eos_id], skip_special_tokens=True) == TEXT
    assert len(hf) == tok.vocab_size
    hf.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded(TEXT)["input_ids"] == tok.encode(TEXT)


@pytest.mark.parametrize("kind", KINDS)
def test_factory_builds_and_runs(kind, tok):
    model = make_tiny_model(kind, vocab_size=tok.vocab_size, seed=3)
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads >= 32
    assert cfg.tie_word_embeddings is False
    ids = torch.tensor([tok.encode("12+34=")])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], tok.vocab_size)
    assert torch.isfinite(logits).all()
    again = make_tiny_model(kind, vocab_size=tok.vocab_size, seed=3)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    if kind == "qwen3_moe":
        assert cfg.num_experts > 1


def test_factory_errors():
    with pytest.raises(ValueError, match="head_dim=16"):
        make_tiny_model("llama", vocab_size=60, hidden_size=128, num_heads=8)
    with pytest.raises(ValueError, match="kind='gpt2'"):
        make_tiny_model("gpt2", vocab_size=60)


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_round_trip(kind, tok, tmp_path):
    model = make_tiny_model(kind, vocab_size=tok.vocab_size, seed=1)
    save_checkpoint(model, tok, str(tmp_path))
    loaded, tok2 = load_policy(str(tmp_path))
    assert tok2.vocab() == tok.vocab()
    assert not loaded.training
    ref, new = model.state_dict(), loaded.state_dict()
    assert ref.keys() == new.keys()
    for name in ref:
        assert torch.equal(ref[name], new[name]), name
    ids = torch.tensor([tok.encode("5+6=")])
    torch.testing.assert_close(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_checkpoint_folder_loads_with_auto_classes(tok, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    save_checkpoint(make_tiny_model("llama", vocab_size=tok.vocab_size), tok, str(tmp_path))
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert isinstance(hf_tok, PreTrainedTokenizerFast)
    assert hf_tok("9+9=")["input_ids"] == tok.encode("9+9=")
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path)).config.eos_token_id == tok.eos_id
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_policy(str(tmp_path / "missing"))


def test_state_dict_bytes_round_trip(tok):
    sd = make_tiny_model("llama", vocab_size=tok.vocab_size).state_dict()
    sd["extra.bf16"] = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    data = state_dict_to_bytes(sd)
    assert isinstance(data, bytes)
    back = bytes_to_state_dict(data)
    assert back.keys() == sd.keys()
    for name in sd:
        assert back[name].dtype == sd[name].dtype and torch.equal(back[name], sd[name]), name
    # Shared storage (tied weights) is cloned rather than refused.
    shared = torch.ones(3, 4)
    tied = bytes_to_state_dict(state_dict_to_bytes({"a": shared, "b": shared}))
    assert torch.equal(tied["a"], tied["b"])


def test_check_compatible_names_every_problem(tok):
    ref = make_tiny_model("llama", vocab_size=tok.vocab_size).state_dict()
    check_compatible(ref, dict(ref))  # identical: fine

    bad = dict(ref)
    del bad["lm_head.weight"]
    bad["model.bogus"] = torch.zeros(1)
    bad["model.norm.weight"] = torch.zeros(7)
    bad["model.embed_tokens.weight"] = ref["model.embed_tokens.weight"].to(torch.bfloat16)
    with pytest.raises(ValueError) as err:
        check_compatible(ref, bad)
    msg = str(err.value)
    for fragment in ("missing keys [lm_head.weight]", "unexpected keys [model.bogus]",
                     "model.norm.weight: shape (7,) != expected (128,)",
                     "model.embed_tokens.weight: dtype torch.bfloat16 != expected torch.float32"):
        assert fragment in msg


def test_models_do_not_import_reverb_tensorflow_grpc():
    code = ("import sys, sao_actor_learner.models, sao_actor_learner.engines, "
            "sao_actor_learner.tasks; "
            "bad = [m for m in ('reverb', 'tensorflow', 'grpc') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
