"""The Reverb client of the actors and the learner: Reverb's C++ client, without TensorFlow where
the process allows it (docs/DESIGN.md, "Reverb without TensorFlow").

`import reverb` imports TensorFlow (~2.9 s and ~500 MB per process here), although the client
needs none of it: Reverb's C++ extension `reverb/libpybind.so` links only TensorFlow's C++
framework library, not its Python module. A process started with `lite_env()` in its environment
(the dynamic loader then finds `libtensorflow_framework.so.2` and Reverb's proto libraries, which
must be known before the interpreter starts) loads that extension alone, in ~0.3 s at ~60 MB
(`programs/benchmarks/memory.py`); the replay node builds its server from it the same way
(replay/tables.py). Every other process (tests, `local_mt`, Ray) gets the same C++ classes
through `import reverb`. A process must not do both: the extension's types register once per
process, so with `lite_env()` set nothing may `import reverb` afterwards.

`ReplayClient` is what replay/writer.py and replay/reader.py use: the table's size and capacity
from one ServerInfo round trip (the protos decoded here, without the TensorFlow-generated
modules), trajectory writers, and samplers. No TensorFlow Python module is needed by any of it.
"""
from __future__ import annotations

import importlib.util
import os
import struct
import sys
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

# Set (with LD_LIBRARY_PATH) by `lite_env()` in the environment of processes that load Reverb's
# C++ client without TensorFlow.
LITE_ENV = "SAO_REVERB_LITE"
# Seconds; the smallest timeout Reverb's ServerInfo accepts (whole seconds; none means forever).
SERVER_INFO_TIMEOUT_S = 1

_pybind: Optional[Any] = None


class FlushTimeout(Exception):
    """A writer's flush did not see its items confirmed within the timeout."""


class TableStatus(NamedTuple):
    name: str
    current_size: int
    max_size: int
    samples_per_insert: float
    max_diff: float
    inserts: int = 0     # items ever inserted (the rate limiter's count; a reset zeroes it)

    @property
    def insert_capacity(self) -> int:
        """How many items the rate limiter lets wait before it blocks inserts. Reverb admits an
        insert while `(inserts + 1) * samples_per_insert - samples <= max_diff`; for the queue
        table (samples_per_insert 1, every sample removes its item) `inserts - samples` is the
        current size, so the bound is `max_diff` items."""
        return int(min(self.max_size, self.max_diff / (self.samples_per_insert or 1.0)))


def _package_dir(name: str) -> Optional[str]:
    """The directory of the installed package `name`, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def lite_env() -> Dict[str, str]:
    """The environment a process needs to load Reverb's C++ client without TensorFlow ({} when
    Reverb or TensorFlow is not installed)."""
    dirs = [_package_dir("reverb"), _package_dir("tensorflow")]
    if None in dirs:
        return {}
    current = os.environ.get("LD_LIBRARY_PATH", "")
    return {LITE_ENV: "1", "LD_LIBRARY_PATH": os.pathsep.join(dirs + ([current] if current
                                                                        else []))}


def lite_active() -> bool:
    """Whether this process loads Reverb's C++ client without TensorFlow."""
    return os.environ.get(LITE_ENV) == "1" and "reverb" not in sys.modules


