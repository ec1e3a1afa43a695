"""Short arithmetic questions of graded difficulty for a real instruct model, in verl's schema.

Every question reads "What is a + b? Answer with just the number." (with -, * for the other
operations) and is answered by one number. Four kinds, from easy to hard for
SmolLM2-135M-Instruct (greedy, 24 new tokens, the answer read as the number after the first
"=", else the last number: 24/40, 15/40, 6/40 and 1/40 in a probe before this module; on the
first 48 test rows 8/12, 5/12, 3/12 and 0/12, docs/RESULTS.md section 3):

  add1   one-digit addition        a, b in 1..9
  mul1   one-digit multiplication  a, b in 2..9
  add2   two-digit addition        a, b in 10..99
  sub2   two-digit subtraction     a in 50..99, b in 10..49 (never negative)

Splits. Each kind's every (a, b) pair is one question; a seeded SHA-256 hash of the question
sends it to the test split when it falls below `test_fraction`, so the splits are disjoint and
fixed by the seed. The test split takes up to num_test / 4 held-out questions of each kind (the
one-digit kinds have only 81 and 64 questions, so fewer of them), in a seeded order, listed
kind by kind in turn (add1, mul1, add2, sub2, add1, ...): the first rows of the test file are a
balanced sample of every kind, which is what an evaluation of the first --eval_size rows reads.
Training rows cycle through the kinds, each a question drawn with replacement from its kind's
training questions, so the kinds are equally frequent whatever their sizes.

Rows: data_source "arith_qa/<kind>" (evaluation reports accuracy per data source), prompt the
user message, reward_model.ground_truth the answer, extra_info {kind, a, op, b, split, index}.
Scored by the "final_number" reward (sao_actor_learner/rewards/answers.py).
"""
from __future__ import annotations

import hashlib
import random
from typing import Dict, List, Tuple

INSTRUCTION = "Answer with just the number."
DATA_SOURCE = "arith_qa"
# kind -> (operation, a's range, b's range), easiest first.
KINDS: Dict[str, Tuple[str, range, range]] = {
    "add1": ("+", range(1, 10), range(1, 10)),
    "mul1": ("*", range(2, 10), range(2, 10)),
    "add2": ("+", range(10, 100), range(10, 100)),
    "sub2": ("-", range(50, 100), range(10, 50)),
}
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def question(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}? {INSTRUCTION}"


def _unit_hash(seed: int, text: str) -> float:
    digest = hashlib.sha256(f"{seed}:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / float(1 << 64)


def row(kind: str, a: int, b: int, split: str, index: int) -> dict:
    op = KINDS[kind][0]
    return {"data_source": f"{DATA_SOURCE}/{kind}", "ability": "math",
            "prompt": [{"role": "user", "content": question(a, op, b)}],
            "reward_model": {"style": "rule", "ground_truth": str(_APPLY[op](a, b))},
            "extra_info": {"kind": kind, "a": a, "op": op, "b": b, "split": split,
                           "index": index}}


def split_pairs(kind: str, seed: int, test_fraction: float
                ) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """(train, test) (a, b) pairs of `kind`; test in a seeded order."""
    op, a_range, b_range = KINDS[kind]
    train, test = [], []
    for a in a_range:
        for b in b_range:
            held_out = _unit_hash(seed, question(a, op, b)) < test_fraction
            (test if held_out else train).append((a, b))
    random.Random(f"{seed}:{kind}:test").shuffle(test)
    return train, test


def make_splits(seed: int = 0, num_train: int = 4000, num_test: int = 200,
                test_fraction: float = 0.25, kinds=tuple(KINDS)) -> Tuple[List[dict], List[dict]]:
    """(train rows, test rows) as the module docstring says."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"kinds={list(kinds)}: each must be one of {', '.join(KINDS)}")
    if not 0.0 < test_fraction < 1.0 or num_train < 1 or num_test < 1:
        raise ValueError(f"test_fraction={test_fraction}, num_train={num_train}, num_test="
                         f"{num_test}: need 0 < test_fraction < 1 and at least one row each")
    pairs = {k: split_pairs(k, seed, test_fraction) for k in kinds}
    per_kind = -(-num_test // len(kinds))
    held_out = {k: pairs[k][1][:per_kind] for k in kinds}
    test: List[dict] = []
    for i in range(per_kind):
        for k in kinds:
            if i < len(held_out[k]) and len(test) < num_test:
                test.append(row(k, *held_out[k][i], "test", len(test)))
    rng = random.Random(f"{seed}:train")
    train = []
    for i in range(num_train):
        kind = kinds[i % len(kinds)]
        a, b = rng.choice(pairs[kind][0])
        train.append(row(kind, a, b, "train", i))
    return train, test
