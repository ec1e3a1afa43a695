"""Reward functions (sao_actor_learner/rewards/): builtins, user file:fn rewards in worker
processes (failures, timeouts, crashes, threads), math_verify, spec checks, import hygiene.

math-verify is never called in this process (its signal.alarm timeouts would cancel
pytest-timeout's alarm): only the reward's worker processes run it.
"""
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from sao_actor_learner.rewards import (BUILTINS, Reward, RewardResult, check_reward_spec,
                                       make_reward)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

USER_REWARD = '''
import math, os, sys, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(100)
    if solution_str == "raise":
        raise RuntimeError("boom " + str(ground_truth))
    if solution_str == "crash":
        os._exit(3)
    if solution_str == "nan":
        return float("nan")
    if solution_str == "inf":
        return {"score": math.inf}
    if solution_str == "abc":
        return "abc"
    if solution_str == "none":
        return None
    if solution_str == "noscore":
        return {"correct": 1.0}
    if solution_str == "strscore":
        return {"score": "1"}
    if solution_str == "dict":
        return {"score": 0.5, "length": 3, "ok": True, "note": "text", "bad": float("nan")}
    if solution_str == "pid":
        time.sleep(0.05)
        return {"score": float(ground_truth), "pid": os.getpid()}
    if solution_str == "int":
        return 1
    return float(solution_str == ground_truth)
'''


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture(scope="module")
def user_reward(tmp_path_factory):
    path = _write(tmp_path_factory.mktemp("reward"), "my_reward.py", USER_REWARD)
    with make_reward(f"{path}:compute_score", timeout_s=1.0, workers=2) as reward:
        yield reward


# ----------------------------------------------------------------------------- builtins

@pytest.mark.parametrize("response, truth, score", [
    ("so 3 + 4 = 7\n#### 7", "7", 1.0),
    ("#### 5 first, then\n#### 7", "7", 1.0),          # the last match wins
    ("#### 7 first, then\n#### 5", "7", 0.0),
    ("#### 1,234", "1234", 1.0),                        # commas removed
    ("#### -12", "-12", 1.0),                           # negative
    ("#### 12", "-12", 0.0),
    ("#### 72.", "72", 1.0),                            # trailing dot stripped
    ("#### 72.0", "72", 1.0),                           # compared as numbers
    ("#### 72", "$72", 1.0),                            # "$" removed from the ground truth
    ("#### 72", "She sells 3*24 = <<3*24=72>>72 eggs.\n#### 72", 1.0),  # GSM8K's answer column
    ("#### 1000", "so 1,000 in all\n#### 1,000", 1.0),
    ("#### 72", "so 72 in all\n#### 73", 0.0),
])
def test_gsm8k_scores(response, truth, score):
    result = make_reward("gsm8k")("openai/gsm8k", response, truth)
    assert result == RewardResult(score, None, {"no_answer": 0.0})


# "#### $72": as in verl, a "$" right after "#### " is no match.
@pytest.mark.parametrize("response", ["The answer is 72.", "####72", "#### ", "#### $72", ""])
def test_gsm8k_no_answer_is_a_wrong_answer_not_a_failure(response):
    reward = make_reward("gsm8k")
    assert reward("openai/gsm8k", response, "72") == RewardResult(0.0, None, {"no_answer": 1.0})
    assert reward.counters == {"calls": 1, "failed_raised": 0, "failed_timeout": 0,
                               "failed_non_finite": 0, "failed_bad_type": 0}


def test_exact():
    reward = make_reward("exact")
    assert reward("d", "  Paris\n", "Paris").score == 1.0
    assert reward("d", "42", 42).score == 1.0
    assert reward("d", "paris", "Paris").score == 0.0
    assert reward("d", "Paris", "Paris", extra_info={"split": "test"}).failure is None


def test_closed_reward_raises():
    reward = make_reward("exact")
    with reward:
        assert reward("d", "a", "a").score == 1.0
    with pytest.raises(RuntimeError, match="closed"):
        reward("d", "a", "a")


# ----------------------------------------------------------------------------- user rewards

@pytest.mark.timeout(60)
def test_user_reward_values(user_reward):
    assert user_reward("d", "yes", "yes") == RewardResult(1.0, None, {})
    assert user_reward("d", "yes", "no") == RewardResult(0.0, None, {})
    assert user_reward("d", "int", "x") == RewardResult(1.0, None, {})
    # Numeric entries besides "score" come back as metrics; text and non-finite ones do not.
    assert user_reward("d", "dict", "x") == RewardResult(0.5, None, {"length": 3.0, "ok": 1.0})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("response, failure", [
    ("raise", "raised"), ("crash", "raised"), ("nan", "non_finite"), ("inf", "non_finite"),
    ("abc", "bad_type"), ("none", "bad_type"), ("noscore", "bad_type"), ("strscore", "bad_type"),
])
def test_user_reward_failures_score_zero_and_are_counted(user_reward, response, failure):
    before = user_reward.counters
    result = user_reward("d", response, "x")
    assert (result.score, result.failure) == (0.0, failure)
    after = user_reward.counters
    assert after["calls"] == before["calls"] + 1
    assert after[f"failed_{failure}"] == before[f"failed_{failure}"] + 1
    assert user_reward("d", "yes", "yes") == RewardResult(1.0, None, {})  # still works


