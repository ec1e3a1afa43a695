"""LoRA for the policy (models/lora.py): target matching, the merge against a slow sum of
rank-one updates, a LoRA policy step against a hand-built reference (base weights + B A as plain
tensors), merged weights reaching a torch engine through the learner's publish path with the
engine's log-probs equal to the learner's after an update (an adapter that never reaches the
engine would look like staleness), checkpoints (merged model directory, PEFT adapter folder)
and resume, and the config errors before launch."""
import copy
import json
import os
import sys

if "triton" not in sys.modules:  # the Triton interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch

pytest.importorskip("peft")

from sao_actor_learner import core, preflight
from sao_actor_learner.builder import assemble_learner, make_critic
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.engines import TorchEngine
from sao_actor_learner.learner.journal import checkpoint_path
from sao_actor_learner.learner.policy import PolicyTrainer
from sao_actor_learner.models import lora
from sao_actor_learner.models.checkpoint import (bytes_to_state_dict_views, load_policy,
                                                 save_checkpoint, state_dict_to_buffers,
                                                 sync_state_dict)
from sao_actor_learner.models.factory import make_tiny_model
from sao_actor_learner.models.tokenizer import CharTokenizer
from sao_actor_learner.types import Rollout, collate

torch.set_num_threads(1)
TOKENIZER = CharTokenizer()
V = TOKENIZER.vocab_size


def base_policy(seed=0):
    return make_tiny_model("llama", vocab_size=V, hidden_size=64, num_heads=2,
                           intermediate_size=96, max_position_embeddings=64, seed=seed)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama model directory with the character tokenizer (the base model)."""
    path = str(tmp_path_factory.mktemp("lora_base"))
    save_checkpoint(base_policy(), TOKENIZER, path)
    return path


def rollouts_for(logp_fn, n=4, seed=0, version=0, offset=0.0):
    """Rollouts of random tokens whose rollout_logp is logp_fn's (plus `offset`)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = list(rng.integers(3, V, size=3))
        action = list(rng.integers(3, V, size=int(rng.integers(2, 6))))
        tokens = prompt + action
        out.append(Rollout(tokens=tokens, action_mask=[0] * 3 + [1] * len(action),
                           rollout_logp=np.zeros(len(tokens)),
                           versions=[-1] * 3 + [version] * len(action),
                           rewards=[0.0] * (len(tokens) - 1) + [float(i % 2)], prompt_id=i))
    with torch.no_grad():
        logp = logp_fn(collate(out))
    for i, r in enumerate(out):
        r.rollout_logp = ((logp[i, :r.length].numpy() + offset) * r.action_mask).astype(
            np.float32)
    return out


def randomize_b(policy, seed=1, std=0.05):
    """B starts at zero (then A gets no gradient); a non-zero B makes the test see both."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora.adapted_layers(policy).values():
            w = layer.lora_B[lora.ADAPTER_NAME].weight
            w.copy_(torch.randn(w.shape, generator=gen) * std)


# --- targets and the merge (pure) ---------------------------------------------------------------
def test_default_targets_cover_attention_and_mlp_and_never_the_head():
    names = lora.resolve_targets(base_policy())
    assert len(names) == 2 * 7
    assert all(n.split(".")[-1] in lora._ATTENTION + lora._MLP for n in names)
    assert "lm_head" not in names
    assert lora.resolve_targets(base_policy(), ("self_attn\\.(q|v)_proj",)) == [
        f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in ("q", "v")]


def test_a_pattern_that_matches_nothing_is_an_error():
    names = lora.adaptable_modules(base_policy())
    with pytest.raises(ValueError, match=r"\['qproj_typo'\] match no linear layer"):
        lora.match_target_modules(("q_proj", "qproj_typo"), names)
    with pytest.raises(ValueError, match="match no linear layer"):
        lora.match_target_modules(("lm_head",), names)       # the head cannot be adapted
    with pytest.raises(ValueError, match="not a regex"):
        lora.match_target_modules(("q_proj(",), names)
    with pytest.raises(ValueError, match="no default LoRA target modules"):
        lora.default_target_patterns("some_new_arch")


def test_lora_delta_equals_a_sum_of_rank_one_updates():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, generator=gen), torch.randn(4, 3, generator=gen)
    slow = torch.zeros(4, 5)
    for k in range(3):
        for i in range(4):
            for j in range(5):
                slow[i, j] += 0.5 * b[i, k] * a[k, j]
    torch.testing.assert_close(lora.lora_delta(a, b, 0.5), slow)
    torch.testing.assert_close(lora.lora_delta(a, b, 0.5, fan_in_fan_out=True), slow.T)


def tied_qwen3(seed=0):
    """A tiny Qwen3 with tied input and output embeddings (as the small Qwen3 checkpoints)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=32,
                                        tie_word_embeddings=True))


