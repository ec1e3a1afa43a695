"""`HFTokenizer`: a `core.Tokenizer` over the tokenizer of a Hugging Face model directory.

What it takes from the directory, and how it differs between model families:
  - vocab_size is `len(tokenizer)` (specials included). A model's embedding may have more rows
    (Qwen pads it to a multiple of 128); ids at or beyond vocab_size have no token and are never
    sampled (the engines and the learner mask them, see `models.checkpoint.token_limit`).
  - bos_id is the id the tokenizer prepends when asked to add special tokens (Llama's
    <|begin_of_text|>), or None when it prepends nothing (Qwen).
  - stop_ids are the tokenizer's eos id plus every id of `generation_config.json`'s
    `eos_token_id` (an int or, for chat models, a list such as Qwen's <|im_end|> and
    <|endoftext|>); eos_id is the first of them (the id that ends an assistant turn).
  - pad_id is the tokenizer's pad id, else eos_id (Llama 3 has no pad token).
  - the chat template is the tokenizer's; `apply_chat_template` returns ids, whatever the
    installed transformers returns (a list in 4.x, a BatchEncoding in 5.x).

Loading is offline only (`local_files_only=True`): a hub id fails at once instead of retrying
DNS for a minute.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence, Tuple

from sao_actor_learner import core

# Files whose presence marks a directory as holding a Hugging Face tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def generation_eos_ids(directory: str) -> Tuple[int, ...]:
    """The `eos_token_id` entries of `directory/generation_config.json` (an int or a list), in
    order; () when the file or the key is absent."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.exists(path):
        return ()
    with open(path) as f:
        value = json.load(f).get("eos_token_id")
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(int(v) for v in values)


class HFTokenizer(core.Tokenizer):
    """A `core.Tokenizer` wrapping a `transformers` tokenizer.

    Args:
      hf_tokenizer: a loaded `transformers` tokenizer (fast or slow).
      extra_stop_ids: ids that also end a turn (generation_config's eos ids).
    """

    def __init__(self, hf_tokenizer, extra_stop_ids: Sequence[int] = ()):
        self.hf = hf_tokenizer
        n = len(hf_tokenizer)
        stops: List[int] = []
        for t in list(extra_stop_ids) + [hf_tokenizer.eos_token_id]:
            if t is not None and int(t) not in stops:
                stops.append(int(t))
        if not stops:
            raise ValueError("the tokenizer has no eos token and generation_config.json names no "
                             "eos_token_id: nothing could end a model turn; set eos_token in "
                             "tokenizer_config.json or eos_token_id in generation_config.json")
        bad = [t for t in stops if not 0 <= t < n]
        if bad:
            raise ValueError(f"stop ids {bad} are outside the tokenizer's {n} ids")
        # generation_config's order first: its first id is what ends an assistant turn.
        self._stop_ids = tuple(stops)
        self._eos = stops[0]
        pad = hf_tokenizer.pad_token_id
        self._pad = int(pad) if pad is not None else self._eos
        with_specials = hf_tokenizer.encode("a", add_special_tokens=True)
        plain = hf_tokenizer.encode("a", add_special_tokens=False)
        prefix = with_specials[:len(with_specials) - len(plain)] \
            if with_specials[len(with_specials) - len(plain):] == plain else []
        self._bos = int(prefix[0]) if prefix else None
        added = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
        self._special = frozenset(int(i) for i in hf_tokenizer.all_special_ids) | \
            frozenset(self._stop_ids) | frozenset(int(i) for i, t in added.items() if t.special)

    @classmethod
    def from_pretrained(cls, directory: str) -> "HFTokenizer":
        """The tokenizer of the model directory `directory` (offline), with its
        generation_config eos ids as extra stop ids."""
        from transformers import AutoTokenizer

        if not os.path.isdir(directory):
            raise FileNotFoundError(f"{directory!r} is not a directory holding a tokenizer")
        if not any(os.path.exists(os.path.join(directory, f)) for f in TOKENIZER_FILES):
            raise FileNotFoundError(
                f"{directory!r} holds no tokenizer ({' or '.join(TOKENIZER_FILES)} missing); "
                "copy the model's tokenizer files into it (save_pretrained writes them)")
        hf = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        return cls(hf, extra_stop_ids=generation_eos_ids(directory))

    # core.Tokenizer ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def bos_id(self) -> Optional[int]:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def stop_ids(self) -> Tuple[int, ...]:
        return self._stop_ids

    @property
    def special_ids(self) -> frozenset:
        return self._special

    def encode(self, text: str, add_bos: bool = True) -> List[int]:
        ids = [int(i) for i in self.hf.encode(text, add_special_tokens=False,
                                              split_special_tokens=True)]
        if add_bos and self._bos is not None:
            ids.insert(0, self._bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        ids = [int(i) for i in ids]
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are out of range for the tokenizer's {n} ids "
                             "(ids past the tokenizer are padding rows of the embedding)")
        return self.hf.decode(ids, skip_special_tokens=skip_special)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> List[int]:
        if not self.has_chat_template:
            return super().apply_chat_template(messages, add_generation_prompt, **template_kwargs)
        out = self.hf.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                          add_generation_prompt=add_generation_prompt,
                                          **template_kwargs)
        return [int(i) for i in out["input_ids"]]

    def apply_chat_template_batch(self, conversations: Sequence[Sequence[dict]],
                                  add_generation_prompt: bool = True,
                                  **template_kwargs) -> List[List[int]]:
        """Transformers' batched form: each conversation rendered, then all tokenized in one
        call; the same ids as `apply_chat_template` of each."""
        if not self.has_chat_template or not conversations:
            return [self.apply_chat_template(m, add_generation_prompt, **template_kwargs)
                    for m in conversations]
        out = self.hf.apply_chat_template([list(m) for m in conversations], tokenize=True,
                                          return_dict=True,
                                          add_generation_prompt=add_generation_prompt,
                                          **template_kwargs)
        return [[int(i) for i in ids] for ids in out["input_ids"]]

    def save(self, directory: str) -> None:
        """Writes the tokenizer files into `directory` so transformers 4.x and 5.x both load
        them (tokenizer_class PreTrainedTokenizerFast, no 5.x-only keys)."""
        self.hf.save_pretrained(directory)
        make_tokenizer_config_portable(directory)

    def __repr__(self) -> str:
        return (f"HFTokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size}, "
                f"bos={self._bos}, stop_ids={self._stop_ids})")


def make_tokenizer_config_portable(directory: str) -> None:
    """transformers 5 writes tokenizer_class "TokenizersBackend" and `extra_special_tokens`,
    which 4.x (a vLLM environment may carry it) cannot load; rewrites them in place."""
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("tokenizer_class") in (None, "TokenizersBackend"):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if cfg.get("extra_special_tokens") in ([], {}):
        cfg.pop("extra_special_tokens")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
