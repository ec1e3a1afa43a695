"""A character-level tokenizer for the toy tasks, and its Hugging Face twin.

`CharTokenizer` maps every character of a fixed alphabet to one id. Ids 0, 1, 2 are the special
tokens <pad>, <bos>, <eos>; the characters follow in `DEFAULT_ALPHABET` order. There is no
<unk>: text with a character outside the alphabet is an error, not a silent token.

`to_hf()` builds a `transformers.PreTrainedTokenizerFast` (a `tokenizers` WordLevel model over
single characters) whose ids equal ours, so a checkpoint folder loads in vLLM / `AutoTokenizer`.
Its `tokenizer("37+45=")` adds <bos> like `encode(add_bos=True)`.

Special-token strings are never produced by `encode`: "<eos>" in text is five characters here.
The Hugging Face tokenizer does match "<eos>" in text as the special token, so ids differ for
such text; feed token ids (as this project does), not text that spells special tokens.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from sao_actor_learner import core

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
DEFAULT_ALPHABET = (
    "0123456789"
    "+-*= "
    "abcdefghijklmnopqrstuvwxyz"
    "()[]<>/,:\n?"
)
_FILE_NAME = "char_tokenizer.json"


class CharTokenizer(core.Tokenizer):
    """One id per character of `alphabet`, after <pad>=0, <bos>=1, <eos>=2 (a core.Tokenizer)."""

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            dupes = sorted({c for c in alphabet if alphabet.count(c) > 1})
            raise ValueError(f"alphabet has duplicate characters {dupes!r}: each needs one id")
        self.alphabet = alphabet
        self._id_to_token: List[str] = list(SPECIAL_TOKENS) + list(alphabet)
        self._token_to_id: Dict[str, int] = {t: i for i, t in enumerate(self._id_to_token)}

    # Ids ---------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._id_to_token)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> Optional[int]:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    @property
    def stop_ids(self) -> Tuple[int, ...]:
        return (self.eos_id,)

    @property
    def special_ids(self) -> frozenset:
        return frozenset((self.pad_id, self.bos_id, self.eos_id))

    def token_id(self, char: str) -> int:
        """The id of one character (or of a special-token name such as "<eos>")."""
        try:
            return self._token_to_id[char]
        except KeyError:
            raise ValueError(
                f"{char!r} is not in the tokenizer's vocabulary; alphabet is "
                f"{self.alphabet!r}: add it to the alphabet (and retrain the model)") from None

    def vocab(self) -> Dict[str, int]:
        """Token string -> id, special tokens included."""
        return dict(self._token_to_id)

    # Encode / decode ---------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = True) -> List[int]:
        """Character ids of `text`, preceded by <bos> when `add_bos`."""
        ids = [self.bos_id] if add_bos else []
        table = self._token_to_id
        for i, ch in enumerate(text):
            tid = table.get(ch)
            if tid is None or tid < len(SPECIAL_TOKENS):
                raise ValueError(
                    f"character {ch!r} at position {i} of {text!r} is not in the tokenizer's "
                    f"alphabet {self.alphabet!r}: change the text or extend the alphabet")
            ids.append(tid)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """The text of `ids`; special tokens are dropped when `skip_special`, else spelled out."""
        out = []
        n = self.vocab_size
        for tid in ids:
            tid = int(tid)
            if not 0 <= tid < n:
                raise ValueError(f"token id {tid} is out of range for vocab_size={n}")
            if tid < len(SPECIAL_TOKENS):
                if skip_special:
                    continue
            out.append(self._id_to_token[tid])
        return "".join(out)

    # Persistence -------------------------------------------------------------------------------
    def save(self, directory: str) -> str:
        """Writes `char_tokenizer.json` into `directory` (created if needed); returns its path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, _FILE_NAME)
        with open(path, "w") as f:
            json.dump({"type": "CharTokenizer", "special_tokens": list(SPECIAL_TOKENS),
                       "alphabet": self.alphabet}, f, indent=1)
        return path

    @classmethod
    def load(cls, directory: str) -> "CharTokenizer":
        """Reads the tokenizer that `save(directory)` wrote."""
        path = os.path.join(directory, _FILE_NAME)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"no {_FILE_NAME} in {directory!r}: not a folder written by CharTokenizer.save / "
                "save_checkpoint")
        with open(path) as f:
            data = json.load(f)
        if tuple(data.get("special_tokens", ())) != SPECIAL_TOKENS:
            raise ValueError(f"{path}: special tokens {data.get('special_tokens')} differ from "
                             f"{list(SPECIAL_TOKENS)} this code expects")
        return cls(alphabet=data["alphabet"])

    # Hugging Face ------------------------------------------------------------------------------
    def to_hf(self):
        """A `transformers.PreTrainedTokenizerFast` with the same ids (char-level WordLevel)."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel(vocab=self.vocab(), unk_token=None))
        # Every character (newline included) is its own pre-token; WordLevel maps it to its id.
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()  # join characters with no separator
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, self.bos_id)])
        tok.add_special_tokens(list(SPECIAL_TOKENS))
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
            padding_side="left", clean_up_tokenization_spaces=False,
            model_max_length=1 << 30)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def decode_until_eos(tokenizer: core.Tokenizer, ids: Sequence[int]) -> str:
    """The text of `ids` up to (not including) the first stop id, special tokens dropped
    (`tokenizer.decode_response`)."""
    return tokenizer.decode_response(ids)
