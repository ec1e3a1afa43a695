"""Integer addition, "37+45=" -> "82<eos>": the verifiable toy task.

Operands have `min_digits`..`max_digits` digits (no leading zeros; 1-digit operands include 0).
Operand pairs are split between training and evaluation by a seeded hash of the pair: a pair is
held out when `hash(seed, a, b) mod 1000 < 1000 * eval_fraction`. Training sampling rejects
held-out pairs, so it can never produce an evaluation problem; `eval_prompts()` is a fixed sample
of `num_eval` held-out pairs.

The episode is single-turn: the model's completion, decoded up to its first <eos>, must equal
the decimal sum exactly (reward 1.0, else 0.0). A completion with no <eos> is judged on all its
tokens (a truncated "82" still counts; "825" does not).

`demonstration(a, b, rng)` is the SFT teacher, imperfect on purpose: with probability
`carry_noise` it forgets every carry and writes each column's digit sum mod 10 (37+45 -> "72",
95+17 -> "2", from "02"), the classic schoolchild slip. Problems without carries (about a quarter
of the 2-digit pairs) are always right. A model trained on it answers carry problems correctly
only part of the time, so RL has a skill to sharpen: see programs/sft.py for the numbers.
"""
from __future__ import annotations

import hashlib
import itertools
import threading
from typing import List, Optional, Sequence, Tuple

import numpy as np

from sao_actor_learner import core
from sao_actor_learner.models.tokenizer import CharTokenizer, decode_until_eos
from sao_actor_learner.tasks.registry import TaskSpec

EVAL_ID_BASE = 1 << 40  # held-out prompt i has prompt_id EVAL_ID_BASE + i; training ids are below
_HASH_BUCKETS = 1000


def no_carry_sum(a: int, b: int) -> int:
    """a + b written column by column, each column's digit sum mod 10, carries forgotten (the
    carry out of the leftmost column too): 37+45 -> 72, 95+17 -> 2 (from "02"), 12+34 -> 46."""
    da, db = str(a)[::-1], str(b)[::-1]
    digits = []
    for i in range(max(len(da), len(db))):
        s = (int(da[i]) if i < len(da) else 0) + (int(db[i]) if i < len(db) else 0)
        digits.append(str(s % 10))
    return int("".join(reversed(digits)))


def has_carry(a: int, b: int) -> bool:
    """Whether some column of a + b sums to 10 or more (so no_carry_sum differs from a + b)."""
    return no_carry_sum(a, b) != a + b


class ArithmeticEnvironment(core.Environment):
    """One single-turn addition episode: scores the completion, then is done."""

    def __init__(self, task: "ArithmeticTask", prompt: core.Prompt):
        self._task = task
        self._prompt = prompt
        self._done = False

    def step(self, action_tokens: Sequence[int]) -> core.StepResult:
        if self._done:
            raise RuntimeError(f"prompt {self._prompt.prompt_id}: the episode is over (addition is "
                               "single-turn); make a new environment per episode")
        self._done = True
        completion = self._task.completion_text(action_tokens)
        correct = completion == self._prompt.answer
        return core.StepResult(observation_tokens=[], reward=1.0 if correct else 0.0, done=True,
                               info={"completion": completion, "answer": self._prompt.answer,
                                     "correct": correct})


