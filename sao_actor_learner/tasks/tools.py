"""Tools an agent calls from its own text, the calculator tool, latency, and how calls go wrong.

A tool call is a whole model turn of the form "[ARGUMENT]": the turn starts with "[" and the
model's "]" ends it (a task lists "]" in its `turn_stop_token_ids`, so the engine stops there).
`ToolRunner.run(turn_text, rng)` waits out a sampled latency, runs the tool and returns a
`ToolCallResult` whose `observation` is the text the model sees next:

    "=RESULT\\n"            the tool's answer
    "=error:REASON\\n"      one of ERROR_REASONS; `error` names the counter it is counted under

Nothing a model writes can crash the caller. The four ways a call fails, each an observation:

    malformed   the turn is not "[ARGUMENT]" (no closing "]", empty argument, a stray bracket)
    raised      the tool raised (the calculator raises `ToolInputError` on a bad expression)
    too_large   the result is longer than `max_result_chars`
    timeout     the sampled latency (or the tool's own run time) passed `timeout_s`

Latency distributions (`parse_latency("lognormal:0.02,1.0")`), in seconds:

    none                   no delay
    constant:S             always S
    uniform:LO,HI          uniform on [LO, HI]
    exponential:MEAN       exponential with mean MEAN
    lognormal:MEDIAN,SIGMA exp(N(log MEDIAN, SIGMA^2)): a long right tail
    pareto:SCALE,ALPHA     SCALE * (1 + Lomax(ALPHA)), i.e. Pareto with minimum SCALE and tail
                           index ALPHA: heavy-tailed (infinite variance for ALPHA <= 2)

The latency distributions live in `sao_actor_learner.latency` (shared with config validation);
they are re-exported here.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Optional, Tuple

import numpy as np

from sao_actor_learner.latency import (LATENCY_FORMS, LatencyDistribution,  # noqa: F401
                                     parse_latency)

TOOL_CALL_OPEN = "["
TOOL_CALL_CLOSE = "]"
ERROR_REASONS = {
    "malformed": "malformed call",
    "raised": "tool failed",
    "too_large": "result too large",
    "timeout": "timeout",
}
COUNTER_NAMES = ("tool_calls", "tool_ok", "tool_errors_malformed", "tool_errors_raised",
                 "tool_errors_too_large", "tool_errors_timeout")


class ToolInputError(ValueError):
    """A tool refuses its argument (the calculator: not an integer expression it can evaluate)."""


class MalformedToolCall(ValueError):
    """A turn that starts a tool call but is not of the form "[ARGUMENT]"."""


# --- the calculator ---------------------------------------------------------------------------------
_CALC_CHARS = frozenset("0123456789+-*")
MAX_OPERAND_DIGITS = 30  # longer numbers are refused: no giant big-int products from a typo


def calculator(expression: str) -> str:
    """Evaluates an integer expression of +, - and * with the usual precedence; returns digits.

    Grammar: expr := term (('+' | '-') term)*;  term := factor ('*' factor)*;
    factor := '-'? NUMBER. No spaces, no parentheses. Raises ToolInputError on anything else
    ("12**3", "7+", "", "1a").
    """
    if not expression:
        raise ToolInputError("empty expression")
    bad = sorted(set(expression) - _CALC_CHARS)
    if bad:
        raise ToolInputError(f"characters {bad!r} are not part of an integer expression")
    pos = 0

    def number() -> int:
        nonlocal pos
        sign = 1
        if pos < len(expression) and expression[pos] == "-":
            sign, pos = -1, pos + 1
        start = pos
        while pos < len(expression) and expression[pos].isdigit():
            pos += 1
        if pos == start:
            raise ToolInputError(f"expected a number at position {start} of {expression!r}")
        if pos - start > MAX_OPERAND_DIGITS:
            raise ToolInputError(f"a number of {pos - start} digits (at most {MAX_OPERAND_DIGITS})")
        return sign * int(expression[start:pos])

    def term() -> int:
        nonlocal pos
        value = number()
        while pos < len(expression) and expression[pos] == "*":
            pos += 1
            value *= number()
        return value

    value = term()
    while pos < len(expression):
        op = expression[pos]
        if op not in "+-":
            raise ToolInputError(f"unexpected {op!r} at position {pos} of {expression!r}")
        pos += 1
        rhs = term()
        value = value + rhs if op == "+" else value - rhs
    return str(value)


# --- running a call ---------------------------------------------------------------------------------
def parse_tool_call(turn_text: str) -> Optional[str]:
    """The argument of a tool-call turn "[ARGUMENT]"; None when the turn is not a tool call (it
    does not start with "["). Raises MalformedToolCall for a turn that starts a call but is not
    exactly "[ARGUMENT]" with a non-empty argument free of brackets."""
    if not turn_text.startswith(TOOL_CALL_OPEN):
        return None
    if not turn_text.endswith(TOOL_CALL_CLOSE) or len(turn_text) < 2:
        raise MalformedToolCall(f"{turn_text!r} does not end with {TOOL_CALL_CLOSE!r}")
    argument = turn_text[1:-1]
    if not argument:
        raise MalformedToolCall("empty argument")
    if TOOL_CALL_OPEN in argument or TOOL_CALL_CLOSE in argument:
        raise MalformedToolCall(f"{turn_text!r} has a bracket inside its argument")
    return argument


class _Timeout(Exception):
    pass


def call_with_timeout(fn: Callable[[str], str], argument: str, timeout_s: float) -> str:
    """fn(argument), run in a daemon thread; raises _Timeout if it has not returned in timeout_s.

    A tool that hangs is abandoned (its daemon thread cannot be killed, but cannot block exit).
    Exceptions from fn propagate.
    """
    if timeout_s <= 0:
        raise _Timeout()
    box: dict = {}
    done = threading.Event()

    def target():
        try:
            box["value"] = fn(argument)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, name="tool-call", daemon=True).start()
    if not done.wait(timeout_s):
        raise _Timeout()
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclasses.dataclass
class ToolCallResult:
    """What a tool call produced: the observation text, the error counter (None if it worked),
    the delay waited and the tool's raw result (None on error)."""
    observation: str
    error: Optional[str]
    latency_s: float
    result: Optional[str] = None

    def counters(self) -> dict:
        """Counter increments for this call (names in COUNTER_NAMES, plus tool_latency_s)."""
        out = {"tool_calls": 1, "tool_latency_s": self.latency_s}
        out["tool_ok" if self.error is None else f"tool_errors_{self.error}"] = 1
        return out


