"""What a replay item must be before anyone trusts it: checked columns, and a signature.

Two places check rollouts with the same rules (`check_columns`):
  - the actor's writer, before anything is sent (a broken engine's output never reaches replay);
  - the learner's reader, on everything it samples: Reverb has no authentication, so anything
    that reaches its port can insert items. The reader also checks each item's signature
    (`RolloutSigner`): an HMAC-SHA256 over the item's header and every column (replay/item.py)
    under the key of the actor the header names: HMAC(secret, run id | actor id), from a secret
    made at launch (or $SAO_ROLLOUT_SECRET) that only the learner holds, and the run id (new per
    fresh run, kept on resume). Each actor is handed its own key only, so it cannot sign as
    another actor id, and an item of another run (its header's run tag, in the signed span,
    names that run; its key differs) never verifies. A forged, malformed, tampered or
    other-run item is dropped and counted by reason, never trained on.

What the signature does not stop: a stranger who can reach the Reverb port can still read the
queue (sample items, which also removes them: a drain that delays training; the actors re-insert
what the learner never acknowledged once it reports a loss epoch) and fill it with junk the
learner then discards. Keep the port on a private network or behind a firewall.

REJECT_REASONS lists every reason, with what to change, in the order the checks run (the
columns first: a forged item with a bad value counts under that value's reason). Pure numpy +
hashlib.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from sao_actor_learner.replay import item
from sao_actor_learner.replay.item import SIGNATURE_BYTES  # noqa: F401  (re-exported)
from sao_actor_learner.types import SCALAR_COLUMNS, SCALAR_DTYPES, TOKEN_COLUMNS, TOKEN_DTYPES


# Why a rollout was refused, and what to change. Exactly one reason (the first that applies, in
# this order) is counted per refused rollout.
REJECT_REASONS: Dict[str, str] = {
    "malformed": "a column is missing, not 1-D, or not convertible to its dtype in types.py: "
                 "build rollouts with the Rollout dataclass",
    "empty": "the rollout has no tokens",
    "length_mismatch": "per-token columns (tokens, action_mask, rollout_logp, versions, rewards) "
                       "must all have the same length",
    "too_long": "the rollout is longer than max_sequence_length: raise "
                "SAOConfig.max_sequence_length or cut episodes shorter (max_new_tokens, turns)",
    "bad_action_mask": "action_mask values must be 0 or 1",
    "no_action_tokens": "no token has action_mask == 1: nothing to train on",
    "action_at_position_0": "action_mask[0] is 1, but token 0 has no preceding position to predict "
                            "it from (types.py: position 0 is never an action)",
    "token_out_of_range": "a token id is outside [0, vocab_size): check that vocab_size matches "
                          "the engine's tokenizer",
    "nonfinite_logp": "rollout_logp is NaN or inf on an action token: the engine's log-probs are "
                      "broken (temperature 0? overflow?)",
    "negative_version": "versions < 0 on an action token: the engine must tag every sampled token "
                        "with the policy version that sampled it",
    "nonfinite_reward": "rewards contain NaN or inf",
    "other_run": "the item's header names another run (an earlier run's item, e.g. from a "
                 "replay checkpoint or a reused $SAO_ROLLOUT_SECRET, or a forgery): refused "
                 "whatever its signature",
    "bad_signature": "the item's signature does not match its columns under the key of the "
                     "actor it names in this run: it was not written by that actor of this run "
                     "(another actor, a forger, or changed on the way)",
    "version_from_future": "an action token's version is newer than the learner's: no engine "
                           "could have sampled it (a forged or corrupted item)",
}


def as_dtype(value: Any, dtype) -> np.ndarray:
    """`value` as an array of `dtype`; raises ValueError if the conversion changes a value."""
    array = np.asarray(value)
    if array.dtype == dtype:
        return array
    if array.dtype == object:
        raise ValueError("object array")
    converted = array.astype(dtype)
    if np.dtype(dtype).kind in "iub":  # integers must survive the cast exactly (floats may round)
        if array.dtype.kind not in "iub" and not np.all(np.isfinite(array)):
            raise ValueError(f"non-finite values cannot become {np.dtype(dtype)}")
        if not np.array_equal(converted.astype(array.dtype), array):
            raise ValueError(f"values change when cast from {array.dtype} to {np.dtype(dtype)}")
    return converted


def check_columns(columns: Mapping[str, Any], vocab_size: int, max_sequence_length: int
                  ) -> Tuple[Optional[Dict[str, np.ndarray]], Optional[str]]:
    """(the columns with the exact dtypes of types.py, None) for a valid rollout, else
    (None, the REJECT_REASONS key of the first problem)."""
    try:
        cols = {name: as_dtype(columns[name], TOKEN_DTYPES[name]) for name in TOKEN_COLUMNS}
        for name in SCALAR_COLUMNS:
            value = as_dtype(columns[name], SCALAR_DTYPES[name])
            if value.shape != ():
                return None, "malformed"
            cols[name] = value
    except (AttributeError, KeyError, TypeError, ValueError, OverflowError):
        return None, "malformed"
    reason = shape_reason(cols) or check_values(cols, vocab_size, max_sequence_length)
    return (None, reason) if reason is not None else (cols, None)


def check_rollout(rollout: Any, vocab_size: int, max_sequence_length: int
                  ) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """`check_columns` of a Rollout-like object, without conversions when its per-token columns
    already have their exact dtypes (a Rollout's do): the columns (scalars as given, checked to
    fit the item's header) or the reason."""
    cols, _, reason = checked_item_parts(rollout, vocab_size, max_sequence_length)
    return cols, reason


def checked_item_parts(rollout: Any, vocab_size: int, max_sequence_length: int
                       ) -> Tuple[Optional[Dict[str, Any]], bytes, Optional[str]]:
    """`check_rollout`, and the item's header (replay/item.py) it made to check the scalars:
    (columns, header, None), else (None, b"", the reason). The writer's hot path."""
    cols = _exact_token_columns(rollout)
    if cols is None:   # not a Rollout's exact dtypes: convert (slow path)
        cols, reason = check_columns(rollout_columns(rollout), vocab_size, max_sequence_length)
    else:
        reason = shape_reason(cols) or check_values(cols, vocab_size, max_sequence_length)
        if reason is None:
            try:
                cols.update((name, getattr(rollout, name)) for name in SCALAR_COLUMNS)
            except AttributeError:
                reason = "malformed"
    if reason is not None:
        return None, b"", reason
    try:
        return cols, item.header(cols, cols["tokens"].shape[0]), None   # the scalars fit
    except (struct.error, TypeError, ValueError, OverflowError):
        return None, b"", "malformed"   # a scalar outside its dtype's range, or not a number


def _exact_token_columns(rollout: Any) -> Optional[Dict[str, Any]]:
    """The per-token columns of `rollout` when every one is an ndarray of its exact dtype (a
    Rollout's are), else None."""
    cols: Dict[str, Any] = {}
    for name in TOKEN_COLUMNS:
        value = getattr(rollout, name, None)
        if type(value) is not np.ndarray or value.dtype != TOKEN_DTYPES[name]:
            return None
        cols[name] = value
    return cols


def shape_reason(cols: Mapping[str, np.ndarray]) -> Optional[str]:
    """The REJECT_REASONS key of 1-D per-token columns' shapes ("malformed", "empty",
    "length_mismatch"), else None."""
    shapes = [cols[name].shape for name in TOKEN_COLUMNS]
    if any(len(shape) != 1 for shape in shapes):
        return "malformed"
    length = shapes[0][0]
    if length == 0:
        return "empty"
    if any(shape[0] != length for shape in shapes):
        return "length_mismatch"
    return None


# The rules `check_values` applies after the length, in order; replay/_itemfast.c's `check`
# returns the 1-based index of the first broken one (0: none).
VALUE_RULES = ("bad_action_mask", "no_action_tokens", "action_at_position_0",
               "token_out_of_range", "nonfinite_logp", "negative_version", "nonfinite_reward")


def check_values(cols: Mapping[str, np.ndarray], vocab_size: int, max_sequence_length: int
                 ) -> Optional[str]:
    """The REJECT_REASONS key of the first bad value of exact-dtype, 1-D, equal-length, non-empty,
    C-contiguous per-token columns, else None. A rollout is checked twice, by its actor and by
    the learner, so this is on both hot paths: one C pass over the columns (replay/_itemfast.c)
    where it was built, else `check_values_numpy` (slower: BENCHMARKS.md section 3)."""
    if cols["tokens"].shape[0] > max_sequence_length:
        return "too_long"
    if item.native is None:
        return check_values_numpy(cols, vocab_size)
    try:
        rule = item.native.check(cols["tokens"], cols["rollout_logp"], cols["versions"],
                                 cols["rewards"], cols["action_mask"], vocab_size)
    except (BufferError, ValueError):   # a strided (non-contiguous) column
        return check_values_numpy(cols, vocab_size)
    return VALUE_RULES[rule - 1] if rule else None


def check_values_numpy(cols: Mapping[str, np.ndarray], vocab_size: int) -> Optional[str]:
    """`check_values` after the length check, in numpy: one whole-array reduction per rule on
    the common path; the exact, masked checks run only when the cheap one fails."""
    mask = cols["action_mask"]
    if mask.view(np.uint8).max() > 1:  # int8 -1 reads as 255
        return "bad_action_mask"
    if not mask.any():
        return "no_action_tokens"
    if mask[0]:
        return "action_at_position_0"
    # int32 ids read as uint32: a negative id becomes >= 2**31, so one max covers both ends.
    if cols["tokens"].view(np.uint32).max() >= vocab_size:
        return "token_out_of_range"
    act = mask.view(np.bool_)  # values are 0/1 (checked above): a free boolean view
    logp = cols["rollout_logp"]
    # A sum is finite when every term is (a NaN or inf anywhere makes it NaN or inf); a finite
    # sum can still overflow, so a non-finite one is re-checked exactly, on action tokens only.
    if not np.isfinite(logp.sum()) and not np.isfinite(logp[act]).all():
        return "nonfinite_logp"
    versions = cols["versions"]
    if versions.min(where=act, initial=0) < 0:
        return "negative_version"
    rewards = cols["rewards"]
    if not np.isfinite(rewards.sum()) and not np.isfinite(rewards).all():
        return "nonfinite_reward"
    return None


def rollout_columns(rollout) -> Dict[str, Any]:
    """The columns of a Rollout-like object (attribute access; missing ones fail the check)."""
    out = {}
    for name in TOKEN_COLUMNS + SCALAR_COLUMNS:
        if hasattr(rollout, name):
            out[name] = getattr(rollout, name)
    return out


def run_tag(run_id: str) -> int:
    """The 64-bit tag of run `run_id` in every item's header (replay/item.py); never 0 (an
    unsigned item's)."""
    tag = int.from_bytes(hashlib.sha256(b"sao-run\0" + run_id.encode()).digest()[:8], "little")
    return tag or 1


class RolloutSigner:
    """The run's rollout keys (see the module docstring): one HMAC-SHA256 key per actor,
    derived from the run's secret, its run id and the actor id, so an item verifies only in its
    own run and only under the actor id it names. The learner holds this (it verifies every
    actor's items); each actor is handed its own key alone (`actor_key`, `ActorSigner`)."""

    def __init__(self, secret: bytes, run_id: str = ""):
        if isinstance(secret, str):   # hex (as made per launch), else the text's bytes
            try:
                secret = bytes.fromhex(secret)
            except ValueError:
                secret = secret.encode()
        if len(secret) < 16:
            raise ValueError("the rollout secret must have at least 16 bytes")
        self._secret = bytes(secret)
        self.run_id = str(run_id)
        self.run_tag = run_tag(self.run_id)
        self._keys: Dict[int, bytes] = {}

    def actor_key(self, actor_id: int) -> bytes:
        """Actor `actor_id`'s signing key in this run: HMAC(secret, run id | actor id)."""
        key = self._keys.get(actor_id)
        if key is None:
            key = hmac.digest(self._secret, b"sao-rollout-key\0" + self.run_id.encode() +
                              b"\0" + str(int(actor_id)).encode(), "sha256")
            self._keys[actor_id] = key
        return key

    def for_actor(self, actor_id: int) -> "ActorSigner":
        return ActorSigner(self.actor_key(actor_id), self.run_id)

    def sign(self, signed: memoryview, actor_id: int) -> bytes:
        return hmac.digest(self.actor_key(actor_id), signed, "sha256")

    def verify(self, signed: memoryview, signature: bytes, actor_id: int) -> bool:
        return len(signature) == SIGNATURE_BYTES and hmac.compare_digest(
            self.sign(signed, actor_id), signature)


class ActorSigner:
    """One actor's signer (what its writer holds): its key (RolloutSigner.actor_key, bytes or
    hex) and the run id whose tag its items carry."""

    def __init__(self, key: bytes, run_id: str = ""):
        if isinstance(key, str):
            key = bytes.fromhex(key)
        if len(key) < 16:
            raise ValueError("an actor's rollout key must have at least 16 bytes")
        self._key = bytes(key)
        self.run_tag = run_tag(str(run_id))

    def sign(self, signed: memoryview) -> bytes:
        """The 32-byte signature of `signed` (one C call: hmac.digest)."""
        return hmac.digest(self._key, signed, "sha256")


class RolloutVerifier:
    """Turns a sampled item's flat columns into a Rollout, or names why it is refused.

    Args:
      signer: the run's RolloutSigner; None skips the run tag and signature (tests,
        benchmarks).
      vocab_size, max_sequence_length: as the writer's.
    """

    def __init__(self, signer: Optional[RolloutSigner], vocab_size: int,
                 max_sequence_length: int):
        self.signer = signer
        self.vocab_size = int(vocab_size)
        self.max_sequence_length = int(max_sequence_length)

    def decode(self, flat) -> Tuple[Optional["Rollout"], Optional[str]]:
        """(rollout, None) or (None, the REJECT_REASONS key). Never raises for bad data: the
        layout first (one uint8 column, replay/item.py), then the values, then the signature."""
        from sao_actor_learner.types import Rollout
        try:
            if len(flat) != 1:
                return None, "malformed"
            parsed = item.parse(flat[0])
        except (TypeError, ValueError, struct.error):
            return None, "malformed"
        cols = parsed.columns
        reason = check_values(cols, self.vocab_size, self.max_sequence_length)
        if reason is not None:
            return None, reason
        if self.signer is not None:
            if parsed.run_tag not in (0, self.signer.run_tag):   # 0: no tag (unsigned)
                return None, "other_run"
            if not self.signer.verify(parsed.signed, parsed.signature, cols["actor_id"]):
                return None, "bad_signature"
        return Rollout(**cols), None
