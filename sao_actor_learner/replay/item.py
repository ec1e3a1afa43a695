"""The replay item: one rollout as one byte vector (docs/DESIGN.md, "The item").

Reverb's cost per item grows with its number of columns (each is its own tensor, chunk and
compression call): 12 separate columns took ~2x the time of the same bytes in one column
(programs/benchmarks/replay_path.py, rows raw and raw_packed). So an item is a single uint8
column laid out as

    offset 0        header (64 bytes, little-endian, no padding; HEADER below):
                    magic b"SAO1", length L (int32), prompt_id (int64), actor_id (int32),
                    group_id (int64), start_time (float64), end_time (float64), truncated (int8),
                    seq (int64); zeros to byte 56; run tag (uint64, RUN_TAG: the run
                    the item belongs to, replay/validation.py)
    offset 64       tokens        L x int32
                    rollout_logp  L x float32
                    versions      L x int32
                    rewards       L x float32
                    action_mask   L x int8
    offset 64+17L   signature     32 bytes: HMAC-SHA256 of bytes [0, 64+17L) under the actor's
                                  key (derived from the run's secret, run id and actor id)
    then            zeros up to the writer's length bucket (ignored)

The 4-byte columns start at multiples of 4, so the reader's columns are aligned zero-copy views
into the sampled array. The signature covers the header and every column in one contiguous span
(one C call to sign, one to verify). Pure numpy + struct: no Reverb or TensorFlow here; the
column copies of `pack` and the value checks of replay/validation.py run in one C pass each
(`native`, replay/_itemfast.c, built by setup.py) where it was built.
"""
from __future__ import annotations

import operator
import struct
from typing import Dict, NamedTuple, Optional

import numpy as np

try:
    from sao_actor_learner.replay import _itemfast as native
except ImportError:   # not built (no C compiler at install time): the numpy code runs instead
    native = None

MAGIC = b"SAO1"
HEADER_BYTES = 64
SIGNATURE_BYTES = 32
# magic, length, prompt_id, actor_id, group_id, start_time, end_time, truncated, seq
HEADER = struct.Struct("<4siqiqddbq")
# The per-token columns in their order in the item, with their dtypes (as types.TOKEN_DTYPES).
BODY_COLUMNS = (("tokens", np.int32), ("rollout_logp", np.float32), ("versions", np.int32),
                ("rewards", np.float32), ("action_mask", np.int8))
BYTES_PER_TOKEN = sum(np.dtype(dtype).itemsize for _, dtype in BODY_COLUMNS)  # 17

# The run tag sits at the header's end, inside the signed span.
RUN_TAG = struct.Struct("<Q")
RUN_TAG_OFFSET = HEADER_BYTES - RUN_TAG.size

assert HEADER.size <= RUN_TAG_OFFSET


def signed_bytes(length: int) -> int:
    """Bytes covered by the signature of an item of `length` tokens (header and columns)."""
    return HEADER_BYTES + BYTES_PER_TOKEN * int(length)


def item_bytes(length: int) -> int:
    """Size of the item of a rollout of `length` tokens, signature included (no padding)."""
    return signed_bytes(length) + SIGNATURE_BYTES


class Parsed(NamedTuple):
    """An item split into its parts: `columns` are views into the item (per-token columns;
    the scalars as Python ints and floats, in the ranges of types.SCALAR_DTYPES), `signed` the
    span the signature covers, `signature` the stored one, `run_tag` the header's run tag."""
    columns: Dict[str, np.ndarray]
    signed: memoryview
    signature: bytes
    run_tag: int = 0


def header(cols: Dict[str, object], length: int) -> bytes:
    """The header's bytes (HEADER) for the scalars in `cols`. Raises struct.error for a value
    outside its dtype's range, TypeError for a non-integer id or a non-number time."""
    index = operator.index   # integers only: a float or a string id raises TypeError
    return HEADER.pack(MAGIC, length, index(cols["prompt_id"]), index(cols["actor_id"]),
                       index(cols["group_id"]), cols["start_time"], cols["end_time"],
                       index(cols["truncated"]), index(cols["seq"]))


def length_of(item: np.ndarray) -> int:
    """The rollout length in the header of an item this module packed (no checks: parse
    checks untrusted items)."""
    return HEADER.unpack_from(item, 0)[1]


def pack(cols: Dict[str, np.ndarray], padded_length: int,
         sign: Optional["callable"] = None, header_bytes: Optional[bytes] = None,
         run_tag: int = 0) -> np.ndarray:
    """The item of exact-dtype columns (replay/validation.py check_columns' output) padded to
    `padded_length` tokens; `sign(memoryview) -> 32 bytes` fills the signature (None: zeros);
    `header_bytes`: the columns' header() if already made; `run_tag`: the run's tag (in the
    signed span). Raises struct.error for scalars outside
    their dtype's range, TypeError for a non-integer id or a non-number time."""
    length = int(cols["tokens"].shape[0])
    if padded_length < length:
        raise ValueError(f"padded_length={padded_length} < the rollout's {length} tokens")
    if header_bytes is None:
        header_bytes = header(cols, length)
    buf = np.zeros(item_bytes(padded_length), np.uint8)
    view = buf.data
    view[:HEADER.size] = header_bytes
    RUN_TAG.pack_into(buf, RUN_TAG_OFFSET, run_tag)
    offset = -1
    if native is not None:
        try:
            offset = native.pack(buf, *(cols[name] for name, _ in BODY_COLUMNS))
        except (BufferError, ValueError):   # a strided (non-contiguous) column
            pass
    if offset < 0:
        offset = HEADER_BYTES
        for name, dtype in BODY_COLUMNS:
            size = length * np.dtype(dtype).itemsize
            buf[offset:offset + size].view(dtype)[:] = cols[name]
            offset += size
    if sign is not None:
        view[offset:offset + SIGNATURE_BYTES] = sign(view[:offset])
    return buf


def parse(item: np.ndarray) -> Parsed:
    """Splits an item into its parts (views, nothing copied); raises ValueError when it is not
    an item of this layout (wrong dtype or rank, bad magic, a length the bytes cannot hold)."""
    if not isinstance(item, np.ndarray) or item.dtype != np.uint8 or item.ndim != 1:
        raise ValueError("an item is a 1-D uint8 array")
    if item.shape[0] < item_bytes(1) or bytes(item[:4]) != MAGIC:
        raise ValueError("not a rollout item (too short or no SAO1 header)")
    (_, length, prompt_id, actor_id, group_id, start_time, end_time, truncated,
     seq) = HEADER.unpack_from(item, 0)
    if length < 1 or item_bytes(length) > item.shape[0]:
        raise ValueError(f"the header's length {length} does not fit the item's "
                         f"{item.shape[0]} bytes")
    if not item.flags.c_contiguous:
        item = np.ascontiguousarray(item)
    columns: Dict[str, np.ndarray] = {}
    offset = HEADER_BYTES
    for name, dtype in BODY_COLUMNS:
        size = length * np.dtype(dtype).itemsize
        columns[name] = item[offset:offset + size].view(dtype)
        offset += size
    columns.update(prompt_id=prompt_id, actor_id=actor_id, group_id=group_id,
                   start_time=start_time, end_time=end_time, truncated=truncated, seq=seq)
    return Parsed(columns, item.data[:offset], bytes(item[offset:offset + SIGNATURE_BYTES]),
                  RUN_TAG.unpack_from(item, RUN_TAG_OFFSET)[0])
