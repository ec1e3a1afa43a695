"""Deterministic GSM8K-style word problems, their correct solutions and flawed demonstrations.

A problem is a short story about one person's items: it starts from a count ("Tom has 12
apples.") or from a product ("Tom has 3 bags of apples. Each of them holds 4 apples."), then
gets, gives away, loses, sells or eats items in one or two more sentences, and asks how many
the person has now. Every problem takes 2 or 3 arithmetic steps with +, - and a single-digit *,
on small numbers (8 templates, 30 names, 20 objects), and no count is negative. Its solution
restates the start, spells out one "a op b = c" equation per step in a short sentence, and
ends with a line "#### <answer>", as GSM8K solutions do.

Splits: `make_splits(seed, num_train, num_test)` draws problems from a stream seeded by `seed`,
drops repeated questions, and sends each question to the test split when a seeded SHA-256 hash
of its text falls below num_test / (num_train + num_test); the splits are therefore disjoint
and the same arguments always give the same lists.

Demonstrations for supervised warm starts are imperfect on purpose, with one systematic flaw
whose trigger is visible in the question:
  add_for_give      (the default) the demonstrator confuses giving with getting: at every step
                    where the person gives items away ("He gives 4 apples to Mia.", "She gives
                    away 3.", "He gives Mia 5 of them.") it adds instead of subtracting. The
                    sentence is otherwise the same and its arithmetic is right for "+", so the
                    later counts and the final answer are those of the wrong operation. Items
                    lost, sold or eaten are always subtracted, so subtraction itself is learned;
  add_for_subtract  the same at every subtraction;
  none              the demonstration is the correct solution.
Whether a problem's demonstration is flawed is decided by a seeded hash of its question, with
probability `rate`, so it does not depend on the order in which problems are drawn. Problems
without the trigger always get the correct solution.
"""
from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from typing import Iterator, List, Sequence, Tuple

NAMES = (  # (name, subject pronoun, object pronoun)
    ("Tom", "he", "him"), ("Mia", "she", "her"), ("Sam", "he", "him"), ("Lily", "she", "her"),
    ("Ben", "he", "him"), ("Emma", "she", "her"), ("Jack", "he", "him"), ("Zoe", "she", "her"),
    ("Leo", "he", "him"), ("Ava", "she", "her"), ("Max", "he", "him"), ("Ella", "she", "her"),
    ("Noah", "he", "him"), ("Ruby", "she", "her"), ("Owen", "he", "him"), ("Nora", "she", "her"),
    ("Luke", "he", "him"), ("Ivy", "she", "her"), ("Eli", "he", "him"), ("Anna", "she", "her"),
    ("Finn", "he", "him"), ("Grace", "she", "her"), ("Omar", "he", "him"), ("Lucy", "she", "her"),
    ("Ravi", "he", "him"), ("Sara", "she", "her"), ("Hugo", "he", "him"), ("Maya", "she", "her"),
    ("Dan", "he", "him"), ("Rosa", "she", "her"),
)
OBJECTS = (  # (plural, container, edible)
    ("apples", "bags", True), ("marbles", "jars", False), ("stickers", "sheets", False),
    ("cookies", "boxes", True), ("pencils", "boxes", False), ("books", "shelves", False),
    ("cards", "packs", False), ("shells", "buckets", False), ("stamps", "albums", False),
    ("coins", "purses", False), ("candies", "bags", True), ("balloons", "packs", False),
    ("flowers", "vases", False), ("toys", "boxes", False), ("eggs", "cartons", True),
    ("oranges", "crates", True), ("crayons", "boxes", False), ("beads", "jars", False),
    ("muffins", "trays", True), ("plums", "baskets", True),
)
# Templates: the start ("has" a count, or "mul": containers times items) and the later steps
# ("add" or "remove"); a removal is a "give" step with probability GIVE_PROB, else a "take"
# step (lost, sold or eaten).
TEMPLATES = (
    ("has", "add", "add"), ("has", "add", "remove"), ("has", "remove", "add"),
    ("has", "remove", "remove"), ("mul", "add"), ("mul", "remove"), ("mul", "add", "remove"),
    ("mul", "remove", "add"),
)
GIVE_PROB = 0.7
# (question sentence, solution clause); {b} is the step's number, {o} the other person.
ADD_PHRASES = (
    ("{He} buys {b} more.", "{He} buys {b} more"),
    ("{He} finds {b} more {obj}.", "{He} finds {b} more"),
    ("{O} gives {him} {b} {obj}.", "{O} gives {him} {b}"),
    ("{He} gets {b} more from {o}.", "{He} gets {b} more"),
)
GIVE_PHRASES = (
    ("{He} gives {b} {obj} to {o}.", "{He} gives {b} to {o}"),
    ("{He} gives away {b}.", "{He} gives away {b}"),
    ("{He} gives {o} {b} of them.", "{He} gives {o} {b}"),
)
TAKE_PHRASES = (
    ("{He} loses {b} of them.", "{He} loses {b}"),
    ("{He} sells {b} of them.", "{He} sells {b}"),
)
EAT_PHRASE = ("{He} eats {b} of them.", "{He} eats {b}")
FLAWS = ("add_for_give", "add_for_subtract", "none")
# Appended to each question in the user message, as verl's GSM8K preprocessing does.
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


