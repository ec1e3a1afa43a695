"""Reading the answer out of a response: the builtin rewards' parsers, and the answer a
majority vote counts (maj@k, evaluation.py).

  gsm8k_answer       the last `#### <number>` (verl's GSM8K convention), commas, `$` and a
                     trailing `.` removed; None without one.
  final_number       the number after the first "=", else the last number of the response
                     (a short instruct model answers "7 + 7 = 14", "The answer is 14." or
                     "14"; reading the first number would take the restated question's "7").
                     Thousands commas are dropped ("1,234" is 1234); a minus sign counts only
                     when no digit is right before it ("78-23" holds 78 and 23). None without
                     a number.
  answer_of          the answer of a response under a reward spec: the two above for "gsm8k"
                     and "final_number", the stripped response otherwise.

Standard library only (reward worker processes import this package).
"""
from __future__ import annotations

import re
from typing import Dict, Optional

GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def normalise_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip().rstrip(".")


def same_answer(a: str, b: str) -> bool:
    """Equal as numbers when both parse as numbers ("72" == "72.0"), else as strings."""
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def gsm8k_answer(text: str) -> Optional[str]:
    matches = GSM8K_ANSWER.findall(str(text))
    answer = normalise_number(matches[-1]) if matches else ""
    return answer or None


def final_number(text: str) -> Optional[str]:
    text = str(text)
    equals = text.find("=")
    if equals >= 0:
        match = NUMBER.search(text, equals + 1)
        if match:
            return normalise_number(match.group())
    numbers = NUMBER.findall(text)
    return normalise_number(numbers[-1]) if numbers else None


def final_number_score(data_source, solution_str, ground_truth,
                       extra_info=None) -> Dict[str, float]:
    """{"score": 1.0 when `final_number` of the response equals the ground truth as a number,
    else 0.0; "no_answer": 1.0 when the response holds no number}."""
    answer = final_number(solution_str)
    if answer is None:
        return {"score": 0.0, "no_answer": 1.0}
    return {"score": float(same_answer(answer, normalise_number(str(ground_truth)))),
            "no_answer": 0.0}


def answer_of(spec: str, response: str) -> Optional[str]:
    """The answer a majority vote counts for a response scored by reward `spec`."""
    if spec == "gsm8k":
        return gsm8k_answer(response)
    if spec == "final_number":
        return final_number(response)
    return str(response).strip()