def pybind() -> Any:
    """Reverb's C++ extension module (the classes Client, TrajectoryWriter, Sampler, ...; Table,
    RateLimiter and Server for replay/tables.py)."""
    global _pybind
    if _pybind is None:
        if lite_active():
            path = os.path.join(_package_dir("reverb"), "libpybind.so")
            spec = importlib.util.spec_from_file_location("libpybind", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _pybind = module
        else:
            from reverb import pybind as module

            _pybind = module
    return _pybind


class TrajectoryWriter:
    """One Reverb trajectory writer (the C++ one): items of one step each."""

    def __init__(self, cpp_writer: Any):
        self._writer = cpp_writer

    def append_item(self, table: str, columns: List[Any], priority: float = 1.0) -> None:
        """Appends one step of `columns` and makes it an item of `table`."""
        refs = self._writer.Append(columns)
        self._writer.CreateItem(table, priority, [[ref] for ref in refs], [True] * len(refs))

    def flush(self, timeout_ms: int, block_until_num_items: int = 0) -> None:
        """Waits until at most `block_until_num_items` items are unconfirmed; FlushTimeout after
        `timeout_ms` (which must be > 0: Reverb reads 0 as no timeout)."""
        try:
            self._writer.Flush(int(block_until_num_items), int(timeout_ms))
        except RuntimeError as e:
            if "Timeout exceeded" in str(e):
                raise FlushTimeout(f"items not confirmed within {timeout_ms} ms") from None
            raise

    def close(self) -> None:
        self._writer.Close()


class ReplayClient:
    """A connection to a replay server at "host:port" (see the module docstring)."""

    def __init__(self, address: str, cpp_client: Optional[Any] = None):
        if not isinstance(address, str) or ":" not in address:
            raise ValueError(f"replay address {address!r}: expected 'host:port', e.g. "
                             "ReplayServer.address")
        self.server_address = address
        self._client = cpp_client if cpp_client is not None else pybind().Client(address)

    def table_status(self, table: str, timeout_s: int = SERVER_INFO_TIMEOUT_S) -> TableStatus:
        """The status of `table` (one ServerInfo round trip); TimeoutError when replay does not
        answer, KeyError naming the tables that exist when it has no `table`."""
        timeout = max(1, int(timeout_s))
        try:
            protos = self._client.ServerInfo(timeout)
        except RuntimeError as e:
            if "Deadline Exceeded" in str(e):
                raise TimeoutError(f"replay at {self.server_address} did not answer within "
                                   f"{timeout}s") from e
            raise
        names = []
        for proto in protos:
            status = decode_table_info(proto)
            if status.name == table:
                return status
            names.append(status.name)
        raise KeyError(f"replay has no table {table!r}; it has {sorted(names)}. Pass the table "
                       "name the ReplayServer was made with")

    def trajectory_writer(self, num_keep_alive_refs: int = 1,
                          validate_items: bool = True) -> TrajectoryWriter:
        """A writer; with `validate_items` its items are checked against the table signature
        before they are sent (anyone else's writer may skip that: the reader checks again)."""
        options = pybind().AutoTunedChunkerOptions(num_keep_alive_refs, 1.0)
        return TrajectoryWriter(self._client.NewTrajectoryWriter(options, bool(validate_items)))

    def sampler(self, table: str, max_samples: int, per_request: int) -> Any:
        """A sampler of at most `max_samples` items, `per_request` per round trip; its
        GetNextTrajectory() returns [key, probability, table_size, priority, times_sampled,
        *columns] as numpy arrays and blocks while the table is empty."""
        return self._client.NewSampler(table, int(max_samples), int(per_request))


def connect(client_or_address: Union[str, Any]) -> ReplayClient:
    """A ReplayClient from an address "host:port", a ReplayClient, or a `reverb.Client`."""
    if isinstance(client_or_address, ReplayClient):
        return client_or_address
    if isinstance(client_or_address, str):
        return ReplayClient(client_or_address)
    cpp = getattr(client_or_address, "_client", None)
    address = getattr(client_or_address, "server_address", None)
    if cpp is None or not isinstance(address, str):
        raise TypeError(f"expected a replay address 'host:port', a ReplayClient or a "
                        f"reverb.Client, got {type(client_or_address).__name__}")
    return ReplayClient(address, cpp)


# --- TableInfo, decoded without the TensorFlow-generated proto modules -----------------------
# Field numbers of reverb/cc/schema.proto (tests/replay/test_replay_client.py checks them against
# Reverb's own decoding): TableInfo.name 8, max_size 3, rate_limiter_info 5, current_size 7;
# RateLimiterInfo.samples_per_insert 1, max_diff 3, insert_stats 5; RateLimiterCallStats.completed 2.
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _varint(data: bytes, i: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _fields(data: bytes) -> Dict[int, Any]:
    """The last value of each field of a serialized message (nested messages as bytes)."""
    out: Dict[int, Any] = {}
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, i = _varint(data, i)
        elif wire == _I64:
            value, i = data[i:i + 8], i + 8
        elif wire == _LEN:
            size, i = _varint(data, i)
            value, i = data[i:i + size], i + size
        elif wire == _I32:
            value, i = data[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out[number] = value
    return out


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _double(raw: Optional[bytes]) -> float:
    return struct.unpack("<d", raw)[0] if raw else 0.0


def decode_table_info(proto: bytes) -> TableStatus:
    """The fields of a serialized `reverb.TableInfo` this project reads."""
    info = _fields(proto)
    limiter = _fields(info.get(5, b""))
    return TableStatus(name=info.get(8, b"").decode(), current_size=_signed(info.get(7, 0)),
                       max_size=_signed(info.get(3, 0)),
                       samples_per_insert=_double(limiter.get(1)),
                       max_diff=_double(limiter.get(3)),
                       inserts=_signed(_fields(limiter.get(5, b"")).get(2, 0)))
