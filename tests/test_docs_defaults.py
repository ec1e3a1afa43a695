"""The defaults the README and docs quote are the config's: every table with a `default` column
(`| --flag | default | ... |`, several flags in one cell take comma-separated defaults), every
phrase that names a default ("`X=Y` (default)", "`X=Y` is the default", "`X` (default V)",
"`X = K` (default V)", "x_y   (default V)" in a formula) and every field of docs/DESIGN.md's
per-section lists ("**Actor** (`ActorConfig`): `actor_batch` (8), ...") is read and checked
against SAOConfig's field defaults, so the docs stay true when a default changes. A field left at 0 or "" for its task's default may be quoted as
that task's value ("0 (= 2 * batch)", "0: the task's"): the first token is what is checked."""
import dataclasses
import glob
import os
import re

import pytest

from sao_actor_learner.config import SAOConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "BENCHMARKS.md"] + sorted(
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
DEFAULTS = {f.name: f.default for f in dataclasses.fields(SAOConfig)}
PHRASE = re.compile(r"`(?:--)?([a-z][a-z_0-9]*)(?:\s*=\s*([^`]*))?`\s*\((?:the )?default"
                    r"(?![a-z_])([^)\n]*)")
IS_THE_DEFAULT = re.compile(r"`(?:--)?([a-z][a-z_0-9]*)\s*=\s*([^`]+)`(?:\s+is|,) the default\b")
# A field's bare name in a code block or formula: "kl_rollout > alarm_max_kl   (default 0.1)".
BARE = re.compile(r"(?<![`\w])([a-z]+_[a-z_0-9]+)\s+\(default\s+([^)\s]+)\)")
FLAG = re.compile(r"`--([a-z][a-z_0-9]*)`")
SECTION_LIST = re.compile(r"^\*\*[A-Z][\w ,-]*\*\* \(`\w+Config`.*?(?=\n\n)", re.M | re.S)
LISTED = re.compile(r"`([a-z][a-z_0-9]*)` \(([^()]*(?:\([^()]*\)[^()]*)*)\)")


# Words the docs use for a default that is empty: "-" (none), and --groups' "all" (no
# --groups: every group runs on this host).
EMPTY = {"", "-", "none", "unset"}
EMPTY_AS = {("groups", "all")}


def first_value(text):
    """The value a default cell or phrase starts with: a `quoted` one, "" or a bare token."""
    text = text.strip()
    quoted = re.match(r'`([^`]*)`|"([^"]*)"', text)
    if quoted:
        value = quoted.group(1) if quoted.group(1) is not None else quoted.group(2)
        return "" if value in ('""', "''") else value
    return re.match(r"[^\s,;:)]*", text).group(0)


def agrees(name, value, default):
    if default in (None, "", ()):             # unset, empty
        return value.lower() in EMPTY or (name, value) in EMPTY_AS
    if isinstance(default, bool):
        return value.lower() == str(default).lower()
    if isinstance(default, bool):
        return value.lower() == str(default).lower()
    if isinstance(default, (int, float)):
        try:
            return float(value) == float(default)
        except ValueError:
            return False
    if isinstance(default, tuple):
        return value == ",".join(default)
    return value == default


def table_row(where, flags, defaults):
    """(where, field, value) of one table row: `--a`, `--b` | 1, 2 (one value: for each flag;
    groups separated by ';' pair up)."""
    out = []
    flag_groups, value_groups = flags.split(";"), defaults.split(";")
    if len(flag_groups) != len(value_groups):
        flag_groups, value_groups = [flags], [defaults]
    for names, values in zip(flag_groups, value_groups):
        names = FLAG.findall(names)
        values = [v for v in values.split(", ")] if len(names) > 1 else [values]
        if len(values) == 1:
            values = values * len(names)
        if len(values) != len(names):
            out.append((where, ",".join(names), f"<{len(values)} defaults for {len(names)} "
                        f"flags: {defaults!r}>"))
            continue
        out += [(where, n, first_value(v)) for n, v in zip(names, values)]
    return out


def section_lists(doc, text):
    """docs/DESIGN.md's lists of a config section's fields with their defaults, a paragraph
    each: "**Actor** (`ActorConfig`): `actor_batch` (8), `temperature` (1.0), ..."."""
    found = []
    for m in SECTION_LIST.finditer(text):
        where = f"{doc}:{text[:m.start()].count(chr(10)) + 1}"
        paragraph = " ".join(m.group(0).split())
        for name, value in LISTED.findall(paragraph):
            if DEFAULTS.get(name, 1) in ("", (), None):
                continue   # the paragraph says in words what empty means
            if value.startswith("task default"):   # 0: the task's (config.resolved_defaults)
                value = "0"
            found.append((where, name, first_value(value)))
    return found


def claims():
    """(where, field, claimed value) for every default the docs quote."""
    found = []
    for doc in DOCS:
        with open(os.path.join(REPO, doc)) as f:
            text = f.read()
        found += section_lists(doc, text)
        lines = text.split("\n")
        default_col = None
        for i, line in enumerate(lines, 1):
            where = f"{doc}:{i}"
            cells = [c.strip() for c in line.strip().strip("|").split("|")] \
                if line.lstrip().startswith("|") else None
            if cells is None:
                default_col = None
            elif default_col is None and "default" in [c.lower() for c in cells]:
                default_col = [c.lower() for c in cells].index("default")
            elif default_col is not None and len(cells) > default_col and \
                    not set(cells[0]) <= set("-: "):
                found += table_row(where, cells[0], cells[default_col])
                continue
            for m in PHRASE.finditer(line):
                name, given, rest = m.groups()
                if rest[:1] in ("", ",", ";", ":") and given is not None:
                    value = given             # `X=Y` (default) / (the default, ...)
                elif rest[:1] == ":":
                    value = first_value(rest[1:])
                elif rest[:1].isspace():
                    value = first_value(rest)  # `X` (default V) / `X = K` (default V)
                else:
                    continue
                found.append((where, name, value))
            found += [(f"{doc}:{i}", n, v) for n, v in IS_THE_DEFAULT.findall(line)]
            found += [(f"{doc}:{i}", n, first_value(v)) for n, v in BARE.findall(line)]
    return [(w, n, v) for w, n, v in found if n in DEFAULTS or n.count(",")]


def test_the_docs_quote_defaults_at_all():
    # The reader works: it finds the main tables and phrases (a format change would otherwise
    # leave the test checking nothing).
    found = {(w.split(":")[0], n) for w, n, _ in claims()}
    assert ("README.md", "max_staleness") in found and ("docs/USAGE.md", "policy_lr") in found
    assert ("docs/METHOD.md", "lambda_policy") in found
    assert len(found) > 80


@pytest.mark.parametrize("where, name, value", claims())
def test_a_quoted_default_is_the_configs(where, name, value):
    if value in DEFAULTS:   # a default quoted as another field ("default `actor_batch`")
        return
    assert name in DEFAULTS, f"{where}: {name}: {value}"
    assert agrees(name, value, DEFAULTS[name]), (
        f"{where} says --{name} defaults to {value!r}; SAOConfig's default is "
        f"{DEFAULTS[name]!r}: fix the doc")
