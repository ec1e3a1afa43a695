"""Reading prompt datasets: JSONL and parquet files in verl's schema or a simpler one.

verl's schema, one row per prompt:
    data_source   string, passed to the reward function ("openai/gsm8k")
    prompt        a list of chat messages [{"role": "user", "content": ...}, ...] or a string
    reward_model  {"style": "rule", "ground_truth": "72"}
    extra_info    a dict passed to the reward function (optional)
Simpler schemas map their columns with `prompt_key` and `answer_key` (dotted paths reach into
nested columns; the defaults are "prompt" and "reward_model.ground_truth"), e.g.
`prompt_key="question", answer_key="answer"` for GSM8K's own files.

`read_dataset` reads and checks every row before anything is trained: a missing or mistyped
column, an empty prompt, a message without role/content, a ground truth that is not a string or
a number all raise `DatasetError` naming the file, the row and the field, and saying what to
change. JSONL is read with the standard library; parquet with pyarrow (an optional dependency,
`pip install .[data]`), imported only for .parquet files.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

SUFFIXES = (".jsonl", ".parquet")
ROLES = ("system", "user", "assistant", "tool")
MAX_ERRORS_SHOWN = 5

Messages = Tuple[Dict[str, str], ...]


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file, row, field and fix."""


@dataclasses.dataclass(frozen=True)
class DatasetRow:
    """One prompt of a dataset file.

    prompt: the prompt text, or the chat messages ({"role", "content"} dicts) to render.
    ground_truth: what the reward compares the response with (numbers become strings).
    data_source, extra_info: passed to the reward function as they are.
    file, index: where the row came from (0-based row number within the file).
    """
    prompt: Union[str, Messages]
    ground_truth: str
    data_source: str
    extra_info: Dict[str, Any]
    file: str
    index: int


def read_rows(path: str) -> List[Dict[str, Any]]:
    """The raw rows of a .jsonl or .parquet file, as dicts."""
    if not os.path.isfile(path):
        raise DatasetError(f"dataset file {path!r} does not exist")
    if path.endswith(".jsonl"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise DatasetError(f"{path}: line {i + 1} is not JSON ({e}); each line of a "
                                       ".jsonl file must be one JSON object") from None
                if not isinstance(row, dict):
                    raise DatasetError(f"{path}: line {i + 1} is a {type(row).__name__}, not a "
                                       "JSON object")
                rows.append(row)
        return rows
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{path}: reading parquet needs pyarrow (pip install "
                               "'pyarrow>=14,<26'; `make` installs it), or convert it to .jsonl"
                               ) from None
        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:   # pyarrow raises several types for broken files
            raise DatasetError(f"{path}: not a readable parquet file ({e})") from None
    raise DatasetError(f"dataset file {path!r}: unknown format; use .jsonl or .parquet")


def _lookup(row: Dict[str, Any], key: str) -> Tuple[bool, Any]:
    """(found, value) of the dotted path `key` in `row`."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _prompt_of(value: Any) -> Tuple[Optional[Union[str, Messages]], str]:
    """(prompt, "") or (None, what is wrong with it)."""
    if isinstance(value, str):
        return (value, "") if value.strip() else (None, "is an empty string")
    if isinstance(value, (list, tuple)):
        if not value:
            return None, "is an empty list of messages"
        messages = []
        for j, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                    not isinstance(m.get("content"), str):
                return None, (f"message {j} is {m!r}; each message must be "
                              "{'role': str, 'content': str}")
            if m["role"] not in ROLES:
                return None, f"message {j} has role {m['role']!r}; roles are {', '.join(ROLES)}"
            messages.append({"role": m["role"], "content": m["content"]})
        if not any(m["content"].strip() for m in messages):
            return None, "has only empty messages"
        return tuple(messages), ""
    return None, (f"is a {type(value).__name__}; it must be a string or a list of chat "
                  "messages")


def _ground_truth_of(value: Any) -> Tuple[Optional[str], str]:
    if isinstance(value, bool) or value is None:
        return None, f"is {value!r}; it must be a string or a number"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return None, f"is {value!r}; it must be finite"
        return (str(int(value)) if float(value).is_integer() else repr(value)), ""
    if isinstance(value, str):
        return (value, "") if value.strip() else (None, "is an empty string")
    return None, f"is a {type(value).__name__}; it must be a string or a number"


def parse_rows(rows: Sequence[Dict[str, Any]], path: str, prompt_key: str = "prompt",
               answer_key: str = "reward_model.ground_truth") -> List[DatasetRow]:
    """Checks and converts raw rows; raises DatasetError listing the first bad rows."""
    errors: List[str] = []
    out: List[DatasetRow] = []
    keys_hint = ""
    for i, row in enumerate(rows):
        found, value = _lookup(row, prompt_key)
        prompt, why = _prompt_of(value) if found else (None, "")
        if not found:
            keys_hint = keys_hint or f" (its columns: {sorted(row)})"
            errors.append(f"row {i}: no field {prompt_key!r}{keys_hint}; set --prompt_key to the "
                          "column holding the prompt")
        elif prompt is None:
            errors.append(f"row {i}: field {prompt_key!r} {why}")
        found, value = _lookup(row, answer_key)
        truth, why = _ground_truth_of(value) if found else (None, "")
        if not found:
            keys_hint = keys_hint or f" (its columns: {sorted(row)})"
            errors.append(f"row {i}: no field {answer_key!r}{keys_hint}; set --answer_key to the "
                          "column holding the ground truth (dotted for nested columns)")
        elif truth is None:
            errors.append(f"row {i}: field {answer_key!r} {why}")
        source = row.get("data_source", "")
        if not isinstance(source, str):
            errors.append(f"row {i}: field 'data_source' is a {type(source).__name__}; it must be "
                          "a string")
        extra = row.get("extra_info") or {}
        if not isinstance(extra, dict):
            errors.append(f"row {i}: field 'extra_info' is a {type(extra).__name__}; it must be "
                          "a dict (or absent)")
        if len(errors) >= MAX_ERRORS_SHOWN:
            break
        if prompt is not None and truth is not None and not errors:
            out.append(DatasetRow(prompt=prompt, ground_truth=truth,
                                  data_source=source if isinstance(source, str) else "",
                                  extra_info=dict(extra) if isinstance(extra, dict) else {},
                                  file=path, index=i))
    if errors:
        raise DatasetError(f"{path}: " + "; ".join(errors[:MAX_ERRORS_SHOWN]) +
                           (" (first errors only)" if len(errors) >= MAX_ERRORS_SHOWN else ""))
    if not out:
        raise DatasetError(f"{path}: no rows; a dataset file needs at least one prompt")
    return out


def read_dataset(paths: Sequence[str], prompt_key: str = "prompt",
                 answer_key: str = "reward_model.ground_truth") -> List[DatasetRow]:
    """Every row of `paths`, in order, checked (`parse_rows`)."""
    if not paths:
        raise DatasetError("no dataset files given")
    out: List[DatasetRow] = []
    for path in paths:
        out.extend(parse_rows(read_rows(path), path, prompt_key, answer_key))
    return out
