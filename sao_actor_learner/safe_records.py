"""Run-folder data that cannot execute code when read: JSON for structure, raw bytes for arrays.

A run folder may be copied from elsewhere or changed by someone else; reading it must never
run what it holds (as unpickling does). What the journal, the spools and the learner's
checkpoint state hold is plain data: None, bool, int, float, str, bytes, lists, tuples, sets,
dicts, numpy arrays of numeric dtypes, numpy scalars and `types.Rollout`s. `dumps`/`loads`
write and read such a value as

    b"SAOR1" | uint32 length of the JSON tree | the JSON tree | the blobs (array and bytes data)

where every container is a one-key object naming its kind ({"l": [...]} list, {"t": [...]}
tuple, {"s": [...]} set, {"d": [[key, value], ...]} dict, {"od": ...} OrderedDict,
{"q": [maxlen, [...]]} deque, {"b": [offset, size]} bytes, {"a": [dtype, shape, offset, size]}
array, {"r": {field: value}} Rollout, {"o": [class name, {attribute: value}]} an instance of a
class registered with `plain_class`). `loads` builds only those kinds (arrays of bool,
integer, float or complex dtypes, never object ones; a Rollout from its own fields only; a
registered class's instance by setting its attributes, no code of the record run) and raises
ValueError for anything else.

`to_plain`/`from_plain` are the same tree with the blobs inline (bytes objects) and some leaves
(`keep`, e.g. torch tensors) left as they are: what `torch.save` then writes loads with
`torch.load(weights_only=True)`, which builds tensors and plain containers only.

Pure standard library + numpy.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import struct
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from sao_actor_learner.types import Rollout

MAGIC = b"SAOR1"
_LENGTH = struct.Struct("<I")
_ROLLOUT_FIELDS = frozenset(f.name for f in dataclasses.fields(Rollout))
_MAX_DEPTH = 64
# Classes whose instances a record may hold as their attributes (`plain_class`): name -> class.
_CLASSES: Dict[str, type] = {}


def plain_class(cls: type) -> type:
    """Lets records hold instances of `cls` (a class decorator): as its name and its
    attributes (`__dict__`, each a value a record may hold); read back by setting those
    attributes on `cls.__new__(cls)`: no constructor, `__setstate__` or other code of the
    record runs. Only classes registered here (by their modules, at import) can be built."""
    _CLASSES[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return cls


class UnsafeRecordError(ValueError):
    """Bytes that are not a record of this format (or a value it cannot hold)."""


def _safe_dtype(name: Any) -> np.dtype:
    try:
        dtype = np.dtype(str(name))
    except TypeError as e:
        raise UnsafeRecordError(f"array dtype {name!r}: {e}") from None
    if dtype.kind not in "biufc" or dtype.hasobject or dtype.fields is not None:
        raise UnsafeRecordError(f"array dtype {name!r} is not a plain numeric dtype")
    return dtype


def _encode(obj: Any, put: Callable[[bytes], Any], keep: Tuple[type, ...], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise TypeError("the value nests deeper than a record may")
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, float)):
        return obj if type(obj) in (int, float) else (int(obj) if isinstance(obj, int)
                                                       else float(obj))
    if keep and isinstance(obj, keep):
        return obj
    if isinstance(obj, np.generic):
        return _encode(obj.item(), put, keep, depth)
    if isinstance(obj, np.ndarray):
        dtype = _safe_dtype(obj.dtype.str)
        data = np.ascontiguousarray(obj).tobytes()
        return {"a": [dtype.str, list(obj.shape), *_as_list(put(data))]}
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"b": _as_list(put(bytes(obj)))}
    if isinstance(obj, Rollout):
        return {"r": {f: _encode(getattr(obj, f), put, keep, depth + 1)
                      for f in sorted(_ROLLOUT_FIELDS)}}
    if isinstance(obj, collections.OrderedDict):
        return {"od": [[_encode(k, put, keep, depth + 1), _encode(v, put, keep, depth + 1)]
                       for k, v in obj.items()]}
    if isinstance(obj, collections.deque):
        return {"q": [obj.maxlen, [_encode(v, put, keep, depth + 1) for v in obj]]}
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if _CLASSES.get(name) is type(obj):
        return {"o": [name, {k: _encode(v, put, keep, depth + 1)
                             for k, v in vars(obj).items()}]}
    if isinstance(obj, list):
        return {"l": [_encode(v, put, keep, depth + 1) for v in obj]}
    if isinstance(obj, tuple):
        return {"t": [_encode(v, put, keep, depth + 1) for v in obj]}
    if isinstance(obj, (set, frozenset)):
        return {"s": [_encode(v, put, keep, depth + 1) for v in obj]}
    if isinstance(obj, dict):
        return {"d": [[_encode(k, put, keep, depth + 1), _encode(v, put, keep, depth + 1)]
                      for k, v in obj.items()]}
    raise TypeError(f"a run-folder record cannot hold a {type(obj).__name__}")


def _as_list(where: Any) -> List[Any]:
    return list(where) if isinstance(where, tuple) else [where]


def _decode(node: Any, blob: Callable[[List[Any]], bytes], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise UnsafeRecordError("the record nests deeper than a record may")
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if not isinstance(node, dict) or len(node) != 1:
        return node   # a leaf kept as it is (to_plain's `keep`): from_plain only
    (kind, value), = node.items()
    if kind in ("l", "t", "s") and isinstance(value, list):
        items = [_decode(v, blob, depth + 1) for v in value]
        return items if kind == "l" else tuple(items) if kind == "t" else set(items)
    if kind in ("d", "od") and isinstance(value, list):
        out = {} if kind == "d" else collections.OrderedDict()
        for pair in value:
            if not isinstance(pair, list) or len(pair) != 2:
                raise UnsafeRecordError("a dict entry is not a [key, value] pair")
            out[_decode(pair[0], blob, depth + 1)] = _decode(pair[1], blob, depth + 1)
        return out
    if kind == "q" and isinstance(value, list) and len(value) == 2 and \
            isinstance(value[1], list) and (value[0] is None or isinstance(value[0], int)):
        return collections.deque((_decode(v, blob, depth + 1) for v in value[1]), value[0])
    if kind == "o" and isinstance(value, list) and len(value) == 2 and \
            isinstance(value[1], dict):
        cls = _CLASSES.get(value[0]) if isinstance(value[0], str) else None
        if cls is None:
            raise UnsafeRecordError(f"a record of class {value[0]!r}, which may not be built "
                                    "from one")
        obj = cls.__new__(cls)
        vars(obj).update({str(k): _decode(v, blob, depth + 1) for k, v in value[1].items()})
        return obj
    if kind == "b" and isinstance(value, list):
        return bytes(blob(value))
    if kind == "a" and isinstance(value, list) and len(value) >= 3:
        dtype = _safe_dtype(value[0])
        shape = value[1]
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise UnsafeRecordError(f"array shape {shape!r}")
        data = blob(value[2:])
        if len(data) != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise UnsafeRecordError(f"array of {dtype} {shape} with {len(data)} bytes")
        return np.frombuffer(data, dtype).reshape(shape).copy()
    if kind == "r" and isinstance(value, dict):
        if not set(value) <= _ROLLOUT_FIELDS:
            raise UnsafeRecordError(f"a rollout with fields {sorted(set(value) - _ROLLOUT_FIELDS)}")
        return Rollout(**{f: _decode(v, blob, depth + 1) for f, v in value.items()})
    raise UnsafeRecordError(f"unknown record node {kind!r}")


def dumps(obj: Any) -> bytes:
    """`obj` (plain data, arrays, Rollouts: the module docstring) as record bytes; TypeError
    for anything else."""
    blobs: List[bytes] = []
    size = [0]

    def put(data: bytes) -> Tuple[int, int]:
        blobs.append(data)
        size[0] += len(data)
        return size[0] - len(data), len(data)

    tree = json.dumps(_encode(obj, put, (), 0), separators=(",", ":")).encode()
    return b"".join([MAGIC, _LENGTH.pack(len(tree)), tree, *blobs])


def loads(data: bytes) -> Any:
    """The value `dumps` wrote; UnsafeRecordError for bytes that are not such a record (an
    old pickled file, a tampered one): nothing in them is executed."""
    view = memoryview(data)
    if len(view) < len(MAGIC) + _LENGTH.size or bytes(view[:len(MAGIC)]) != MAGIC:
        raise UnsafeRecordError("not a safe record (no SAOR1 header: an older, pickled file?)")
    start = len(MAGIC) + _LENGTH.size
    (tree_size,) = _LENGTH.unpack_from(view, len(MAGIC))
    blobs_at = start + tree_size
    if blobs_at > len(view):
        raise UnsafeRecordError("a record shorter than its header says")
    try:
        tree = json.loads(bytes(view[start:blobs_at]))
    except ValueError as e:
        raise UnsafeRecordError(f"a record's structure is not JSON ({e})") from None

    def blob(where: List[Any]) -> bytes:
        if len(where) != 2 or not all(isinstance(n, int) and n >= 0 for n in where):
            raise UnsafeRecordError(f"blob reference {where!r}")
        offset, size = where
        if blobs_at + offset + size > len(view):
            raise UnsafeRecordError("a blob beyond the record's end")
        return bytes(view[blobs_at + offset:blobs_at + offset + size])

    return _decode(tree, blob, 0)


def to_plain(obj: Any, keep: Tuple[type, ...] = ()) -> Any:
    """`obj` as the record tree with the blobs inline and `keep` leaves as they are (for
    torch.save, read back with torch.load(weights_only=True) and `from_plain`)."""
    return _encode(obj, lambda data: data, tuple(keep), 0)


def from_plain(tree: Any) -> Any:
    """The value `to_plain` made (its `keep` leaves as they are)."""
    def blob(where: List[Any]) -> bytes:
        if len(where) != 1 or not isinstance(where[0], (bytes, bytearray)):
            raise UnsafeRecordError(f"inline blob {type(where[0]).__name__}")
        return bytes(where[0])
    return _decode(tree, blob, 0)
