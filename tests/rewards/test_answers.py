"""The final_number reward and the answer parsers a majority vote uses (rewards/answers.py)."""
import pytest

from sao_actor_learner.rewards import RewardResult, make_reward
from sao_actor_learner.rewards.answers import answer_of, final_number


@pytest.mark.parametrize("response, number", [
    ("14", "14"),
    ("The answer is 14.", "14"),
    ("7 + 7 = 14", "14"),                         # after "=", not the restated question
    ("7 + 7 = 14, and 14 + 1 = 15", "14"),        # the first "="
    ("To solve this, we add 3 and 4", "4"),       # no "=": the last number
    ("78-23", "23"),                              # a minus right after a digit is no sign
    ("x = -5", "-5"),
    ("1,234 apples", "1234"),
    ("3, 4", "4"),
    ("x = then 12", "12"),
    ("x = ", None),
    ("no number", None),
])
def test_final_number_reads_after_the_first_equals_else_the_last_number(response, number):
    assert final_number(response) == number


@pytest.mark.parametrize("response, truth, score", [
    ("So 6 + 7 = 13.", "13", 1.0), ("13.0", "13", 1.0), ("6 + 7 = 12", "13", 0.0),
    ("To solve this problem, 6 + 7", "13", 0.0), ("The answer is 1,200", "1200", 1.0),
])
def test_final_number_reward(response, truth, score):
    result = make_reward("final_number")("arith_qa/add1", response, truth)
    assert result == RewardResult(score, None, {"no_answer": 0.0})


def test_final_number_without_a_number_is_a_wrong_answer_not_a_failure():
    reward = make_reward("final_number")
    assert reward("x", "I do not know", "3") == RewardResult(0.0, None, {"no_answer": 1.0})
    assert reward.counters["calls"] == 1 and reward.counters["failed_raised"] == 0


def test_answer_of_follows_the_reward_spec():
    assert answer_of("gsm8k", "so 3 + 4 = 7 #### 7") == "7"
    assert answer_of("gsm8k", "7") is None
    assert answer_of("final_number", "3 + 4 = 7 #### 8") == "7"
    assert answer_of("exact", "  seven \n") == "seven"
    assert answer_of("path/to/reward.py:fn", " x ") == "x"
