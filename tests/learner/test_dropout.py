"""The learner's policy passes see the model without dropout (models/modes.py): on models whose
config has dropout, at a learning rate of ~0 the recomputed old log-probs equal the gradient
pass's, so PPO's and GSPO's ratios are 1 and nothing is clipped, and DIS's ratio against
log-probs computed by the same policy is 1; gradient checkpointing still recomputes."""
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from test_baselines import V, rollouts_for  # noqa: E402  (sets TRITON_INTERPRET first)

from sao_actor_learner.builder import assemble_learner
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.types import collate

DROPOUT = 0.5
DROPOUT_TYPES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                 torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


def llama_with_dropout():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        attention_dropout=DROPOUT, attn_implementation="eager"))


def gpt2_with_dropout():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=DROPOUT,
        embd_pdrop=DROPOUT, attn_pdrop=DROPOUT, attn_implementation="sdpa"))


def learner_for(policy, **overrides):
    config = SAOConfig(**{"algorithm": "grpo", "group_size": 4, "batch_size": 8,
                          "actor_batch": 4, "max_steps": 5, "policy_lr": 1e-12, **overrides})
    return assemble_learner(config, policy, None)


def dropout_in_training(model):
    return [n for n, m in model.named_modules() if isinstance(m, DROPOUT_TYPES) and m.training]


CASES = [(llama_with_dropout, "ppo_clip", {}),
         (gpt2_with_dropout, "ppo_clip", {}),
         (gpt2_with_dropout, "gspo", {}),
         (llama_with_dropout, "ppo_clip_decoupled", {"gradient_checkpointing": True}),
         (gpt2_with_dropout, "gspo", {"gradient_checkpointing": True,
                                      "fused_logprobs": False})]


@pytest.mark.parametrize("make, loss, extra", CASES)
def test_recomputed_old_logprobs_equal_the_gradient_pass_at_lr_zero(make, loss, extra):
    policy = make()
    learner = learner_for(policy, policy_loss=loss, **extra)
    stats = []
    for step in range(2):   # the second step starts in whatever mode the first left
        batch = collate(rollouts_for(learner, 2, 4, seed=step))
        stats.append(learner.update(batch))
        assert not dropout_in_training(policy)
    for s in stats:
        if loss.startswith("gspo"):
            assert s["gspo_ratio_min"] == pytest.approx(1.0, abs=1e-6)
            assert s["gspo_ratio_max"] == pytest.approx(1.0, abs=1e-6)
            assert s["gspo_clipped_rollout_frac"] == 0.0
        else:
            assert s["ppo_ratio_mean"] == pytest.approx(1.0, abs=1e-6)
            assert s["ppo_ratio_max"] == pytest.approx(1.0, abs=1e-6)
        assert s["clip_frac"] == 0.0
        # The rollout log-probs came from the same policy: no drift either.
        assert s["ratio_min"] == pytest.approx(1.0, abs=1e-5)
        assert s["ratio_max"] == pytest.approx(1.0, abs=1e-5)
        assert s["kl_rollout"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("make", [llama_with_dropout, gpt2_with_dropout])
def test_the_dis_ratio_is_one_with_the_rollouts_own_log_probs(make):
    policy = make()
    learner = learner_for(policy, policy_loss="dis")
    stats = learner.update(collate(rollouts_for(learner, 2, 4)))
    assert stats["ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert stats["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert stats["masked_frac"] == 0.0 and stats["chi2_token"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradient_checkpointing_still_recomputes_without_dropout(checkpointing):
    """The checkpointed layers stay in train mode (Hugging Face checkpoints only then): each
    layer's attention runs again in the backward pass; their dropout stays off."""
    policy = llama_with_dropout()
    learner = learner_for(policy, policy_loss="ppo_clip", gradient_checkpointing=checkpointing)
    trainer = learner.policy_trainer
    calls = []
    attention = policy.model.layers[0].self_attn
    attention.register_forward_hook(lambda *args: calls.append(1))
    batch = collate(rollouts_for(learner, 2, 4))
    calls.clear()
    trainer.step(batch, torch.ones(batch.tokens.shape) * batch.action_mask)
    # One old-log-prob pass without gradient, one gradient pass, and its recompute.
    assert len(calls) == (3 if checkpointing else 2)
    assert policy.model.layers[0].training == checkpointing
    assert not attention.training and not dropout_in_training(policy)
