"""Calculator-tool task: multi-digit sums and products the tiny model cannot do in its head.

An episode, as the model sees it (one character per token; <bos>/<eos> are special tokens):

    <bos>4821+3967=          prompt
    [4821+3967]              action (turn 1): a tool call; the model's "]" ends the turn
    =8788\\n                  observation: the calculator's answer (action_mask 0)
    8788<eos>                action (turn 2): the final answer; reward 1.0 if it is right

A turn that does not start with "[" is the final answer: the text up to <eos> must equal the
decimal result (reward 1.0, else 0.0) and the episode ends. A tool-call turn gets an
observation and the episode continues; bad calls get error observations (tasks/tools.py:
malformed, raised, too_large, timeout), counted in `StepResult.info["counters"]`, never an
exception. The actor's turn limit (`max_turns`) ends an episode that keeps calling (truncated).

Problems: "sum" a+b with 3-4 digit operands; "product" a*b with a 2-digit and a 2-3 digit
operand. Pairs are split into training and held-out problems by a seeded hash, as in the
arithmetic task; `eval_prompts()` is a fixed sample of held-out problems, half of each kind.

The SFT teacher (`demonstration`) is imperfect on purpose:
  - it answers in its head instead of calling the tool with probability `guess_prob[kind]`
    (sums 0.7, products 0.2): a sum guessed in the head forgets its carries, a product guessed in
    the head rounds the second factor to tens; both are wrong on most problems;
  - with probability `slip_prob` it miscopies one digit of the tool's result into its answer;
  - with probability `typo_prob` its first call is broken (a dropped operand), it sees the error
    observation and calls again correctly.
A model trained on it guesses (wrongly) on most sums and uses the tool on most products, so
RL has a decision to learn: call the calculator on sums too, and copy its result exactly.
"""
from __future__ import annotations

import hashlib
import itertools
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from sao_actor_learner import core
from sao_actor_learner.models.tokenizer import CharTokenizer, decode_until_eos
from sao_actor_learner.tasks import tools
from sao_actor_learner.tasks.arithmetic import no_carry_sum
from sao_actor_learner.tasks.registry import TaskSpec

EVAL_ID_BASE = 1 << 40  # held-out prompt i has prompt_id EVAL_ID_BASE + i; training ids are below
_HASH_BUCKETS = 1000
KINDS = ("sum", "product")
DEFAULT_GUESS_PROB = {"sum": 0.7, "product": 0.2}


def head_guess(kind: str, a: int, b: int) -> int:
    """The teacher's in-the-head answer: a sum without carries, or a * (b rounded to tens)."""
    if kind == "sum":
        return no_carry_sum(a, b)
    return a * (int(round(b, -1)) or 10)


class CalculatorToolEnvironment(core.Environment):
    """One episode: tool-call turns get calculator observations, the first other turn is scored."""

    def __init__(self, task: "CalculatorToolTask", prompt: core.Prompt):
        self._task = task
        self._prompt = prompt
        self._rng = np.random.default_rng([task.seed, 3, prompt.prompt_id])  # tool latencies
        self._done = False
        self.calls = 0

    def step(self, action_tokens: Sequence[int]) -> core.StepResult:
        if self._done:
            raise RuntimeError(f"prompt {self._prompt.prompt_id}: the episode is over; make a "
                               "new environment per episode")
        tok = self._task.tokenizer
        ids = [int(t) for t in action_tokens]
        text = decode_until_eos(tok, ids)
        if not text.startswith(tools.TOOL_CALL_OPEN):
            self._done = True
            correct = text == self._prompt.answer
            return core.StepResult(observation_tokens=[], reward=1.0 if correct else 0.0,
                                   done=True, info={"answer_text": text, "correct": correct,
                                                    "counters": {"answers": 1,
                                                                 "answers_correct": int(correct)}})
        if tok.eos_id in ids:  # <eos> inside a call: the call never closed
            text = text + "<eos>"
        self.calls += 1
        call = self._task.tool_runner.run(text, self._rng)
        try:
            obs = tok.encode(call.observation, add_bos=False)
        except ValueError:  # the tool answered with characters the model cannot read
            call = tools.ToolCallResult(tools.error_observation("raised"), "raised",
                                        call.latency_s)
            obs = tok.encode(call.observation, add_bos=False)
        return core.StepResult(observation_tokens=obs, reward=0.0, done=False,
                               info={"tool_error": call.error, "tool_result": call.result,
                                     "counters": call.counters()})


