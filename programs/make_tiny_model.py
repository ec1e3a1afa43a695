"""Builds a tiny random-init Qwen3 checkpoint with a byte-level BPE tokenizer, offline.

  python programs/make_tiny_model.py --out_dir=checkpoints/tiny_qwen3

Trains the tokenizer of experiments/workloads/tiny_bpe.py (Qwen2 split regex, digits one per
token, specials <|endoftext|> <|im_start|> <|im_end|>, Qwen-style chat template), then creates a
randomly initialised `Qwen3ForCausalLM` sized by the flags, with tied input/output embeddings,
vocab_size = len(tokenizer), no BOS token, eos = <|im_end|>, pad = <|endoftext|>, and a
generation config whose eos_token_id is the list [<|im_end|>, <|endoftext|>] as real Qwen
checkpoints have. Both are written with save_pretrained (model.safetensors) and reload with
AutoTokenizer / AutoModelForCausalLM. The same flags give byte-identical files. Takes seconds.
"""
from __future__ import annotations

import os
import sys

# Runnable as a script from the repository root without installation.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command-line flags (defined only when run as a script, so importing is free)."""
    flags.DEFINE_string("out_dir", "checkpoints/tiny_qwen3", "Checkpoint folder to write.")
    flags.DEFINE_integer("vocab_size", 3000, "BPE vocabulary: 256 bytes, 3 specials, merges.")
    flags.DEFINE_integer("hidden_size", 128, "Model width.")
    flags.DEFINE_integer("num_layers", 4, "Decoder layers.")
    flags.DEFINE_integer("num_heads", 4, "Attention heads.")
    flags.DEFINE_integer("num_kv_heads", 2, "Key/value heads (grouped-query attention).")
    flags.DEFINE_integer("head_dim", 32, "Per-head width (vLLM's CPU attention needs >= 32).")
    flags.DEFINE_integer("intermediate_size", 512, "MLP width.")
    flags.DEFINE_integer("max_position_embeddings", 1024, "Longest sequence.")
    flags.DEFINE_integer("seed", 0, "Seed of the tokenizer corpus and the initial weights.")


def build(out_dir: str, vocab_size: int = 3000, hidden_size: int = 128, num_layers: int = 4,
          num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32,
          intermediate_size: int = 512, max_position_embeddings: int = 1024, seed: int = 0):
    """Writes tokenizer and model to out_dir; returns (tokenizer, model)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from experiments.workloads import tiny_bpe

    tokenizer = tiny_bpe.train_tokenizer(vocab_size, seed)
    im_end, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=im_end, pad_token_id=pad, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=[im_end, pad],
                                               pad_token_id=pad)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tiny_bpe.save_tokenizer(tokenizer, out_dir)
    return tokenizer, model


def main(argv):
    del argv
    _, model = build(FLAGS.out_dir, FLAGS.vocab_size, FLAGS.hidden_size, FLAGS.num_layers,
                     FLAGS.num_heads, FLAGS.num_kv_heads, FLAGS.head_dim,
                     FLAGS.intermediate_size, FLAGS.max_position_embeddings, FLAGS.seed)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {FLAGS.out_dir}: {params:,} parameters, vocab {model.config.vocab_size}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
