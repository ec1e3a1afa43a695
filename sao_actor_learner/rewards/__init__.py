"""Reward functions in verl's conventions, made safe to call from an actor.

A reward is named by a spec string:

  "gsm8k"          GSM8K's strict convention: the last `#### <number>` in the response, compared
                   as a number with the ground truth (GSM8K's raw `answer` column is accepted:
                   the text after its last `#### ` is the answer). 1.0 or 0.0; metric `no_answer`
                   is 1.0 when the response has no `#### <number>`, else 0.0.
  "final_number"   the number after the first "=" of the response, else its last number
                   (answers.py), compared as a number with the ground truth: 1.0 or 0.0;
                   metric `no_answer` as gsm8k's. For short answers ("What is 7 + 8?").
  "exact"          1.0 when the stripped response equals the stripped `str(ground_truth)`.
  "math_verify"    math-verify's `verify(parse(gold), parse(response))`: 1.0 or 0.0. Needs the
                   `math` extra (`pip install -e ".[math]"`).
  "file.py:fn"     a user function with verl's signature
                   `fn(data_source, solution_str, ground_truth, extra_info=None)` returning a
                   number (float, int, bool) or a dict with a numeric "score"; the dict's other
                   finite numeric entries come back as metrics.

`make_reward(spec)` checks the spec (`check_reward_spec`, which raises ValueError saying what to
change) and returns a `Reward`. Calling a Reward never raises because of what the reward function
does: a function that raises, runs past `timeout_s`, returns a non-finite number or a value of
the wrong type gives score 0.0 and a failure reason ("raised", "timeout", "non_finite",
"bad_type"), is logged (rate-limited) and counted in `Reward.counters`.

"gsm8k", "final_number" and "exact" run inline in the calling thread. "math_verify" and "file.py:fn" run in a
pool of worker processes (pool.py): a call that runs past `timeout_s` has its worker killed and
replaced, so one hanging input cannot block later calls, and user code needs not be picklable
or thread-safe. This package imports only the standard library and absl, so the worker
processes start fast and never load torch, TensorFlow, Reverb or gRPC.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import threading
import time
import zlib
from typing import Any, Callable, Dict, Optional, Tuple

from absl import logging

from sao_actor_learner.rewards.answers import (final_number_score, gsm8k_answer,
                                               normalise_number, same_answer)

BUILTINS = ("gsm8k", "final_number", "exact", "math_verify")
INLINE = ("gsm8k", "final_number", "exact")
FAILURES = ("raised", "timeout", "non_finite", "bad_type")
MATH_REQUIREMENT = "math-verify[antlr4_13_2]>=0.9,<0.10"
_SPEC_HELP = ('a builtin reward ("gsm8k", "final_number", "exact", "math_verify") or a Python file and function, '
              '"path/to/file.py:compute_score"')
_LOG_EVERY_S = 10.0


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """One reward: `score` (finite; 0.0 on failure), `failure` (None or one of FAILURES) and
    `metrics` (name -> finite float)."""
    score: float
    failure: Optional[str] = None
    metrics: Dict[str, float] = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------- builtin rewards

def gsm8k_score(data_source, solution_str, ground_truth, extra_info=None) -> Dict[str, float]:
    """GSM8K's strict score: {"score": 1.0 or 0.0, "no_answer": 1.0 or 0.0}.

    The answer is the last match of `#### (-?[0-9.,]+)` in `solution_str` (as in verl: a `$`
    right after `#### ` is no match), with commas and `$` removed and a trailing `.` stripped.
    The ground truth is normalised the same way, after taking the text after its last `#### `
    if it has one. Answers are compared as numbers when both parse as numbers ("72" == "72.0"),
    else as strings.
    """
    answer = gsm8k_answer(solution_str)
    if answer is None:
        return {"score": 0.0, "no_answer": 1.0}
    truth = str(ground_truth)
    if "####" in truth:
        truth = truth.rsplit("####", 1)[1]
    return {"score": float(same_answer(answer, normalise_number(truth))), "no_answer": 0.0}


def exact_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when `solution_str.strip() == str(ground_truth).strip()`, else 0.0."""
    return float(str(solution_str).strip() == str(ground_truth).strip())