@dataclasses.dataclass(frozen=True)
class Step:
    """One arithmetic step: `left op right = result` with op in "+-*"; `kind` is "mul", "add",
    "give" (items given away) or "take" (lost, sold, eaten); `clause` starts its sentence."""
    kind: str
    left: int
    op: str
    right: int
    result: int
    clause: str


@dataclasses.dataclass(frozen=True)
class Problem:
    """A word problem: the question text, its steps and answer, and what rendering needs."""
    question: str
    opening: str            # first solution sentence ("Tom has 12 apples."), "" for a mul start
    steps: Tuple[Step, ...]
    answer: int
    obj: str
    subject: str            # "he" / "she"
    template: int

    @property
    def gives(self) -> bool:
        """Whether the person gives items away (the trigger of the add_for_give flaw)."""
        return any(s.kind == "give" for s in self.steps)

    @property
    def messages(self) -> List[dict]:
        """The chat prompt: one user message, the question followed by INSTRUCTION."""
        return [{"role": "user", "content": f"{self.question} {INSTRUCTION}"}]

    @property
    def solution(self) -> str:
        """The correct solution text, ending in "#### <answer>"."""
        return render(self, self.steps, self.answer)


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def render(problem: Problem, steps: Sequence[Step], answer: int) -> str:
    """The solution text for `steps` (the problem's own or altered ones) ending in `#### answer`."""
    lines = [problem.opening] if problem.opening else []
    lines += [f"{s.clause}, so {problem.subject} has {s.left} {s.op} {s.right} = {s.result} "
              f"{problem.obj}." for s in steps]
    return "\n".join(lines + [f"#### {answer}"])