@pytest.mark.parametrize("make", [base_policy, tied_qwen3], ids=["llama", "qwen3-tied"])
def test_merged_weights_compute_what_the_adapted_model_computes(make):
    policy = make()
    base = sync_state_dict(policy)
    base = {k: v.clone() for k, v in base.items()}
    lora.add_adapters(policy, lora.LoraSpec(rank=4, alpha=8.0))
    randomize_b(policy)
    merged = sync_state_dict(policy)
    assert list(merged) == list(base)   # the base model's names, in its order: no adapter
    layers = lora.adapted_layers(policy)
    for name, layer in layers.items():
        a = layer.lora_A["default"].weight.detach()
        b = layer.lora_B["default"].weight.detach()
        torch.testing.assert_close(merged[f"{name}.weight"],
                                   base[f"{name}.weight"] + 2.0 * b @ a)
    untouched = set(base) - {f"{n}.weight" for n in layers}
    assert all(torch.equal(merged[k], base[k]) for k in untouched)
    plain = make()
    missing, unexpected = plain.load_state_dict(merged, strict=False)
    tied = make is tied_qwen3      # the tied head is left out and follows its embedding
    assert (missing, unexpected) == ((["lm_head.weight"] if tied else []), [])
    assert tied == torch.equal(plain.get_output_embeddings().weight,
                               merged["model.embed_tokens.weight"])
    tokens = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens).logits, policy(tokens).logits,
                                   atol=1e-5, rtol=1e-5)