@pytest.mark.timeout(60)
def test_failure_is_logged_with_the_exception_text_rate_limited(tmp_path, caplog):
    path = _write(tmp_path, "r.py", USER_REWARD)
    with make_reward(f"{path}:compute_score", timeout_s=1.0, workers=1) as reward:
        with caplog.at_level(logging.WARNING):
            assert reward("d", "raise", "first").failure == "raised"
            assert reward("d", "raise", "second").failure == "raised"
        assert reward.counters["failed_raised"] == 2
    messages = [r.getMessage() for r in caplog.records if "call failed" in r.getMessage()]
    assert len(messages) == 1, messages
    assert "RuntimeError: boom first" in messages[0] and "raised" in messages[0]


@pytest.mark.timeout(60)
def test_hanging_call_times_out_and_its_worker_is_replaced(user_reward):
    user_reward("d", "yes", "yes")  # both workers started, so start-up is not timed below
    user_reward("d", "yes", "yes")
    before = user_reward.counters["failed_timeout"]
    t0 = time.monotonic()
    assert user_reward("d", "hang", "x") == RewardResult(0.0, "timeout", {})
    assert time.monotonic() - t0 < 1.0 + 4.0
    assert user_reward.counters["failed_timeout"] == before + 1
    for _ in range(3):  # every worker answers, the replacement included
        t0 = time.monotonic()
        assert user_reward("d", "yes", "yes") == RewardResult(1.0, None, {})
        assert time.monotonic() - t0 < 10.0


@pytest.mark.timeout(60)
def test_a_hanging_call_does_not_block_other_callers(user_reward):
    user_reward("d", "yes", "yes")
    user_reward("d", "yes", "yes")
    hung = []
    thread = threading.Thread(target=lambda: hung.append(user_reward("d", "hang", "x")))
    thread.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    assert user_reward("d", "yes", "yes").score == 1.0
    assert time.monotonic() - t0 < 0.9  # answered by the other worker, not after the timeout
    thread.join(10)
    assert hung == [RewardResult(0.0, "timeout", {})]


@pytest.mark.timeout(60)
def test_calls_from_four_threads(user_reward):
    results = {}

    def work(i):
        for j in range(5):
            results[(i, j)] = user_reward("d", "pid", str(10 * i + j))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == [(i, j) for i in range(4) for j in range(5)]
    for (i, j), result in results.items():
        assert (result.score, result.failure) == (float(10 * i + j), None)
    assert len({r.metrics["pid"] for r in results.values()}) == 2  # both workers served


@pytest.mark.timeout(60)
def test_worker_start_up_does_not_count_against_the_timeout(tmp_path):
    path = _write(tmp_path, "slow_import.py", """
        import time
        time.sleep(1.0)

        def score(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0
    """)
    with make_reward(f"{path}:score", timeout_s=0.5, workers=1) as reward:
        assert reward("d", "a", "b") == RewardResult(1.0, None, {})


def test_arguments_that_cannot_be_pickled_fail_the_call_only(user_reward):
    result = user_reward("d", "yes", "yes", extra_info={"f": lambda: 0})
    assert (result.score, result.failure) == (0.0, "raised")


@pytest.mark.timeout(60)
def test_user_function_need_not_be_picklable_and_sees_extra_info(tmp_path):
    path = _write(tmp_path, "closure.py", """
        def _make():
            seen = []
            def compute_score(data_source, solution_str, ground_truth, **kwargs):
                seen.append(1)
                return {"score": float(kwargs["extra_info"]["index"]), "calls": len(seen)}
            return compute_score
        compute_score = _make()
    """)
    with make_reward(f"{path}:compute_score", workers=1) as reward:
        assert reward("d", "a", "b", extra_info={"index": 7}) == RewardResult(7.0, None,
                                                                              {"calls": 1.0})
        assert reward("d", "a", "b", extra_info={"index": 2}).metrics == {"calls": 2.0}


def test_a_user_reward_sees_none_of_the_runs_secrets(tmp_path, monkeypatch):
    """Reward workers run user code: the secrets a launch reads from its environment
    ($SAO_AUTH_TOKEN, also set by --auth_token; $SAO_LEARNER_TOKEN; $SAO_ROLLOUT_SECRET) are
    not in theirs; other variables are."""
    from sao_actor_learner.secret_env import SECRET_ENV_VARS
    from sao_actor_learner.variables.security import AUTH_TOKEN_ENV
    assert AUTH_TOKEN_ENV in SECRET_ENV_VARS
    for name in SECRET_ENV_VARS:
        monkeypatch.setenv(name, "secret-value-" + "x" * 16)
    monkeypatch.setenv("SAO_TEST_PLAIN", "visible")
    path = _write(tmp_path, "env_reward.py", """
        import os
        def compute_score(data_source, solution_str, ground_truth, **kwargs):
            leaked = sum("secret-value" in v for v in os.environ.values())
            return {"score": float(leaked), "plain": float(os.environ.get("SAO_TEST_PLAIN")
                                                           == "visible")}
    """)
    with make_reward(f"{path}:compute_score", workers=1) as reward:
        assert reward("d", "a", "b") == RewardResult(0.0, None, {"plain": 1.0})


