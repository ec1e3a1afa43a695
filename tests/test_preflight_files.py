"""Bad model and critic files fail before launch with a message naming the file and what is
wrong, not with a raw error in every node: a 0-byte, truncated or garbled safetensors file, a
config.json that is not a JSON object, an embedding that does not match vocab_size, and a
critic whose architecture or tokenizer is not the policy's (naming both directories)."""
import json
import os
import shutil
import struct

import pytest

from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.models import (CharTokenizer, ModelDirError, check_model_dir,
                                      make_tiny_model, save_checkpoint)
from sao_actor_learner.models.value import ValueModel
from sao_actor_learner.preflight import check_before_launch

TOK = CharTokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny char-level Llama checkpoint (a model directory like the warm start's)."""
    out = str(tmp_path_factory.mktemp("policy"))
    save_checkpoint(make_tiny_model("llama", vocab_size=TOK.vocab_size, hidden_size=64,
                                    num_heads=2, intermediate_size=64), TOK, out)
    return out


def _copy(model_dir, tmp_path, name="copy"):
    out = str(tmp_path / name)
    shutil.copytree(model_dir, out)
    return out


def _config(path, tmp_path):
    return SAOConfig(model=path, run_dir=str(tmp_path / "run"))


def test_an_intact_model_directory_passes(model_dir, tmp_path):
    check_model_dir(model_dir, "--model")
    assert check_before_launch(_config(model_dir, tmp_path)) == {}


@pytest.mark.parametrize("damage, words", [
    ("empty", r"model.safetensors: the file is empty \(0 bytes\)"),
    ("truncated", r"model.safetensors: truncated: expected (\d+) bytes, found (\d+)"),
    ("short", r"model.safetensors: truncated: 5 bytes"),
    ("garbled", r"model.safetensors: the header is not JSON"),
    ("list_header", r"model.safetensors: the header is a JSON list"),
    ("extra", r"model.safetensors: has bytes past its last tensor: expected (\d+) bytes"),
])
def test_a_damaged_safetensors_file_fails_before_launch(model_dir, tmp_path, damage, words):
    bad = _copy(model_dir, tmp_path)
    weights = os.path.join(bad, "model.safetensors")
    size = os.path.getsize(weights)
    if damage == "empty":
        open(weights, "wb").close()
    elif damage == "truncated":
        with open(weights, "r+b") as f:
            f.truncate(size // 2)
    elif damage == "short":
        with open(weights, "r+b") as f:
            f.truncate(5)
    elif damage in ("garbled", "list_header"):
        text = b"{not json" if damage == "garbled" else b"[1, 2]"
        with open(weights, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
    else:
        with open(weights, "ab") as f:
            f.write(b"\0" * 16)
    with pytest.raises(ConfigError, match="--model=.*" + words):
        check_before_launch(_config(bad, tmp_path))
    if damage == "truncated":
        with pytest.raises(ModelDirError, match=f"found {size // 2}"):
            check_model_dir(bad, "--model")


def test_a_config_that_is_not_a_json_object_fails_before_launch(model_dir, tmp_path):
    bad = _copy(model_dir, tmp_path)
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump([{"model_type": "llama"}], f)
    with pytest.raises(ConfigError, match=r"config.json is a JSON list, not a JSON object"):
        check_before_launch(_config(bad, tmp_path))


def test_an_embedding_that_does_not_match_vocab_size_fails(model_dir, tmp_path):
    bad = _copy(model_dir, tmp_path)
    path = os.path.join(bad, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["vocab_size"] += 7
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ConfigError, match=rf"embed_tokens.weight has {TOK.vocab_size} rows but "
                                          rf"config.json's vocab_size is {TOK.vocab_size + 7}"):
        check_before_launch(_config(bad, tmp_path))


# ------------------------------------------------------------------------------ the critic
def _critic(tmp_path, name, tokenizer=None, **sizes):
    """A critic directory (ValueModel.save) of a tiny Llama; with `tokenizer`, its files too."""
    import torch
    from sao_actor_learner.models.checkpoint import save_tokenizer
    kwargs = dict(vocab_size=TOK.vocab_size, hidden_size=64, num_heads=2, intermediate_size=64)
    kwargs.update(sizes)
    out = str(tmp_path / name)
    with torch.no_grad():
        ValueModel.from_policy(make_tiny_model("llama", **kwargs)).save(out)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
    return out


def _check_critic(critic, model_dir):
    from sao_actor_learner.models.model_dir import check_critic_dir
    check_critic_dir(critic, model_dir)


def test_a_critic_made_from_the_policy_passes(model_dir, tmp_path):
    _check_critic(_critic(tmp_path, "plain"), model_dir)                # no tokenizer files
    _check_critic(_critic(tmp_path, "with_tok", tokenizer=TOK), model_dir)   # the same one
    _check_critic(model_dir, model_dir)                     # a causal-LM directory as critic


@pytest.mark.parametrize("sizes, field", [
    (dict(hidden_size=128, num_heads=4), "hidden_size"),
    (dict(num_layers=3), "num_hidden_layers"),
    (dict(vocab_size=TOK.vocab_size + 8), "vocab_size"),
])
def test_a_critic_of_another_architecture_fails_before_launch(model_dir, tmp_path, sizes,
                                                              field):
    critic = _critic(tmp_path, "other", **sizes)
    config = SAOConfig(model=model_dir, run_dir=str(tmp_path / "run"), critic_model=critic)
    with pytest.raises(ConfigError, match=rf"--critic_model=.*other.* does not match "
                                          rf"--model=.*{os.path.basename(model_dir)}.*: {field}"):
        check_before_launch(config)


def test_a_critic_of_another_model_type_fails(model_dir, tmp_path):
    other = str(tmp_path / "moe")
    save_checkpoint(make_tiny_model("qwen3_moe", vocab_size=TOK.vocab_size, hidden_size=64,
                                    num_heads=2, intermediate_size=64), TOK, other)
    with pytest.raises(ConfigError, match="does not match.*: model_type is 'qwen3_moe'"):
        check_before_launch(SAOConfig(model=model_dir, run_dir=str(tmp_path / "run"),
                                      critic_model=other))


def test_a_critic_with_another_tokenizer_fails_before_launch(model_dir, tmp_path):
    other_tok = CharTokenizer(TOK.alphabet[::-1])     # the same size, other ids
    critic = _critic(tmp_path, "other_tok", tokenizer=other_tok)
    with pytest.raises(ConfigError, match=r"--critic_model=.*other_tok.* does not match "
                                          r"--model=.*: their tokenizers differ"):
        check_before_launch(SAOConfig(model=model_dir, run_dir=str(tmp_path / "run"),
                                      critic_model=critic))


def test_a_damaged_critic_fails_before_launch(model_dir, tmp_path):
    critic = _critic(tmp_path, "damaged")
    head = os.path.join(critic, "value_head.safetensors")
    with open(head, "r+b") as f:
        f.truncate(os.path.getsize(head) - 1)
    with pytest.raises(ConfigError, match=r"--critic_model=.*value_head.safetensors: truncated"):
        check_before_launch(SAOConfig(model=model_dir, run_dir=str(tmp_path / "run"),
                                      critic_model=critic))