def error_observation(error: str) -> str:
    return f"=error:{ERROR_REASONS[error]}\n"


class ToolRunner:
    """Runs tool-call turns against one tool with latency, a timeout and a result-size limit.

    Args:
      tool: str -> str; may raise (any exception becomes a "raised" error observation).
      latency: the delay drawn before each call; a delay beyond timeout_s is cut at timeout_s
        and the call fails with "timeout" (the tool is not run).
      timeout_s: the most a call may take, delay plus the tool's own run time.
      max_result_chars: results longer than this fail with "too_large".
      sleep: how to wait out a delay (tests pass a fake).
    """

    def __init__(self, tool: Callable[[str], str], latency: LatencyDistribution,
                 timeout_s: float = 1.0, max_result_chars: int = 12,
                 sleep: Callable[[float], None] = time.sleep):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        if max_result_chars < 1:
            raise ValueError(f"max_result_chars={max_result_chars}: must be >= 1")
        self.tool = tool
        self.latency = latency
        self.timeout_s = float(timeout_s)
        self.max_result_chars = int(max_result_chars)
        self._sleep = sleep

    def run(self, turn_text: str, rng: np.random.Generator) -> ToolCallResult:
        """Runs the call in `turn_text` (which must start with "["); never raises for bad input."""
        try:
            argument = parse_tool_call(turn_text)
        except MalformedToolCall:
            return ToolCallResult(error_observation("malformed"), "malformed", 0.0)
        if argument is None:
            raise ValueError(f"{turn_text!r} is not a tool call (it must start with "
                             f"{TOOL_CALL_OPEN!r}); check with parse_tool_call first")
        delay = self.latency.sample(rng)
        if delay >= self.timeout_s:
            self._sleep(self.timeout_s)
            return ToolCallResult(error_observation("timeout"), "timeout", self.timeout_s)
        self._sleep(delay)
        t0 = time.monotonic()
        try:
            result = str(call_with_timeout(self.tool, argument, self.timeout_s - delay))
        except _Timeout:
            return ToolCallResult(error_observation("timeout"), "timeout", self.timeout_s)
        except Exception:  # noqa: BLE001 - any tool failure is an observation, not a crash
            return ToolCallResult(error_observation("raised"), "raised",
                                  delay + time.monotonic() - t0)
        latency = delay + time.monotonic() - t0
        if len(result) > self.max_result_chars:
            return ToolCallResult(error_observation("too_large"), "too_large", latency)
        return ToolCallResult(f"={result}\n", None, latency, result=result)