# ----------------------------------------------------------------------------- math_verify

@pytest.mark.timeout(60)
def test_math_verify():
    with make_reward("math_verify", timeout_s=5.0, workers=1) as reward:
        for answer, gold in [("0.5", "\\frac{1}{2}"), ("\\frac{1}{2}", "0.5"),
                             ("$x=3$", "3"), ("The answer is $\\boxed{3}$.", "3")]:
            assert reward("math", answer, gold) == RewardResult(
                1.0, None, {"math_verify_timeout": 0.0}), (answer, gold)
        assert reward("math", "0.6", "\\frac{1}{2}").score == 0.0
        assert reward("math", "no number here", "3").score == 0.0
        assert reward.counters["calls"] == 6 and reward.counters["failed_raised"] == 0


# ----------------------------------------------------------------------------- specs

def test_bad_specs_fail_with_a_fix(tmp_path):
    def fails(spec, *words):
        with pytest.raises(ValueError) as e:
            check_reward_spec(spec)
        for w in (repr(spec),) + words:
            assert w in str(e.value), (w, str(e.value))
        with pytest.raises(ValueError):
            make_reward(spec)

    missing = str(tmp_path / "nope.py")
    fails(f"{missing}:compute_score", "does not exist", "fix the path")
    broken = _write(tmp_path, "broken.py", "import no_such_module_here\n")
    fails(f"{broken}:compute_score", "ModuleNotFoundError", "no_such_module_here", "fix the file")
    raising = _write(tmp_path, "raising.py", "raise RuntimeError('top-level boom')\n")
    fails(f"{raising}:compute_score", "top-level boom")
    attr_error = _write(tmp_path, "attr_error.py", "import os\nos.no_such_attribute\n")
    fails(f"{attr_error}:compute_score", "AttributeError", "fix the file")
    good = _write(tmp_path, "good.py", """
        LIMIT = 3
        def two_args(solution_str, ground_truth):
            return 1.0
        def no_extra(data_source, solution_str, ground_truth):
            return 1.0
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0
        def star(*args, **kwargs):
            return 1.0
    """)
    fails(f"{good}:missing_fn", "has no function 'missing_fn'", "def missing_fn(data_source")
    fails(f"{good}:LIMIT", "not a function")
    fails(f"{good}:two_args", "cannot be called", "extra_info=None")
    fails(f"{good}:no_extra", "cannot be called", "extra_info=None")
    fails("gsm9k", *BUILTINS, "path/to/file.py:compute_score")
    fails(good, "did you mean", f"{good}:compute_score")
    fails("", "path/to/file.py:compute_score")
    check_reward_spec(f"{good}:compute_score")
    check_reward_spec(f"{good}:star")
    for name in BUILTINS:
        check_reward_spec(name)


def test_bad_reward_options():
    with pytest.raises(ValueError, match="timeout_s"):
        Reward("exact", timeout_s=0)


# ----------------------------------------------------------------------------- import hygiene

@pytest.mark.timeout(60)
def test_imports_no_heavy_modules_here_or_in_workers(tmp_path):
    """Neither the package nor its workers load torch, Reverb, TensorFlow or gRPC, and a worker
    does not re-import the parent's __main__ (whose imports may be heavy)."""
    (tmp_path / "heavy_marker.py").write_text("")
    reward_file = _write(tmp_path, "probe.py", """
        import sys
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            loaded = [m for m in ("torch", "reverb", "tensorflow", "grpc", "heavy_marker")
                      if m in sys.modules]
            return {"score": 1.0, "loaded": len(loaded)}
    """)
    main = _write(tmp_path, "main.py", f"""
        import sys
        import heavy_marker
        import sao_actor_learner.rewards, sao_actor_learner.rewards.pool
        bad = [m for m in ("torch", "reverb", "tensorflow", "grpc") if m in sys.modules]
        assert not bad, bad
        if __name__ == "__main__":
            with sao_actor_learner.rewards.make_reward({reward_file!r} + ":compute_score") as r:
                print("RESULT", r("d", "a", "b"))
    """)
    out = subprocess.run([sys.executable, main], cwd=str(tmp_path), capture_output=True,
                         text=True, timeout=50,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [REPO, str(tmp_path)])})
    assert out.returncode == 0, out.stderr
    assert "RESULT RewardResult(score=1.0, failure=None, metrics={'loaded': 0.0})" in out.stdout
