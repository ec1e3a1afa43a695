"""Tiny randomly initialised Hugging Face causal LMs for the toy tasks.

`make_tiny_model("llama", vocab_size)` is a 2-layer LlamaForCausalLM (hidden 128, 4 heads of
head_dim 32: vLLM's CPU attention needs head_dim >= 32). `"qwen3_moe"` is a Qwen3MoeForCausalLM
of the same width with a few tiny experts per layer.

Embeddings are UNTIED (`tie_word_embeddings=False`): every parameter has exactly one name, so a
state dict round-trips through safetensors bytes (which refuse shared tensors), a strict
`load_state_dict` sees every key, and a weight update that sends the full state dict to vLLM
needs no special case. It costs vocab_size * hidden_size extra parameters (~7k here).

Qwen3-MoE note: in transformers 5 the in-memory experts are fused 3D tensors
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); `save_pretrained` writes them back in the
per-expert layout vLLM reads. `model.state_dict()` (what the learner publishes) has the fused
names.
"""
from __future__ import annotations

from typing import Any

import torch

KINDS = ("llama", "qwen3_moe")
MIN_HEAD_DIM = 32  # vLLM's CPU attention backend rejects smaller heads


def make_tiny_model(kind: str = "llama",
                    vocab_size: int = 64,
                    hidden_size: int = 128,
                    num_layers: int = 2,
                    num_heads: int = 4,
                    intermediate_size: int = 256,
                    max_position_embeddings: int = 128,
                    seed: int = 0,
                    **overrides: Any) -> torch.nn.Module:
    """A randomly initialised causal LM of `kind` in float32, in eval mode.

    `overrides` are passed to the config (e.g. `num_key_value_heads=2`, `num_experts=8`,
    `pad_token_id=...`, `attn_implementation="eager"`). Token ids default to CharTokenizer's
    (<pad>=0, <bos>=1, <eos>=2). Initialisation is deterministic given `seed`.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: must be one of {', '.join(KINDS)}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    head_dim = overrides.pop("head_dim", hidden_size // num_heads)
    if head_dim < MIN_HEAD_DIM:
        raise ValueError(
            f"head_dim={head_dim} (hidden_size={hidden_size} / num_heads={num_heads}) is < "
            f"{MIN_HEAD_DIM}: vLLM's CPU attention cannot load it; use fewer heads or a wider model")
    attn_implementation = overrides.pop("attn_implementation", "sdpa")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=overrides.pop("num_key_value_heads", num_heads),
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=overrides.pop("pad_token_id", 0),
        bos_token_id=overrides.pop("bos_token_id", 1),
        eos_token_id=overrides.pop("eos_token_id", 2),
        use_cache=True,
    )
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(**common, **overrides)
        cls = LlamaForCausalLM
    else:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                   decoder_sparse_step=1, norm_topk_prob=True)
        moe.update({k: overrides.pop(k) for k in list(overrides) if k in moe})
        config = Qwen3MoeConfig(**common, **moe, **overrides)
        cls = Qwen3MoeForCausalLM
    config._attn_implementation = attn_implementation
    saved_rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = cls(config)
    finally:
        torch.random.set_rng_state(saved_rng)  # do not disturb the caller's RNG stream
    model.to(torch.float32)
    model.eval()
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters of `model`."""
    return sum(p.numel() for p in model.parameters())
