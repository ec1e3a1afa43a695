"""Chunk messages of the variable server, built and read without copying their payload bytes.

A `PublishChunk` or `WeightsChunk` is a few small fields plus `data` (field 2 in both), a slice of
a payload of up to gigabytes. The protobuf runtime copies `data` twice on each side (into the
message, then out of it); here the small fields go through protobuf as usual and only the data
field is framed or located by hand:

- `encode_chunk(head, parts)`: `head` (the serialized message without data) followed by the data
  field holding the concatenated `parts`: one copy, into the bytes gRPC sends. Protobuf parsers
  accept fields in any order, so this is a valid message of the same type.
- `split_data_field(raw)`: the message without its data field (parse it with protobuf: it is a
  few bytes) and a zero-copy view of the data. Malformed wire data raises `MalformedMessage`.
- `crc32(data, value=0)`: zlib's CRC-32, from ISA-L when installed (several times zlib's speed:
  BENCHMARKS.md section 4), the transit check of every weight payload; `parallel_crc32(data)`,
  the same value from two threads.

No grpc or protobuf import here; see server.py / client.py for their use.
"""
from __future__ import annotations

import os
import threading
from typing import List, Sequence, Tuple

try:   # ISA-L (setup.py extra "fast"): the same CRC-32 values as zlib.crc32, faster
    from isal.isal_zlib import crc32, crc32_combine
except ImportError:  # pragma: no cover - depends on the environment
    from zlib import crc32
    crc32_combine = None

# Work is split across threads only with 4 or more CPUs: with fewer, a second thread competes
# with the learner's, server's and actors' own threads for the same cores.
try:
    MANY_CPUS = len(os.sched_getaffinity(0)) >= 4
except (AttributeError, OSError):  # pragma: no cover - not Linux
    MANY_CPUS = (os.cpu_count() or 1) >= 4
# Below this (or with few CPUs), one thread: a second one costs more than it saves.
PARALLEL_CRC_MIN_BYTES = (8 << 20) if MANY_CPUS else 1 << 62

DATA_FIELD_NUMBER = 2            # `bytes data = 2` in PublishChunk and WeightsChunk
# gRPC channel/server options for bulk transfer, on both ends: HTTP/2 frames of up to 16 MiB
# instead of 16 KiB (each side advertises the frames it accepts), so a 1 MiB chunk crosses in
# one frame rather than 64. Measured in BENCHMARKS.md section 4.
BULK_TRANSFER_OPTIONS = (("grpc.http2.max_frame_size", (16 << 20) - 1),)
_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5
_DATA_KEY = bytes([DATA_FIELD_NUMBER << 3 | _WIRE_LEN])
# A chunk message has at most 9 fields; more are refused rather than walked one by one in Python
# (a message of millions of 2-byte fields would otherwise cost seconds).
MAX_FIELDS = 64


class MalformedMessage(ValueError):
    """The bytes are not a well-formed protobuf message; the text says where."""


def parallel_crc32(data) -> int:
    """crc32(data), the two halves hashed by two threads (ISA-L releases the GIL) and combined
    (crc32_combine); one thread for small buffers, with fewer than 4 CPUs, or without ISA-L."""
    view = memoryview(data).cast("B")
    n = view.nbytes
    if n < PARALLEL_CRC_MIN_BYTES or crc32_combine is None:
        return crc32(view)
    half = n // 2 & ~4095
    second = []
    helper = threading.Thread(target=lambda: second.append(crc32(view[half:])),
                              name="crc32-half", daemon=True)
    helper.start()
    first = crc32(view[:half])
    helper.join()
    return crc32_combine(first, second[0], n - half)


def encode_varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative integer."""
    if value < 0:
        raise ValueError(f"encode_varint({value}): must be >= 0")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_chunk(head: bytes, parts: Sequence) -> bytes:
    """`head` + field 2 (length-delimited) holding the concatenation of `parts` (bytes-likes)."""
    views = [memoryview(p).cast("B") for p in parts]
    length = sum(v.nbytes for v in views)
    return b"".join([head, _DATA_KEY, encode_varint(length), *views])


def _read_varint(view: memoryview, pos: int, end: int) -> Tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise MalformedMessage(f"truncated varint at byte {pos}")
        if shift >= 64:
            raise MalformedMessage(f"varint longer than 10 bytes at byte {pos}")
        byte = view[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def split_data_field(raw) -> Tuple[bytes, memoryview]:
    """(the message without field 2, a read-only view of field 2's bytes) of one message.

    Walks the top-level fields of `raw` (bytes-like). Every occurrence of field 2 is cut out;
    the view is of the last one (protobuf's rule for a repeated singular field); it is empty
    when there is none. Groups (wire types 3 and 4, unused by proto3) and messages of more than
    MAX_FIELDS fields are refused.
    """
    view = memoryview(raw).cast("B").toreadonly()
    end = view.nbytes
    pos = 0
    kept: List[memoryview] = []
    kept_from = 0
    data = view[0:0]
    fields = 0
    while pos < end:
        fields += 1
        if fields > MAX_FIELDS:
            raise MalformedMessage(f"more than {MAX_FIELDS} fields (a chunk message has 9 at most)")
        field_start = pos
        key, pos = _read_varint(view, pos, end)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise MalformedMessage(f"field number 0 at byte {field_start}")
        if wire == _WIRE_VARINT:
            _, pos = _read_varint(view, pos, end)
        elif wire == _WIRE_I64:
            pos += 8
        elif wire == _WIRE_I32:
            pos += 4
        elif wire == _WIRE_LEN:
            length, pos = _read_varint(view, pos, end)
            if length > end - pos:
                raise MalformedMessage(f"field {field} at byte {field_start} claims {length} "
                                       f"bytes, {end - pos} remain")
            if field == DATA_FIELD_NUMBER:
                data = view[pos:pos + length]
                kept.append(view[kept_from:field_start])
                kept_from = pos + length
            pos += length
        else:
            raise MalformedMessage(f"field {field} at byte {field_start} has wire type {wire} "
                                   "(groups and unknown wire types are not accepted)")
        if pos > end:
            raise MalformedMessage(f"field {field} at byte {field_start} runs past the end "
                                   f"({end} bytes)")
    kept.append(view[kept_from:end])
    return b"".join(kept), data