class ArithmeticTask(core.Task):
    """Addition prompts "a+b=" with answer str(a+b), a hash-split held-out set, and an SFT teacher.

    Several actors sharing a seed get distinct prompt ids with `prompt_id_offset=i` and
    `prompt_id_stride=num_actors` (ids offset, offset+stride, ...).
    """

    name = "arithmetic"

    def __init__(self, seed: int = 0, num_eval: int = 200, min_digits: int = 2,
                 max_digits: int = 2, eval_fraction: float = 0.1, carry_noise: float = 0.6,
                 tokenizer: Optional[CharTokenizer] = None, prompt_id_offset: int = 0,
                 prompt_id_stride: int = 1):
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"min_digits={min_digits}, max_digits={max_digits}: need "
                             "1 <= min_digits <= max_digits")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={eval_fraction}: must be in (0, 1)")
        if not 0.0 <= carry_noise <= 1.0:
            raise ValueError(f"carry_noise={carry_noise}: must be in [0, 1] (the probability that "
                             "a demonstration forgets its carries)")
        if num_eval < 1:
            raise ValueError(f"num_eval={num_eval}: must be >= 1")
        if prompt_id_stride < 1 or prompt_id_offset < 0:
            raise ValueError(f"prompt_id_offset={prompt_id_offset}, prompt_id_stride="
                             f"{prompt_id_stride}: need offset >= 0 and stride >= 1")
        self.seed = seed
        self.min_digits, self.max_digits = min_digits, max_digits
        self.eval_fraction = eval_fraction
        self.carry_noise = carry_noise
        self.tokenizer = tokenizer or CharTokenizer()
        self._lo = 0 if min_digits == 1 else 10 ** (min_digits - 1)
        self._hi = 10 ** max_digits - 1
        self._threshold = int(round(eval_fraction * _HASH_BUCKETS))
        self._ids = itertools.count(prompt_id_offset, prompt_id_stride)
        self._ids_lock = threading.Lock()

        held_out = self._held_out_pool()
        if len(held_out) < num_eval:
            raise ValueError(
                f"num_eval={num_eval} but only {len(held_out)} operand pairs are held out "
                f"({min_digits}-{max_digits} digits, eval_fraction={eval_fraction}): lower "
                "num_eval or raise eval_fraction / max_digits")
        pick = np.random.default_rng([seed, 7]).choice(len(held_out), size=num_eval, replace=False)
        self._eval = [self.make_prompt(a, b, EVAL_ID_BASE + i)
                      for i, (a, b) in enumerate(held_out[j] for j in sorted(pick))]

    # The split ---------------------------------------------------------------------------------
    def is_held_out(self, a: int, b: int) -> bool:
        """Whether the pair (a, b) belongs to the evaluation split (never sampled for training)."""
        digest = hashlib.blake2b(f"{self.seed}:{a}:{b}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % _HASH_BUCKETS < self._threshold

    def _operand_count(self) -> int:
        return self._hi - self._lo + 1

    def _held_out_pool(self) -> List[Tuple[int, int]]:
        n = self._operand_count()
        if n * n > 2_000_000:  # too many pairs to enumerate: sample candidates instead
            rng = np.random.default_rng([self.seed, 11])
            pool = set()
            while len(pool) < 20_000:
                a, b = (int(x) for x in rng.integers(self._lo, self._hi + 1, size=2))
                if self.is_held_out(a, b):
                    pool.add((a, b))
            return sorted(pool)
        return [(a, b) for a in range(self._lo, self._hi + 1) for b in range(self._lo, self._hi + 1)
                if self.is_held_out(a, b)]

    # Prompts -----------------------------------------------------------------------------------
    def make_prompt(self, a: int, b: int, prompt_id: int) -> core.Prompt:
        """The prompt "a+b=" (token ids start with <bos>); its answer is str(a + b)."""
        text = f"{a}+{b}="
        return core.Prompt(prompt_id=prompt_id, token_ids=tuple(self.tokenizer.encode(text)),
                           text=text, answer=str(a + b))

    def sample_operands(self, rng: np.random.Generator) -> Tuple[int, int]:
        """A training pair (a, b): uniform over operands, held-out pairs rejected."""
        while True:
            a, b = (int(x) for x in rng.integers(self._lo, self._hi + 1, size=2))
            if not self.is_held_out(a, b):
                return a, b

    def _next_id(self) -> int:
        with self._ids_lock:
            return next(self._ids)

    def sample_prompt(self, rng: np.random.Generator) -> core.Prompt:
        a, b = self.sample_operands(rng)
        return self.make_prompt(a, b, self._next_id())

    def eval_prompts(self) -> List[core.Prompt]:
        return list(self._eval)

    # Episodes and scoring -------------------------------------------------------------------------
    def make_environment(self, prompt: core.Prompt) -> core.Environment:
        return ArithmeticEnvironment(self, prompt)

    def completion_text(self, completion_tokens: Sequence[int]) -> Optional[str]:
        """The completion up to EOS, or None when it holds ids outside the vocabulary (a broken
        engine's output scores 0 here; the replay writer then rejects the rollout)."""
        try:
            return decode_until_eos(self.tokenizer, completion_tokens)
        except ValueError:
            return None

    def is_correct(self, prompt: core.Prompt, completion_tokens: Sequence[int]) -> bool:
        return self.completion_text(completion_tokens) == prompt.answer

    # Supervised warm start ------------------------------------------------------------------------
    def demonstration(self, a: int, b: int, rng: np.random.Generator) -> str:
        """The teacher's answer text for a+b (no <eos>): right, except that with probability
        `carry_noise` it forgets the carries (only visible on problems that have carries)."""
        if rng.random() < self.carry_noise:
            return str(no_carry_sum(a, b))
        return str(a + b)

    def demonstration_tokens(self, a: int, b: int,
                             rng: np.random.Generator) -> Tuple[List[int], List[int]]:
        """(prompt ids with <bos>, answer ids ending in <eos>) of one demonstration."""
        prompt = self.tokenizer.encode(f"{a}+{b}=")
        answer = self.tokenizer.encode(self.demonstration(a, b, rng), add_bos=False)
        return prompt, answer + [self.tokenizer.eos_id]


# What a config left at 0 / "" gets with this task (and online_shift, which shares its model).
ARITHMETIC_DEFAULTS = dict(init_checkpoint="checkpoints/warm_start", max_sequence_length=64,
                           max_new_tokens=8, max_turns=1, env_threads=1)


def build_task(config, actor_id: int = 0, tokenizer=None) -> ArithmeticTask:
    """The arithmetic task of `config` for actor `actor_id` (the character tokenizer)."""
    return ArithmeticTask(seed=config.seed, num_eval=config.eval_size, prompt_id_offset=actor_id,
                          prompt_id_stride=config.num_actors)


TASK_SPEC = TaskSpec(
    name="arithmetic",
    description="Two-digit addition, \"37+45=\" -> \"82\", one turn, reward 1 for the exact sum. "
                "The toy task of the reproduction: a character-level model warm-started on an "
                "imperfect teacher that forgets carries, so RL has a skill to sharpen.",
    build=build_task, defaults=ARITHMETIC_DEFAULTS, task_class=ArithmeticTask)
