"""Any Hugging Face causal LM: model directories, tied embeddings, padded vocabularies, the
critic's frozen patterns per architecture, and the pre-launch checks."""
import json
import os
import shutil
import sys

if "triton" not in sys.modules:  # the Triton interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

import hf_fixtures as fx
from sao_actor_learner import core
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.engines.torch_engine import TorchEngine
from sao_actor_learner.builder import assemble_learner
from sao_actor_learner.models import (HFTokenizer, ModelDirError, check_model_dir, load_policy,
                                      load_sync_state_dict, save_checkpoint, sync_state_dict,
                                      token_limit)
from sao_actor_learner.models.value import (ValueModel, critic_parameter_names,
                                            safetensors_tensor_names,
                                            match_frozen_patterns)
from sao_actor_learner.preflight import check_before_launch
from sao_actor_learner.types import Rollout, collate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return fx.tiny_qwen3(str(tmp_path_factory.mktemp("tiny_qwen3")))


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory, model_dir):
    """The tiny Qwen3 with its embedding padded 40 rows past the tokenizer (as real Qwen
    checkpoints are), the padding rows of the (tied) head made to dominate every logit."""
    out = str(tmp_path_factory.mktemp("padded"))
    model, tok = load_policy(model_dir)
    n = tok.vocab_size
    model.resize_token_embeddings(n + 40)
    with torch.no_grad():
        model.get_input_embeddings().weight[n:] = 5.0
    save_checkpoint(model, tok, out)
    return out


def test_hf_tokenizer_takes_bos_stop_ids_and_pad_from_the_directory(model_dir):
    tok = HFTokenizer.from_pretrained(model_dir)
    im_end, endoftext = tok.hf.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tok.bos_id is None and tok.encode("hi", add_bos=True) == tok.encode("hi", add_bos=False)
    assert tok.stop_ids == (im_end, endoftext) and tok.eos_id == im_end
    assert tok.pad_id == endoftext and tok.vocab_size == len(tok.hf)
    ids = tok.encode("So 3 + 4 = 7.\n#### 7") + [im_end] + tok.encode("junk")
    assert tok.decode_response(ids) == "So 3 + 4 = 7.\n#### 7"
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_model_directory_errors_say_what_to_change(tmp_path, model_dir):
    with pytest.raises(ModelDirError, match="hub id.*offline.*--model=DIR"):
        check_model_dir("Qwen/Qwen3-0.6B", "--model")
    with pytest.raises(ModelDirError, match="no config.json"):
        check_model_dir(str(tmp_path), "--model")
    broken = tmp_path / "no_weights"
    shutil.copytree(model_dir, broken)
    os.remove(broken / "model.safetensors")
    with pytest.raises(ModelDirError, match="no weights"):
        check_model_dir(str(broken), "--model")
    no_tok = tmp_path / "no_tokenizer"
    shutil.copytree(model_dir, no_tok)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(no_tok / f)
    with pytest.raises(ModelDirError, match="no tokenizer"):
        check_model_dir(str(no_tok), "--model")
    check_model_dir(model_dir, "--model")


def test_tied_embeddings_sync_once_and_load_back(model_dir):
    model, _ = load_policy(model_dir)
    sd = sync_state_dict(model)
    assert "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd
    fresh, _ = load_policy(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    load_sync_state_dict(fresh, sync_state_dict(model))
    ids = torch.tensor([[1, 5, 9, 12]])
    assert torch.equal(fresh(ids).logits, model(ids).logits)   # the tied head followed
    bad = dict(sync_state_dict(model))
    bad["model.norm.weight"] = torch.zeros(3)
    before = fresh.model.norm.weight.clone()
    with pytest.raises(ValueError, match="model.norm.weight: shape"):
        load_sync_state_dict(fresh, bad)
    assert torch.equal(fresh.model.norm.weight, before)         # nothing loaded


def test_padding_rows_are_never_sampled_and_learner_logprobs_match_the_engine(padded_dir):
    engine = TorchEngine.from_checkpoint(padded_dir)
    tok = engine.tokenizer
    assert token_limit(engine.model, tok) == tok.vocab_size < engine.model.config.vocab_size
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"What is {i} plus 2?"}])
               for i in range(6)]
    gens = engine.generate(prompts, core.SamplingParams(max_new_tokens=12, temperature=1.0,
                                                        stop_token_ids=tok.stop_ids, seed=0))
    sampled = [t for g in gens for t in g.tokens]
    assert sampled and max(sampled) < tok.vocab_size
    # The learner scores the same tokens over the same vocabulary: on-policy ratio 1.
    policy, _ = load_policy(padded_dir)
    config = SAOConfig(batch_size=6, actor_batch=6, max_steps=2, fused_logprobs=True,
                       algorithm="critic_free")
    learner = assemble_learner(config, policy, pad_id=tok.pad_id,
                               token_limit=token_limit(policy, tok))
    rollouts = [Rollout(tokens=list(p) + g.tokens, action_mask=[0] * len(p) + [1] * len(g.tokens),
                        rollout_logp=[0.0] * len(p) + g.logprobs,
                        versions=[-1] * len(p) + g.versions, rewards=[0.0] * (len(p) + len(g.tokens)),
                        prompt_id=i) for i, (p, g) in enumerate(zip(prompts, gens))]
    batch = collate(rollouts, pad_id=tok.pad_id)
    with torch.no_grad():
        logp = learner.policy_trainer.logprobs(batch)
    mask = batch.action_mask.bool()
    assert torch.allclose(logp[mask], batch.rollout_logp[mask], atol=1e-4)
    unlimited = assemble_learner(config, policy, pad_id=tok.pad_id)
    with torch.no_grad():
        full = unlimited.policy_trainer.logprobs(batch)
    assert (full[mask] - batch.rollout_logp[mask]).abs().max() > 0.1   # the rows matter here