def sample_problem(rng: random.Random, max_start: int = 20, max_change: int = 9,
                   give_prob: float = GIVE_PROB) -> Problem:
    """One random problem: starts 5..max_start, changes 2..max_change, products of 2..5
    containers with 2..9 items each; a removal is a give step with probability give_prob and
    leaves at least 2 items when it can (never fewer than 0)."""
    t = rng.randrange(len(TEMPLATES))
    name, he, him = rng.choice(NAMES)
    other = rng.choice([n for n in NAMES if n[0] != name])[0]
    obj, container, edible = rng.choice(OBJECTS)
    fmt = dict(He=_cap(he), he=he, him=him, o=other, O=other, obj=obj)
    sentences, steps, opening = [], [], ""
    for i, kind in enumerate(TEMPLATES[t]):
        if kind == "has":
            total = rng.randint(5, max_start)
            opening = f"{name} has {total} {obj}."
            sentences.append(opening)
        elif kind == "mul":
            k, m = rng.randint(2, 5), rng.randint(2, 9)
            total = k * m
            sentences.append(f"{name} has {k} {container} of {obj}. Each of them holds {m} {obj}.")
            steps.append(Step("mul", k, "*", m, total, f"{name} has {k} {container} with {m} each"))
        else:
            if kind == "add":
                b, phrase = rng.randint(2, max_change), rng.choice(ADD_PHRASES)
            else:
                b = rng.randint(2, max(2, min(max_change, total - 2)))
                if rng.random() < give_prob:
                    kind, phrase = "give", rng.choice(GIVE_PHRASES)
                else:
                    kind = "take"
                    phrase = rng.choice(TAKE_PHRASES + ((EAT_PHRASE,) if edible else ()))
            question, clause = (p.format(b=b, **fmt) for p in phrase)
            if i > 1 and question.startswith(fmt["He"] + " "):
                question = "Then " + he + question[len(he):]
            sentences.append(question)
            op = "+" if kind == "add" else "-"
            steps.append(Step(kind, total, op, b, _apply(op, total, b), clause))
            total = steps[-1].result
    sentences.append(f"How many {obj} does {name} have now?")
    return Problem(" ".join(sentences), opening, tuple(steps), total, obj, he, t)


def _unit_hash(*parts) -> float:
    """A uniform number in [0, 1) from a SHA-256 hash of the parts."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def iter_problems(seed: int, **kwargs) -> Iterator[Problem]:
    rng = random.Random(seed)
    while True:
        yield sample_problem(rng, **kwargs)


def make_splits(seed: int, num_train: int, num_test: int, **kwargs
                ) -> Tuple[List[Problem], List[Problem]]:
    """(train, test) lists of distinct questions; the split is a seeded hash of the question."""
    test_fraction = num_test / float(num_train + num_test)
    train, test, seen = [], [], set()
    for p in iter_problems(seed, **kwargs):
        if len(train) >= num_train and len(test) >= num_test:
            break
        if p.question in seen:
            continue
        seen.add(p.question)
        split = test if _unit_hash("split", seed, p.question) < test_fraction else train
        if len(split) < (num_test if split is test else num_train):
            split.append(p)
    return train, test


def triggers(step: Step, flaw: str) -> bool:
    """Whether `step` is one that `flaw` gets wrong."""
    return step.kind == "give" if flaw == "add_for_give" else (
        flaw == "add_for_subtract" and step.op == "-")


def is_flawed(problem: Problem, flaw: str, rate: float, seed: int = 0) -> bool:
    """Whether `problem`'s demonstration carries the flaw (only problems with its trigger can)."""
    if flaw not in FLAWS:
        raise ValueError(f"unknown flaw {flaw!r}; one of {FLAWS}")
    return (any(triggers(s, flaw) for s in problem.steps)
            and _unit_hash("flaw", seed, problem.question) < rate)


def demonstration(problem: Problem, flaw: str = "add_for_give", rate: float = 0.6,
                  seed: int = 0) -> str:
    """The SFT demonstration of `problem`: its solution, or with probability `rate` (on problems
    with the flaw's trigger) the flawed one described in the module docstring."""
    if not is_flawed(problem, flaw, rate, seed):
        return problem.solution
    steps, total = [], None
    for s in problem.steps:
        left = s.left if total is None else total
        op = "+" if triggers(s, flaw) else s.op
        total = _apply(op, left, s.right)
        steps.append(dataclasses.replace(s, left=left, op=op, result=total))
    return render(problem, steps, total)


def parse_equations(text: str) -> List[Tuple[int, str, int, int]]:
    """The "a op b = c" equations of a solution text, in order."""
    return [(int(a), op, int(b), int(c))
            for a, op, b, c in re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", text)]
