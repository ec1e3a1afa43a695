"""A small Qwen-style byte-level BPE tokenizer, trained offline and deterministically.

`train_tokenizer(vocab_size, seed)` trains a `tokenizers` BPE model with Qwen2's split regex
(digits one per token, so numbers are spelled digit by digit as in Qwen), a ByteLevel
pre-tokenizer and decoder, all 256 byte symbols in the base vocabulary, and the special tokens
<|endoftext|> (padding), <|im_start|> and <|im_end|> (end of a turn, the eos). The corpus is
`corpus(seed)`: generated word problems with their solutions and demonstrations, plus the
docstrings of a fixed, sorted list of standard-library modules (stdlib_docs.py: the same
text for the same Python minor version, whatever the caller imported), so the merges cover
ordinary English and code, not only the templates.

The result is a `transformers.PreTrainedTokenizerFast` with eos <|im_end|>, pad <|endoftext|>,
no BOS, and a Qwen-style chat template: each message renders as
"<|im_start|>{role}\n{content}<|im_end|>\n" (a system message is rendered like any other and is
optional), and add_generation_prompt appends "<|im_start|>assistant\n"; an `enable_thinking`
variable is accepted and ignored. `save_tokenizer` writes it so that
`AutoTokenizer.from_pretrained(dir)` reloads it under transformers 4.x and 5.x alike.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import List

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from experiments.workloads import word_problems

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenization regex: letters with an optional leading non-letter, single digits,
# punctuation runs, newlines and spaces.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{#- Qwen-style chat template; enable_thinking is accepted and ignored. -#}\n"
    "{%- for message in messages -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif -%}\n")


def docstrings() -> List[str]:
    """The docstrings of stdlib_docs.DOC_MODULES, collected by a fresh isolated interpreter
    (stdlib_docs.py says why), so the same Python minor version always gives the same text."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stdlib_docs.py")
    out = subprocess.run([sys.executable, "-I", "-S", script], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def corpus(seed: int = 0, num_problems: int = 2000) -> List[str]:
    """The training text: problems (question, solution, a flawed demonstration) and docstrings."""
    texts = []
    for i, p in zip(range(num_problems), word_problems.iter_problems(seed + 1000)):
        texts += [p.question, p.solution, word_problems.demonstration(p, rate=1.0)]
    texts += ["user\nassistant\nsystem\nYou are a helpful assistant. Let's think step by step "
              "and output the final answer after \"####\"."] * 100
    return texts + list(docstrings())


def train_tokenizer(vocab_size: int = 3000, seed: int = 0):
    """The trained tokenizer wrapped in a PreTrainedTokenizerFast (see the module docstring)."""
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def save_tokenizer(tokenizer, out_dir: str) -> None:
    """save_pretrained, then make tokenizer_config.json loadable by transformers 4.x too."""
    tokenizer.save_pretrained(out_dir)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("extra_special_tokens", None)
    config.setdefault("chat_template", tokenizer.chat_template)
    config["bos_token"] = None
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")