class CalculatorToolTask(core.Task):
    """Sums and products to solve with a calculator tool; hash-split held-out set; SFT teacher.

    Args:
      seed: the split, the evaluation sample and the tool latencies depend on it.
      num_eval: held-out prompts (half sums, half products).
      tool_latency: a tools.parse_latency spec, drawn per call ("none" for tests and SFT).
      tool_timeout_s: calls slower than this fail with a timeout observation.
      max_result_chars: longer tool results fail with a too_large observation.
      guess_prob, slip_prob, typo_prob: the teacher's imperfections (module docstring).
      tool: the calculator function (tests swap in failing tools).
      prompt_id_offset, prompt_id_stride: disjoint prompt ids for several actors.
    """

    name = "calculator_tool"

    def __init__(self, seed: int = 0, num_eval: int = 200, tool_latency: str = "none",
                 tool_timeout_s: float = 1.0, max_result_chars: int = 12,
                 guess_prob: Optional[Dict[str, float]] = None, slip_prob: float = 0.1,
                 typo_prob: float = 0.1, eval_fraction: float = 0.1, tool=tools.calculator,
                 tokenizer: Optional[CharTokenizer] = None, prompt_id_offset: int = 0,
                 prompt_id_stride: int = 1, tool_sleep=None):
        guess_prob = dict(DEFAULT_GUESS_PROB if guess_prob is None else guess_prob)
        if set(guess_prob) != set(KINDS):
            raise ValueError(f"guess_prob={guess_prob}: needs exactly the kinds {KINDS}")
        for name, p in [*(("guess_prob[" + k + "]", v) for k, v in guess_prob.items()),
                        ("slip_prob", slip_prob), ("typo_prob", typo_prob)]:
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name}={p}: must be in [0, 1]")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={eval_fraction}: must be in (0, 1)")
        if num_eval < 2:
            raise ValueError(f"num_eval={num_eval}: must be >= 2 (half sums, half products)")
        if prompt_id_stride < 1 or prompt_id_offset < 0:
            raise ValueError(f"prompt_id_offset={prompt_id_offset}, prompt_id_stride="
                             f"{prompt_id_stride}: need offset >= 0 and stride >= 1")
        self.seed = seed
        self.guess_prob = guess_prob
        self.slip_prob = slip_prob
        self.typo_prob = typo_prob
        self.eval_fraction = eval_fraction
        self.tokenizer = tokenizer or CharTokenizer()
        kwargs = {} if tool_sleep is None else {"sleep": tool_sleep}
        self.tool_runner = tools.ToolRunner(tool, tools.parse_latency(tool_latency),
                                            timeout_s=tool_timeout_s,
                                            max_result_chars=max_result_chars, **kwargs)
        # The model's "]" ends a tool-call turn (run_episodes adds these to the stop tokens).
        close = self.tokenizer.encode(tools.TOOL_CALL_CLOSE, add_bos=False)
        if len(close) != 1:
            raise ValueError(f"the tokenizer encodes {tools.TOOL_CALL_CLOSE!r} as {close}; the "
                             "calculator task needs it to be one token (it ends a tool call)")
        self.turn_stop_token_ids = (close[0],)
        self._threshold = int(round(eval_fraction * _HASH_BUCKETS))
        self._ids = itertools.count(prompt_id_offset, prompt_id_stride)
        self._ids_lock = threading.Lock()
        rng = np.random.default_rng([seed, 7])
        self._eval: List[core.Prompt] = []
        seen = set()
        for i in range(num_eval):
            kind = KINDS[i % len(KINDS)]
            while True:
                a, b = self._draw(kind, rng)
                if self.is_held_out(kind, a, b) and (kind, a, b) not in seen:
                    break
            seen.add((kind, a, b))
            self._eval.append(self.make_prompt(kind, a, b, EVAL_ID_BASE + i))

    # Problems and the split ---------------------------------------------------------------------
    @staticmethod
    def _draw(kind: str, rng: np.random.Generator) -> Tuple[int, int]:
        if kind == "sum":
            lo_a, lo_b = (10 ** (int(d) - 1) for d in rng.integers(3, 5, size=2))
            return int(rng.integers(lo_a, 10 * lo_a)), int(rng.integers(lo_b, 10 * lo_b))
        lo_b = 10 ** (int(rng.integers(2, 4)) - 1)
        return int(rng.integers(10, 100)), int(rng.integers(lo_b, 10 * lo_b))

    def is_held_out(self, kind: str, a: int, b: int) -> bool:
        """Whether the problem belongs to the evaluation split (never sampled for training)."""
        digest = hashlib.blake2b(f"{self.seed}:{kind}:{a}:{b}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % _HASH_BUCKETS < self._threshold

    def sample_problem(self, rng: np.random.Generator) -> Tuple[str, int, int]:
        """A training problem (kind, a, b): kinds equally likely, held-out problems rejected."""
        kind = KINDS[int(rng.integers(len(KINDS)))]
        while True:
            a, b = self._draw(kind, rng)
            if not self.is_held_out(kind, a, b):
                return kind, a, b

    @staticmethod
    def expression(kind: str, a: int, b: int) -> str:
        return f"{a}+{b}" if kind == "sum" else f"{a}*{b}"

    @staticmethod
    def solve(kind: str, a: int, b: int) -> int:
        return a + b if kind == "sum" else a * b

    def make_prompt(self, kind: str, a: int, b: int, prompt_id: int) -> core.Prompt:
        """The prompt "EXPR=" (token ids start with <bos>); its answer is the result's digits."""
        text = self.expression(kind, a, b) + "="
        return core.Prompt(prompt_id=prompt_id, token_ids=tuple(self.tokenizer.encode(text)),
                           text=text, answer=str(self.solve(kind, a, b)))

    @staticmethod
    def kind_of(prompt: core.Prompt) -> str:
        return "product" if "*" in prompt.text else "sum"

    def _next_id(self) -> int:
        with self._ids_lock:
            return next(self._ids)

    # core.Task ------------------------------------------------------------------------------------
    def sample_prompt(self, rng: np.random.Generator) -> core.Prompt:
        return self.make_prompt(*self.sample_problem(rng), self._next_id())

    def eval_prompts(self) -> List[core.Prompt]:
        return list(self._eval)

    def make_environment(self, prompt: core.Prompt) -> core.Environment:
        return CalculatorToolEnvironment(self, prompt)

    def is_correct(self, prompt: core.Prompt, completion_tokens: Sequence[int]) -> bool:
        """A single-turn completion (no tool) is correct when it is the answer itself."""
        return decode_until_eos(self.tokenizer, completion_tokens) == prompt.answer

    def episode_success(self, rollout) -> bool:
        """Whether a multi-turn episode ended with the right answer (reward 1.0)."""
        return rollout.total_reward >= 1.0

    # Supervised warm start -------------------------------------------------------------------------
    def demonstration_turns(self, kind: str, a: int, b: int,
                            rng: np.random.Generator) -> List[Tuple[str, bool]]:
        """The teacher's episode after the prompt as (text, is_action) segments; "<eos>" marks
        the end of the final answer. Observations are the real tool's (no latency)."""
        expr = self.expression(kind, a, b)
        if rng.random() < self.guess_prob[kind]:
            return [(str(head_guess(kind, a, b)) + "<eos>", True)]
        segments: List[Tuple[str, bool]] = []
        if rng.random() < self.typo_prob:
            op = "+" if kind == "sum" else "*"
            bad = f"[{a}{op}]"                        # dropped operand: the calculator raises
            segments += [(bad, True), (self._demo_observation(bad), False)]
        call = f"[{expr}]"
        obs = self._demo_observation(call)
        segments += [(call, True), (obs, False)]
        answer = obs[1:-1]
        if rng.random() < self.slip_prob:
            i = int(rng.integers(len(answer)))
            digit = str((int(answer[i]) + int(rng.integers(1, 10))) % 10)
            answer = answer[:i] + digit + answer[i + 1:]
        segments.append((answer + "<eos>", True))
        return segments

    def _demo_observation(self, call_text: str) -> str:
        runner = tools.ToolRunner(self.tool_runner.tool, tools.parse_latency("none"),
                                  timeout_s=self.tool_runner.timeout_s,
                                  max_result_chars=self.tool_runner.max_result_chars)
        return runner.run(call_text, np.random.default_rng(0)).observation

    def demonstration(self, rng: np.random.Generator) -> Tuple[List[int], List[int]]:
        """(token ids, loss mask) of one demonstration: prompt (with <bos>) and observations
        have mask 0, the teacher's actions (with <eos>) mask 1."""
        kind, a, b = self.sample_problem(rng)
        ids = self.tokenizer.encode(self.expression(kind, a, b) + "=")
        mask = [0] * len(ids)
        for text, is_action in self.demonstration_turns(kind, a, b, rng):
            eos = text.endswith("<eos>")
            seg = self.tokenizer.encode(text[:-5] if eos else text, add_bos=False)
            if eos:
                seg.append(self.tokenizer.eos_id)
            ids += seg
            mask += [int(is_action)] * len(seg)
        return ids, mask


def build_task(config, actor_id: int = 0, tokenizer=None) -> CalculatorToolTask:
    """The calculator-tool task of `config` for actor `actor_id`, with its tool latency and
    timeout."""
    return CalculatorToolTask(seed=config.seed, num_eval=config.eval_size,
                              tool_latency=config.tool_latency,
                              tool_timeout_s=config.tool_timeout_s, prompt_id_offset=actor_id,
                              prompt_id_stride=config.num_actors)


def check_options(config, fail) -> None:
    try:
        tools.parse_latency(config.tool_latency)
    except ValueError as e:
        fail(f"tool_latency={config.tool_latency!r}: {e}")
    if not config.tool_timeout_s > 0:
        fail(f"tool_timeout_s={config.tool_timeout_s}: must be > 0 (seconds a tool call may take)")


TASK_SPEC = TaskSpec(
    name="calculator_tool",
    description="Multi-digit sums and products the tiny model cannot do in its head, with a "
                "calculator tool it may call (\"[a+b]\" -> an observation with the result) "
                "before answering: a multi-turn task with tool latency (--tool_latency) and "
                "timeouts (--tool_timeout_s), whose environment steps run on env_threads.",
    build=build_task, check=check_options, task_class=CalculatorToolTask,
    defaults=dict(init_checkpoint="checkpoints/warm_start_calculator_tool",
                  max_sequence_length=96, max_new_tokens=16, max_turns=4,
                  env_threads="actor_batch"))