def math_verify_scorer(timeout_s: float) -> Callable[..., Dict[str, float]]:
    """The "math_verify" reward: {"score": `verify(parse(gold), parse(answer))` as 1.0 or 0.0,
    "math_verify_timeout": 1.0 when one of math-verify's own timeouts fired during the call}.

    math-verify times out each parse and each comparison itself with `signal.alarm` (whole
    seconds, so at least 1 s), which works only in a process's main thread: this function is
    meant for a worker process of pool.py, never for a thread of the caller. The per-step budget
    is a quarter of `timeout_s`, so a worker normally answers before its wall-clock timeout.
    """
    import logging as std_logging

    from math_verify import parse, verify  # lazily: imports sympy (~0.5 s)
    step_s = max(1, int(timeout_s / 4))
    timeouts = []  # math-verify reports its own timeouts only as log records: count them

    class _CountTimeouts(std_logging.Handler):
        def emit(self, record):
            timeouts.extend([1] if record.getMessage().startswith("Timeout") else [])
    mv_logger = std_logging.getLogger("math_verify")  # parent of math_verify.parser, .grader
    mv_logger.addHandler(_CountTimeouts(std_logging.WARNING))
    mv_logger.propagate = False  # its warnings quote whole responses: keep them off stderr

    def score(data_source, solution_str, ground_truth, extra_info=None) -> Dict[str, float]:
        timeouts.clear()
        gold = parse(str(ground_truth), parsing_timeout=step_s)
        answer = parse(str(solution_str), parsing_timeout=step_s)
        correct = verify(gold, answer, timeout_seconds=step_s)
        return {"score": float(correct), "math_verify_timeout": float(bool(timeouts))}
    return score


# ----------------------------------------------------------------------------- specs

def _split_file_spec(spec: str) -> Tuple[str, str]:
    path, _, name = spec.rpartition(":")
    return path, name


def _import_file(path: str):
    """Imports the Python file `path` under a private module name; raises what the import
    raises."""
    path = os.path.abspath(path)
    mod_name = "_sao_reward_%s_%x" % (re.sub(r"\W", "_", os.path.basename(path)[:-3]),
                                      zlib.crc32(path.encode()))
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module  # so dataclasses and pickling inside the file work
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    return module