# --- the policy step ------------------------------------------------------------------------------
def test_a_lora_step_equals_the_reference_computation():
    """PolicyTrainer.step on the adapted model vs autograd through W + s B A written out by
    hand on a plain copy of the base model (torch.func.functional_call), with a slow DIS loss:
    the same adapter gradients; only the adapters move."""
    policy = base_policy()
    reference_model = copy.deepcopy(policy)
    spec = lora.LoraSpec(rank=4, alpha=8.0, seed=3)
    targets = lora.add_adapters(policy, spec)
    randomize_b(policy)
    before = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    trainer = PolicyTrainer(policy, LearnerConfig(max_grad_norm=1e9, kernel_backend="torch",
                                                  policy_lr=1e-3))
    rollouts = rollouts_for(trainer.logprobs, n=4, offset=-0.05)
    batch = collate(rollouts)
    rng = np.random.default_rng(0)
    adv = torch.tensor(rng.normal(size=batch.tokens.shape), dtype=torch.float32) * \
        batch.action_mask
    trainer.step(batch, adv)

    layers = lora.adapted_layers(policy)
    a = {n: before[f"{n}.lora_A.default.weight"].clone().requires_grad_() for n in targets}
    b = {n: before[f"{n}.lora_B.default.weight"].clone().requires_grad_() for n in targets}
    weights = {f"{n}.weight": before[f"{n}.base_layer.weight"] + spec.scaling * b[n] @ a[n]
               for n in targets}
    logits = torch.func.functional_call(reference_model, weights, (batch.tokens,),
                                        {"attention_mask": batch.attention_mask}).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(
        -1, batch.tokens[:, 1:, None])[..., 0]
    logp = torch.cat([torch.zeros_like(logp[:, :1]), logp], 1)
    loss = 0.0
    mask = batch.action_mask.float()
    for i in range(batch.size):                 # the DIS loss, token by token
        for t in range(batch.tokens.shape[1]):
            if mask[i, t]:
                ratio = torch.exp(logp[i, t] - batch.rollout_logp[i, t])
                if 0.7 <= float(ratio.detach()) <= 6.0:
                    loss = loss - ratio * adv[i, t]
    (loss / mask.sum()).backward()
    for n in targets:
        layer = layers[n]
        torch.testing.assert_close(layer.lora_A["default"].weight.grad, a[n].grad,
                                   atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(layer.lora_B["default"].weight.grad, b[n].grad,
                                   atol=1e-6, rtol=1e-4)
    after = policy.state_dict()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    assert moved and all(".lora_" in k for k in moved)
    assert any(".lora_A." in k for k in moved) and any(".lora_B." in k for k in moved)


# --- merged weights reach the engine ------------------------------------------------------------
class CapturingPublisher:
    """Stands in for VariablePublisher (the gRPC and shared-memory paths carry the payload
    bytes unchanged; tests/test_variables*.py): keeps what the learner publishes."""

    def __init__(self):
        self.published = {}

    def publish(self, version, payload, dropped_total=0):
        self.published[version] = b"".join(bytes(memoryview(p)) for p in payload)

    def report_progress(self, **kwargs):
        return None


def lora_learner(model_dir, publisher=None, checkpoint_root=None, checkpoint=None,
                 **overrides):
    """builder._build_learner's order: base from the model directory, critic from its body,
    then the adapters (loaded from `checkpoint` when resuming)."""
    config = SAOConfig(batch_size=4, actor_batch=4, max_steps=5, model=model_dir,
                       lora_rank=4, lora_alpha=8.0, policy_lr=2e-2, kernel_backend="torch",
                       **overrides)
    policy, tokenizer = load_policy(model_dir)
    critic = make_critic(config, policy)
    lora.prepare_learner_policy(policy, lora.LoraSpec.from_config(config), checkpoint,
                                model_dir)
    return assemble_learner(config, policy, critic, _Source(), publisher=publisher,
                            serialize=state_dict_to_buffers, tokenizer=tokenizer,
                            checkpoint_root=checkpoint_root, pad_id=tokenizer.pad_id)


class _Source(core.RolloutSource):
    """No replay: the tests call learner.update with their own batches."""

    def sample(self, n, timeout_s):
        return []

    def queue_size(self):
        return 0


def train(learner, steps, seed=0):
    for s in range(steps):
        rollouts = rollouts_for(learner.policy_trainer.logprobs, seed=seed + s,
                                version=learner.version)
        learner.update(collate(rollouts))
        learner.version += 1


def learner_logp_of(learner, prompts, generations):
    rollouts = [Rollout(tokens=list(p) + list(g.tokens),
                        action_mask=[0] * len(p) + [1] * len(g.tokens),
                        rollout_logp=[0.0] * len(p) + list(g.logprobs),
                        versions=[-1] * len(p) + list(g.versions),
                        rewards=[0.0] * (len(p) + len(g.tokens)), prompt_id=i)
                for i, (p, g) in enumerate(zip(prompts, generations))]
    batch = collate(rollouts)
    with torch.no_grad():
        logp = learner.policy_trainer.logprobs(batch)
    mask = batch.action_mask.bool()
    return logp[mask], batch.rollout_logp[mask]


def test_merged_weights_reach_the_engine_and_its_logprobs_equal_the_learners(model_dir):
    publisher = CapturingPublisher()
    learner = lora_learner(model_dir, publisher=publisher)
    engine = TorchEngine.from_checkpoint(model_dir)
    learner.publish()                                    # version 0: the base model exactly
    assert set(bytes_to_state_dict_views(publisher.published[0])) == \
        set(sync_state_dict(load_policy(model_dir)[0]))
    train(learner, 2)
    learner.publish()
    weights = bytes_to_state_dict_views(publisher.published[2])
    assert not any("lora" in k or "base_layer" in k for k in weights)
    prompts = [TOKENIZER.encode(f"{a}+{b}=") for a, b in ((12, 30), (45, 7), (3, 99))]
    params = core.SamplingParams(max_new_tokens=8, temperature=1.0, seed=0)
    stale = engine.generate(prompts, params)             # still the base weights
    learner_logp, engine_logp = learner_logp_of(learner, prompts, stale)
    assert (learner_logp - engine_logp).abs().max() > 1e-2   # the update matters
    engine.load_weights(weights, 2)
    fresh = engine.generate(prompts, params)
    assert all(v == 2 for g in fresh for v in g.versions)
    learner_logp, engine_logp = learner_logp_of(learner, prompts, fresh)
    torch.testing.assert_close(learner_logp, engine_logp, atol=1e-4, rtol=0)


# --- checkpoints and resume ---------------------------------------------------------------------
def test_checkpoint_is_a_merged_model_directory_with_a_peft_adapter_and_resumes(model_dir,
                                                                                tmp_path):
    from peft import PeftModel

    root = str(tmp_path / "checkpoints")
    learner = lora_learner(model_dir, checkpoint_root=root)
    train(learner, 2)
    path = learner.save_checkpoint()
    assert os.path.isfile(os.path.join(path, "adapter", "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter", "adapter_config.json")) as f:
        assert json.load(f)["r"] == 4
    tokens = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = learner.policy(tokens).logits
        exported, _ = load_policy(path)            # the merged Hugging Face directory
        torch.testing.assert_close(exported(tokens).logits, expected, atol=1e-5, rtol=1e-5)
        adapted = PeftModel.from_pretrained(load_policy(model_dir)[0],
                                            os.path.join(path, "adapter"))
        torch.testing.assert_close(adapted(tokens).logits, expected, atol=1e-5, rtol=1e-5)
    from sao_actor_learner.learner.checkpointing import read_learner_state
    state = read_learner_state(os.path.join(path, "learner_state.pt"))

    resumed = lora_learner(model_dir, checkpoint=path)
    resumed.restore(state)
    assert resumed.version == 2
    for (k, mine), theirs in zip(resumed.policy.state_dict().items(),
                                 learner.policy.state_dict().values()):
        assert torch.equal(mine, theirs), k
    train(learner, 1, seed=10)                   # one more step on both: the same weights
    train(resumed, 1, seed=10)
    for k, v in learner.policy.state_dict().items():
        torch.testing.assert_close(resumed.policy.state_dict()[k], v, atol=1e-6, rtol=1e-6)


def test_resume_refuses_other_lora_settings_and_another_base(model_dir, tmp_path):
    learner = lora_learner(model_dir, checkpoint_root=str(tmp_path / "c"))
    train(learner, 1)
    path = learner.save_checkpoint()
    with pytest.raises(ValueError, match="lora_rank"):
        lora.prepare_learner_policy(load_policy(model_dir)[0], None, path)
    with pytest.raises(ValueError, match=r"rank 4 \(now --lora_rank=8\)"):
        lora.prepare_learner_policy(load_policy(model_dir)[0], lora.LoraSpec(8, 8.0), path)
    with pytest.raises(ValueError, match="other target modules"):
        lora.prepare_learner_policy(load_policy(model_dir)[0],
                                    lora.LoraSpec(4, 8.0, ("q_proj",)), path)
    other_base = str(tmp_path / "other_base")
    save_checkpoint(base_policy(seed=5), TOKENIZER, other_base)
    with pytest.raises(ValueError, match="not the base model"):
        lora.prepare_learner_policy(load_policy(other_base)[0], lora.LoraSpec(4, 8.0), path)
    full = str(tmp_path / "full")                # a checkpoint without adapters
    save_checkpoint(base_policy(), TOKENIZER, full)
    with pytest.raises(ValueError, match="--lora_rank=0"):
        lora.prepare_learner_policy(load_policy(model_dir)[0], lora.LoraSpec(4, 8.0), full)


def test_shared_trunk_value_head_trains_through_the_adapters(model_dir):
    learner = lora_learner(model_dir, critic="shared_trunk")
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    head = {k: v.clone() for k, v in learner.estimator.critic.head.state_dict().items()}
    train(learner, 1)
    after = learner.policy.state_dict()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    assert moved and all(".lora_" in k for k in moved)
    assert any(not torch.equal(v, head[k])
               for k, v in learner.estimator.critic.head.state_dict().items())


# --- configuration --------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (dict(lora_rank=-1), "lora_rank=-1"),
    (dict(lora_rank=8, lora_alpha=0.0), "lora_alpha=0.0"),
    (dict(lora_target_modules=("q_proj",)), "lora_rank=0: LoRA is off"),
    (dict(lora_rank=8, learners=2, learner_strategy="fsdp2"), "learner_strategy='fsdp2'"),
])
def test_bad_lora_settings_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        SAOConfig(**overrides)


