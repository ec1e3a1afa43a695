"""The replay item's C pass (replay/_itemfast.c) against the numpy code it replaces: the same
reason for every broken rule and every combination of them, the same packed bytes, the numpy
fallback for strided columns and when the module was not built, clear errors for bad calls."""
import itertools

import numpy as np
import pytest

from sao_actor_learner.replay import item
from sao_actor_learner.replay.validation import (VALUE_RULES, check_values,
                                                 check_values_numpy)

VOCAB = 50
MAX_LEN = 64
native = item.native
needs_native = pytest.mark.skipif(native is None, reason="replay/_itemfast.c was not built "
                                  "(no C compiler when the package was installed)")


def columns(length=12, seed=0):
    """Valid exact-dtype columns: a 3-token prompt, then actions."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(length, np.int8)
    mask[3:] = 1
    return {"tokens": rng.integers(0, VOCAB, length).astype(np.int32),
            "rollout_logp": np.where(mask == 1, -rng.random(length), 0).astype(np.float32),
            "versions": np.where(mask == 1, 2, -1).astype(np.int32),
            "rewards": (rng.random(length) * (np.arange(length) == length - 1)).astype(np.float32),
            "action_mask": mask}


def break_rule(cols, rule, rng):
    """`cols` with `rule` (a VALUE_RULES key) broken at a random place where it applies."""
    cols = {k: v.copy() for k, v in cols.items()}
    n = cols["tokens"].shape[0]
    acts = np.flatnonzero(cols["action_mask"] == 1)
    at = int(rng.choice(acts)) if acts.size else n - 1
    if rule == "bad_action_mask":
        cols["action_mask"][int(rng.integers(n))] = rng.choice([2, -1, 127, -128])
    elif rule == "no_action_tokens":
        cols["action_mask"][:] = 0
    elif rule == "action_at_position_0":
        cols["action_mask"][0] = 1
    elif rule == "token_out_of_range":
        cols["tokens"][int(rng.integers(n))] = rng.choice([VOCAB, VOCAB + 7, -1, -2**31, 2**31 - 1])
    elif rule == "nonfinite_logp":
        cols["rollout_logp"][at] = rng.choice([np.nan, np.inf, -np.inf])
    elif rule == "negative_version":
        cols["versions"][at] = rng.choice([-1, -5, -2**31])
    elif rule == "nonfinite_reward":
        cols["rewards"][int(rng.integers(n))] = rng.choice([np.nan, np.inf, -np.inf])
    return cols


def test_valid_columns_pass_both():
    for seed in range(20):
        cols = columns(length=4 + seed, seed=seed)
        assert check_values_numpy(cols, VOCAB) is None
        assert check_values(cols, VOCAB, MAX_LEN) is None


@needs_native
@pytest.mark.parametrize("broken", [c for k in (1, 2, 3) for c in
                                    itertools.combinations(VALUE_RULES, k)])
def test_every_rule_and_combination_gives_the_numpy_reason(broken):
    """The first broken rule in VALUE_RULES order, as the numpy code names it (which is the
    order of REJECT_REASONS)."""
    rng = np.random.default_rng(len(broken) * 100 + VALUE_RULES.index(broken[0]))
    for trial in range(5):
        cols = columns(length=int(rng.integers(4, 40)), seed=trial)
        for rule in broken:
            cols = break_rule(cols, rule, rng)
        expected = check_values_numpy(cols, VOCAB)
        assert expected is not None
        assert check_values(cols, VOCAB, MAX_LEN) == expected, (broken, trial)


@needs_native
def test_non_action_positions_may_hold_what_actions_may_not():
    """A NaN log-prob or a negative version on a prompt token is fine (only actions count);
    a NaN reward anywhere is not."""
    cols = columns()
    cols["rollout_logp"][0] = np.nan
    cols["versions"][1] = -7
    assert check_values(cols, VOCAB, MAX_LEN) is None is check_values_numpy(cols, VOCAB)
    cols["rewards"][0] = np.nan
    assert check_values(cols, VOCAB, MAX_LEN) == "nonfinite_reward"


def test_too_long_comes_first():
    cols = break_rule(columns(length=70), "token_out_of_range", np.random.default_rng(0))
    assert check_values(cols, VOCAB, MAX_LEN) == "too_long"


@needs_native
def test_random_corruptions_agree():
    rng = np.random.default_rng(7)
    for trial in range(300):
        cols = columns(length=int(rng.integers(1, 60)), seed=trial)
        for rule in rng.choice(VALUE_RULES, size=int(rng.integers(0, 3))):
            cols = break_rule(cols, str(rule), rng)
        assert check_values(cols, VOCAB, MAX_LEN) == check_values_numpy(cols, VOCAB), trial


def test_strided_columns_fall_back_to_numpy():
    cols = {k: np.repeat(v, 2)[::2] for k, v in columns().items()}   # views with stride 2
    assert not cols["tokens"].flags.c_contiguous
    assert check_values(cols, VOCAB, MAX_LEN) is None
    cols["tokens"][5] = VOCAB
    assert check_values(cols, VOCAB, MAX_LEN) == "token_out_of_range"
    packed = item.pack({**cols, **SCALARS}, 16)
    contiguous = item.pack({**{k: np.ascontiguousarray(v) for k, v in cols.items()}, **SCALARS},
                           16)
    assert packed.tobytes() == contiguous.tobytes()


SCALARS = {"prompt_id": 3, "actor_id": 1, "group_id": 3, "start_time": 1.5, "end_time": 2.5,
           "truncated": 0, "seq": 9}


def test_pack_is_the_same_bytes_with_and_without_the_c_pass(monkeypatch):
    sign = lambda data: bytes(32)   # noqa: E731  (any 32 bytes)
    for seed in range(10):
        cols = {**columns(length=5 + seed, seed=seed), **SCALARS}
        fast = item.pack(cols, 20, sign)
        monkeypatch.setattr(item, "native", None)
        slow = item.pack(cols, 20, sign)
        assert check_values(cols, VOCAB, MAX_LEN) == check_values_numpy(cols, VOCAB)
        monkeypatch.undo()
        assert fast.tobytes() == slow.tobytes()
        parsed = item.parse(fast)
        for name in ("tokens", "rollout_logp", "versions", "rewards", "action_mask"):
            np.testing.assert_array_equal(parsed.columns[name], cols[name])
        assert parsed.columns["seq"] == 9 and parsed.columns["start_time"] == 1.5


@needs_native
def test_bad_calls_raise_clear_errors():
    cols = columns()
    args = [cols[n] for n in ("tokens", "rollout_logp", "versions", "rewards", "action_mask")]
    with pytest.raises(TypeError, match="check"):
        native.check(*args)                                   # no vocab_size
    with pytest.raises(ValueError, match="different lengths"):
        native.check(args[0][:-1], *args[1:], VOCAB)
    with pytest.raises(ValueError, match="multiple"):
        native.check(args[0].view(np.uint8)[:-1], *args[1:], VOCAB)
    with pytest.raises(ValueError, match="too small"):
        native.pack(np.zeros(10, np.uint8), *args)
    with pytest.raises(ValueError, match="contiguous"):
        native.pack(np.zeros(1000, np.uint8)[::2], *args)     # numpy refuses the buffer
    out = np.zeros(item.signed_bytes(len(args[0])), np.uint8)
    assert native.pack(out, *args) == item.signed_bytes(len(args[0]))