def check_reward_spec(spec: str) -> None:
    """Raises ValueError, saying what to change, unless `spec` names a usable reward.

    For "file.py:fn" this imports the file in the calling process (running its top level) and
    checks that `fn` exists and can be called as `fn(data_source, solution_str, ground_truth,
    extra_info=...)`. For "math_verify" it checks that math-verify is installed. Meant to be
    called before any process is started, so that a bad spec fails before launch.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward spec {spec!r} is not a reward: give {_SPEC_HELP}")
    if spec in BUILTINS:
        if spec == "math_verify" and importlib.util.find_spec("math_verify") is None:
            raise ValueError(f'reward spec "math_verify" needs math-verify: run pip install '
                             f'"{MATH_REQUIREMENT}" (or pip install -e ".[math]")')
        return
    if ":" not in spec:
        hint = f' (did you mean "{spec}:compute_score"?)' if spec.endswith(".py") else ""
        raise ValueError(f"reward spec {spec!r} is not a builtin reward{hint}: give {_SPEC_HELP}")
    path, name = _split_file_spec(spec)
    if not path.endswith(".py") or not name.isidentifier():
        raise ValueError(f"reward spec {spec!r} is not of the form path/to/file.py:function_name: "
                         f"give {_SPEC_HELP}")
    if not os.path.isfile(path):
        raise ValueError(f"reward spec {spec!r}: file {os.path.abspath(path)} does not exist; "
                         f"fix the path (relative paths are from {os.getcwd()})")
    try:
        module = _import_file(path)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: B036 - user code may raise anything, SystemExit included
        raise ValueError(f"reward spec {spec!r}: importing {path} failed with "
                         f"{type(e).__name__}: {e}; fix the file so that it imports") from e
    if not hasattr(module, name):
        raise ValueError(f"reward spec {spec!r}: {path} has no function {name!r}; define "
                         f"def {name}(data_source, solution_str, ground_truth, extra_info=None) "
                         f"there or name an existing one after the colon")
    fn = getattr(module, name)
    if not callable(fn):
        raise ValueError(f"reward spec {spec!r}: {name} in {path} is a {type(fn).__name__}, "
                         f"not a function; name a function after the colon")
    try:
        inspect.signature(fn).bind("data_source", "solution_str", "ground_truth", extra_info=None)
    except TypeError as e:
        raise ValueError(f"reward spec {spec!r}: {name}{inspect.signature(fn)} cannot be called "
                         f"as {name}(data_source, solution_str, ground_truth, extra_info=...) "
                         f"({e}); give it verl's signature {name}(data_source, solution_str, "
                         f"ground_truth, extra_info=None)") from None
    except ValueError:
        pass  # no signature to inspect (a builtin or C function): accept it


def load_reward_function(spec: str, timeout_s: float) -> Callable:
    """The function a (checked) spec names; for "file.py:fn" this imports the file."""
    if spec == "gsm8k":
        return gsm8k_score
    if spec == "final_number":
        return final_number_score
    if spec == "exact":
        return exact_score
    if spec == "math_verify":
        return math_verify_scorer(timeout_s)
    path, name = _split_file_spec(spec)
    return getattr(_import_file(path), name)


def to_result(value: Any) -> RewardResult:
    """Turns what a reward function returned into a RewardResult (never raises)."""
    metrics: Dict[str, float] = {}
    score = value
    if isinstance(value, dict):
        if "score" not in value:
            return RewardResult(0.0, "bad_type")
        score = value["score"]
        for k, v in value.items():
            if k != "score" and isinstance(v, numbers.Real):
                v = float(v)
                if math.isfinite(v):
                    metrics[str(k)] = v
    if isinstance(score, (str, bytes)) or not (isinstance(score, numbers.Real)
                                               or hasattr(type(score), "__float__")):
        return RewardResult(0.0, "bad_type", metrics)
    try:
        score = float(score)
    except Exception:  # an object whose __float__ fails
        return RewardResult(0.0, "bad_type", metrics)
    if not math.isfinite(score):
        return RewardResult(0.0, "non_finite", metrics)
    return RewardResult(score, None, metrics)


# ----------------------------------------------------------------------------- Reward

class Reward:
    """A callable reward: `reward(data_source, solution_str, ground_truth, extra_info=None)`.

    Thread-safe: several threads may call one Reward at once. A call never raises because of the
    reward function (see the module docstring); it raises RuntimeError only after `close()`.
    `counters` counts calls and failures by reason. Pooled rewards ("math_verify", "file.py:fn")
    start their `workers` processes lazily, on the first calls; a worker's start-up does not
    count against `timeout_s`. `close()` (or leaving a `with` block) kills the workers.
    """

    def __init__(self, spec: str, *, timeout_s: float = 5.0, workers: int = 2):
        if timeout_s <= 0 or workers < 1:
            raise ValueError(f"reward {spec!r}: timeout_s must be > 0 and workers >= 1, "
                             f"got timeout_s={timeout_s}, workers={workers}")
        self.spec, self.timeout_s = spec, float(timeout_s)
        self._lock = threading.Lock()
        self._counters = {"calls": 0, **{f"failed_{f}": 0 for f in FAILURES}}
        self._last_log: Dict[str, float] = {}
        self._suppressed: Dict[str, int] = {}
        self._closed = False
        self._pool = None
        self._inline: Optional[Callable] = None
        if spec in INLINE:
            self._inline = load_reward_function(spec, timeout_s)
        else:
            from sao_actor_learner.rewards.pool import WorkerPool
            if spec not in BUILTINS:  # the workers must find the file whatever the cwd then
                path, name = _split_file_spec(spec)
                spec = f"{os.path.abspath(path)}:{name}"
            self._pool = WorkerPool(spec, workers=workers, timeout_s=self.timeout_s)

    @property
    def counters(self) -> Dict[str, int]:
        """A copy of {"calls", "failed_raised", "failed_timeout", "failed_non_finite",
        "failed_bad_type"}."""
        with self._lock:
            return dict(self._counters)

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None) -> RewardResult:
        if self._closed:
            raise RuntimeError(f"reward {self.spec!r} is closed")
        args = (data_source, solution_str, ground_truth, extra_info)
        if self._inline is not None:
            try:
                result, detail = to_result(self._inline(*args[:3], extra_info=extra_info)), ""
            except Exception as e:
                result, detail = RewardResult(0.0, "raised"), f"{type(e).__name__}: {e}"
        else:
            result, detail = self._pool.call(args)
        with self._lock:
            self._counters["calls"] += 1
            if result.failure is not None:
                self._counters[f"failed_{result.failure}"] += 1
        if result.failure is not None:
            self._log_failure(result.failure, detail, data_source)
        return result

    def _log_failure(self, failure: str, detail: str, data_source) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last_log.get(failure, -math.inf) < _LOG_EVERY_S:
                self._suppressed[failure] = self._suppressed.get(failure, 0) + 1
                return
            self._last_log[failure] = now
            suppressed = self._suppressed.pop(failure, 0)
        more = f" ({suppressed} more since the last such message)" if suppressed else ""
        logging.warning("reward %s: call failed (%s) on data_source %r, score 0.0%s: %s",
                        self.spec, failure, data_source, more, detail or "no detail")

    def close(self) -> None:
        """Kills the worker processes (idempotent). Calls after this raise RuntimeError."""
        self._closed = True
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> "Reward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Reward({self.spec!r}, timeout_s={self.timeout_s})"


def make_reward(spec: str, *, timeout_s: float = 5.0, workers: int = 2) -> Reward:
    """Checks `spec` (ValueError as in `check_reward_spec`) and returns its Reward.

    `timeout_s` is the wall-clock limit of one call of a pooled reward; `workers` the number of
    worker processes (at most that many pooled calls run at once; more callers wait for a free
    worker, and that wait does not count against `timeout_s`).
    """
    check_reward_spec(spec)
    return Reward(spec, timeout_s=timeout_s, workers=workers)


__all__ = ["BUILTINS", "FAILURES", "Reward", "RewardResult", "check_reward_spec", "make_reward"]
