"""What a replay item must be before anyone trusts it: checked columns, and a signature.

Two places check rollouts with the same rules (`check_columns`):
  - the actor's writer, before anything is sent (a broken engine's output never reaches replay);
  - the learner's reader, on everything it samples: Reverb has no authentication, so anything
    that reaches its port can insert items. The reader also checks each item's signature
    (`RolloutSigner`): an HMAC-SHA256, under a secret made at launch and handed only to the
    actors and the learner, over every column of the item. A forged, malformed or tampered item
    is dropped and counted by reason, never trained on.

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
import sys
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from sao_actor_learner.types import SCALAR_COLUMNS, SCALAR_DTYPES, TOKEN_COLUMNS, TOKEN_DTYPES

SIGNATURE_BYTES = 32
_LITTLE = sys.byteorder == "little"

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
    "bad_signature": "the item's signature does not match its columns under this run's secret: "
                     "it was not written by one of this run's actors (or was changed on the way)",
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
    if any(cols[name].ndim != 1 for name in TOKEN_COLUMNS):
        return None, "malformed"
    length = cols["tokens"].shape[0]
    if length == 0:
        return None, "empty"
    if any(cols[name].shape[0] != length for name in TOKEN_COLUMNS):
        return None, "length_mismatch"
    if length > max_sequence_length:
        return None, "too_long"
    # Each check is one or two whole-array reductions; masks are built only on the slow path.
    mask = cols["action_mask"]
    if mask.view(np.uint8).max() > 1:  # int8 -1 reads as 255
        return None, "bad_action_mask"
    if not mask.any():
        return None, "no_action_tokens"
    if mask[0]:
        return None, "action_at_position_0"
    tokens = cols["tokens"]
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        return None, "token_out_of_range"
    act = mask.view(np.bool_)  # values are 0/1 (checked above): a free boolean view
    logp = cols["rollout_logp"]
    if not np.isfinite(logp).all() and not np.isfinite(logp[act]).all():
        return None, "nonfinite_logp"
    if cols["versions"].min(where=act, initial=0) < 0:
        return None, "negative_version"
    if not np.isfinite(cols["rewards"]).all():
        return None, "nonfinite_reward"
    return cols, None


def rollout_columns(rollout) -> Dict[str, Any]:
    """The columns of a Rollout-like object (attribute access; missing ones fail the check)."""
    out = {}
    for name in TOKEN_COLUMNS + SCALAR_COLUMNS:
        if hasattr(rollout, name):
            out[name] = getattr(rollout, name)
    return out


class RolloutSigner:
    """HMAC-SHA256 of a rollout's columns under the run's secret (see the module docstring).

    The signed bytes are, for every column in a fixed order, its name, dtype, shape and data
    (little-endian, C order) of the exact-dtype, unpadded column: what the writer signs is what
    the reader, having cut the padding off, recomputes.
    """

    ORDER = tuple(sorted(TOKEN_COLUMNS + SCALAR_COLUMNS))

    def __init__(self, secret: bytes):
        if isinstance(secret, str):
            secret = bytes.fromhex(secret)
        if len(secret) < 16:
            raise ValueError("the rollout secret must have at least 16 bytes")
        self._secret = bytes(secret)
        self._headers: Dict[tuple, bytes] = {}

    def signature(self, cols: Mapping[str, np.ndarray]) -> np.ndarray:
        """[32] uint8: the signature of exact-dtype columns (check_columns' output)."""
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for name in self.ORDER:
            a = np.asarray(cols[name])
            key = (name, a.dtype, a.shape)
            header = self._headers.get(key)
            if header is None:
                header = self._headers[key] = f"{name}|{a.dtype.str}|{a.shape}|".encode()
            mac.update(header)
            if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not _LITTLE):
                a = a.astype(a.dtype.newbyteorder("<"))
            mac.update(np.ascontiguousarray(a).data if a.ndim else a.tobytes())
        return np.frombuffer(mac.digest(), dtype=np.uint8).copy()

    def verify(self, cols: Mapping[str, np.ndarray], signature: Any) -> bool:
        sig = np.asarray(signature)
        if sig.dtype != np.uint8 or sig.shape != (SIGNATURE_BYTES,):
            return False
        return hmac.compare_digest(self.signature(cols).tobytes(), sig.tobytes())


class RolloutVerifier:
    """Turns a sampled item's flat columns into a Rollout, or names why it is refused.

    Args:
      signer: the run's RolloutSigner; None skips the signature (tests, benchmarks).
      vocab_size, max_sequence_length: as the writer's.
    """

    def __init__(self, signer: Optional[RolloutSigner], vocab_size: int,
                 max_sequence_length: int):
        self.signer = signer
        self.vocab_size = int(vocab_size)
        self.max_sequence_length = int(max_sequence_length)

    def decode(self, flat) -> Tuple[Optional["Rollout"], Optional[str]]:
        """(rollout, None) or (None, the REJECT_REASONS key). Never raises for bad data."""
        from sao_actor_learner.replay.tables import (FLAT_COLUMN_ORDER, LENGTH_COLUMN,
                                                     SIGNATURE_COLUMN)
        from sao_actor_learner.types import Rollout
        try:
            if len(flat) != len(FLAT_COLUMN_ORDER):
                return None, "malformed"
            raw = dict(zip(FLAT_COLUMN_ORDER, flat))
            length = int(np.asarray(raw[LENGTH_COLUMN]).reshape(()))
            if length < 0 or any(np.asarray(raw[n]).ndim != 1 or
                                 np.asarray(raw[n]).shape[0] < length for n in TOKEN_COLUMNS):
                return None, "malformed"
            cut = {n: np.asarray(raw[n])[:length] for n in TOKEN_COLUMNS}
            cut.update({n: np.asarray(raw[n]).reshape(()) if np.asarray(raw[n]).size == 1
                        else np.asarray(raw[n]) for n in SCALAR_COLUMNS})
        except (TypeError, ValueError, IndexError, KeyError):
            return None, "malformed"
        cols, reason = check_columns(cut, self.vocab_size, self.max_sequence_length)
        if reason is not None:
            return None, reason
        if self.signer is not None and not self.signer.verify(cols, raw[SIGNATURE_COLUMN]):
            return None, "bad_signature"
        return Rollout(**{n: cols[n] for n in TOKEN_COLUMNS},
                       **{n: cols[n].item() for n in SCALAR_COLUMNS}), None