def test_a_learner_step_on_tied_qwen3_publishes_weights_without_the_tied_head(model_dir):
    policy, tok = load_policy(model_dir)
    critic = ValueModel.from_policy(policy)
    critic.freeze(SAOConfig().critic_frozen_patterns)
    sent = []

    class Publisher:
        def publish(self, version, payload, dropped_total=0):
            sent.append((version, payload))

    from sao_actor_learner.models.checkpoint import bytes_to_state_dict, state_dict_to_bytes
    learner = assemble_learner(SAOConfig(batch_size=2, actor_batch=2, max_steps=2), policy,
                               critic, publisher=Publisher(), serialize=state_dict_to_bytes,
                               pad_id=tok.pad_id)
    prompt = tok.apply_chat_template([{"role": "user", "content": "2 plus 2?"}])
    action = tok.encode("#### 4") + [tok.eos_id]
    rollouts = [Rollout(tokens=prompt + action, action_mask=[0] * len(prompt) + [1] * len(action),
                        rollout_logp=[0.0] * len(prompt) + [-3.0] * len(action),
                        versions=[-1] * len(prompt) + [0] * len(action),
                        rewards=[0.0] * (len(prompt) + len(action) - 1) + [float(i)],
                        prompt_id=i) for i in range(2)]
    stats = learner.update(collate(rollouts, pad_id=tok.pad_id))
    assert np.isfinite(stats["value_loss"]) and np.isfinite(stats["policy_grad_norm"])
    learner.publish()
    weights = bytes_to_state_dict(sent[-1][1])
    assert "lm_head.weight" not in weights and set(weights) == set(sync_state_dict(policy))


def test_critic_directories_round_trip(tmp_path, model_dir):
    policy, _ = load_policy(model_dir)
    critic = ValueModel.from_policy(policy)
    with torch.no_grad():
        critic.head.weight.fill_(0.5)
        critic.head.bias.fill_(0.1)
    path = critic.save(str(tmp_path / "critic"))
    loaded = ValueModel.load(path)
    ids, attn = torch.tensor([[1, 4, 7]]), torch.ones(1, 3, dtype=torch.long)
    assert torch.allclose(loaded(ids, attn), critic(ids, attn))
    fresh = ValueModel.load(model_dir)          # from a causal LM: a zero head
    assert torch.count_nonzero(fresh(ids, attn)) == 0
    names = sorted(n for n, _ in critic.body.named_parameters())
    assert critic_parameter_names(path) == critic_parameter_names(model_dir) == names
    assert sorted(safetensors_tensor_names(path)) == names   # the header read, checked


ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32}),
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_default_frozen_patterns_freeze_attention_embeddings_and_norms_everywhere(arch, tmp_path):
    import transformers
    name, extra = ARCHITECTURES[arch]
    cfg = getattr(transformers, name)(vocab_size=64, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=32, **extra)
    cfg.architectures = [name.replace("Config", "ForCausalLM")]
    cfg.save_pretrained(tmp_path)
    names = critic_parameter_names(str(tmp_path))
    frozen = set(match_frozen_patterns(SAOConfig().critic_frozen_patterns, names))
    trainable = [n for n in names if n not in frozen]
    assert trainable and all(".mlp." in n for n in trainable), trainable
    assert all(("self_attn" in n or "norm" in n or "embed" in n) for n in frozen)
    assert any("q_proj" in n for n in frozen) and any("embed_tokens" in n for n in frozen)
    with pytest.raises(ValueError, match=r"\['c_attn'\] match no critic parameter"):
        match_frozen_patterns(("self_attn", "c_attn"), names)   # GPT-2 naming