def test_preflight_refuses_target_patterns_that_match_nothing(model_dir):
    config = SAOConfig(model=model_dir, lora_rank=4, lora_target_modules=("q_proj", "qkv"))
    assert preflight.needs_model_checks(config)
    with pytest.raises(ConfigError, match=r"\['qkv'\] match no linear layer.*"
                                          "--lora_target_modules"):
        preflight.model_checks(config)
    ok = SAOConfig(model=model_dir, lora_rank=4, lora_target_modules=("v_proj",))
    assert preflight.model_checks(ok)["lora_target_modules"] == 2


# --- the whole program ----------------------------------------------------------------------------
def test_lockstep_program_with_lora_keeps_engine_and_learner_in_agreement(warm_start, tmp_path):
    """A real program (Reverb, gRPC, the variable server, an actor's torch engine) with LoRA and
    a large learning rate, lock-step (every batch sampled by the version it trains): if the
    merged adapters did not reach the actor, every step after the first would see the engine's
    log-probs drift from the learner's (KL and ratio away from 0 and 1, ESS down)."""
    from sao_actor_learner.builder import make_program
    from sao_actor_learner.observers import read_metrics
    from sao_actor_learner.run import run_program

    config = SAOConfig(init_checkpoint=warm_start, run_dir=str(tmp_path / "run"), max_steps=4,
                       batch_size=8, num_actors=1, actor_batch=8, lockstep=True,
                       launch="local_mt", evaluator="off", lora_rank=4, lora_alpha=8.0,
                       policy_lr=1e-2, critic="shared_trunk")
    summary = run_program(config, make_program, progress=False)
    assert summary["steps"] == 4
    train = read_metrics(config.run_dir, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for row in train:
        assert abs(row["kl_rollout"]) < 1e-5 and abs(row["ratio_mean"] - 1) < 1e-3, row
        assert row["ess"] > 0.999
    final = checkpoint_path(os.path.join(config.run_dir, "checkpoints"), 4)
    assert os.path.isdir(os.path.join(final, "adapter"))
    moved, base = load_policy(final)[0].state_dict(), load_policy(warm_start)[0].state_dict()
    assert max(float((moved[k] - base[k]).abs().max()) for k in base) > 1e-3