def test_pre_launch_checks_refuse_bad_models_and_patterns(tmp_path, model_dir):
    run = str(tmp_path / "run")
    with pytest.raises(ConfigError, match="hub id"):
        check_before_launch(SAOConfig(model="Qwen/Qwen3-0.6B", run_dir=run))
    with pytest.raises(ConfigError, match=r"\['attn\.c_proj'\] match no critic parameter"):
        check_before_launch(SAOConfig(model=model_dir, run_dir=run,
                                      critic_frozen_patterns=("self_attn", "attn.c_proj")))
    assert check_before_launch(SAOConfig(model=model_dir, run_dir=run))[
        "tokenizer_vocab_size"] == HFTokenizer.from_pretrained(model_dir).vocab_size
    with pytest.raises(ConfigError, match="--critic_model"):
        check_before_launch(SAOConfig(model=model_dir, run_dir=run,
                                      critic_model=str(tmp_path / "none")))
    assert not os.path.exists(run)


def test_dataset_config_errors_fail_before_anything_is_read(tmp_path, model_dir):
    f = fx.write_jsonl(str(tmp_path / "t.jsonl"), fx.gsm_rows(3))
    base = dict(task="dataset", model=model_dir, run_dir=str(tmp_path / "run"))
    for kwargs, words in [
        (dict(), "--train_files"),
        (dict(train_files=(f,)), "--eval_files"),
        (dict(train_files=(f,), eval_files=(str(tmp_path / "x.jsonl"),)), "no such file"),
        (dict(train_files=(str(tmp_path / "t.csv"),), eval_files=(f,)), ".jsonl or .parquet"),
        (dict(train_files=(f,), eval_files=(f,), chat_template_kwargs="{bad"), "not JSON"),
        (dict(train_files=(f,), eval_files=(f,), chat_template_kwargs="[1]"), "JSON object"),
        (dict(train_files=(f,), eval_files=(f,), max_turns=2), "single-turn"),
        (dict(train_files=(f,), eval_files=(f,), eval_pass_k=1), "eval_pass_k=1"),
    ]:
        with pytest.raises(ConfigError, match=words):
            SAOConfig(**{**base, **kwargs})
    with pytest.raises(ConfigError, match="--model=DIR"):
        SAOConfig(task="dataset", train_files=(f,), eval_files=(f,))
    with pytest.raises(ConfigError, match="one setting"):
        SAOConfig(model=model_dir, init_checkpoint="checkpoints/warm_start")
    with pytest.raises(ConfigError, match="--task=dataset"):
        SAOConfig(train_files=(f,))


def test_dataset_preflight_names_the_bad_file_row_and_reward(tmp_path, model_dir):
    good = fx.write_jsonl(str(tmp_path / "good.jsonl"), fx.gsm_rows(5))
    rows = fx.gsm_rows(4)
    rows[3]["reward_model"]["ground_truth"] = None
    bad = fx.write_jsonl(str(tmp_path / "bad.jsonl"), rows)
    base = dict(task="dataset", model=model_dir, run_dir=str(tmp_path / "run"), eval_size=5)
    with pytest.raises(ConfigError, match=r"bad.jsonl: row 3: field 'reward_model.ground_truth'"):
        check_before_launch(SAOConfig(**base, train_files=(bad,), eval_files=(good,)))
    with pytest.raises(ConfigError, match="--reward='nope.py:fn'"):
        check_before_launch(SAOConfig(**base, train_files=(good,), eval_files=(good,),
                                      reward="nope.py:fn"))
    with pytest.raises(ConfigError, match="no chat template"):
        char = SAOConfig(**{**base, "model": "checkpoints/warm_start"}, train_files=(good,),
                         eval_files=(good,), apply_chat_template=True)
        if not os.path.exists("checkpoints/warm_start/config.json"):
            pytest.skip("needs the arithmetic warm start (make warm-start)")
        check_before_launch(char)
    stats = check_before_launch(SAOConfig(**base, train_files=(good,), eval_files=(good,)))
    assert stats["train_rows"] == 5 and stats["train_filtered_long"] == 0
