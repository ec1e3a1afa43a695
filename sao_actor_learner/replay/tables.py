"""The replay table and the Reverb server that hosts it (docs/METHOD.md section 9).

The table is a bounded FIFO queue of rollouts: every rollout is sampled exactly once, in insertion
order, and the rate limiter blocks inserts while `queue_capacity` rollouts wait. That bound is one
of the three places the staleness limit is enforced: an actor cannot run further ahead of the
learner than the queue allows.

An item is one rollout, packed into a single uint8 column (replay/item.py: a header with the
scalars and the true length, the per-token columns, the signature); the writer pads it to a
length bucket (see writer.py for why), the reader reads the header's length.

Reverb's Python package imports TensorFlow (~2.6 s, ~450 MB). `ReplayServer` does not: it builds
the table, its rate limiter and checkpointer, and the server from Reverb's C++ extension
(replay/client.py `pybind()`, loaded without TensorFlow in a process started with `lite_env()`),
exactly as `reverb.Table` / `reverb.Server` do, with the table signature as its serialized proto
(`ROLLOUTS_SIGNATURE_PROTO`, checked against TensorFlow's encoder by tests/replay/test_replay.py).
`make_rollouts_table` (a `reverb.Table`, for code that builds its own `reverb.Server`) imports
TensorFlow when called.
"""
from __future__ import annotations

import shutil
import tempfile
import threading
import time
from typing import Any, Dict, Optional, Tuple

import numpy as np
from absl import logging

from sao_actor_learner import core
from sao_actor_learner.replay.client import connect, pybind

DEFAULT_TABLE = "rollouts"

# An item has one column: the rollout packed into bytes (replay/item.py has the layout and why).
ITEM_COLUMN = "item"
ITEM_COLUMNS: Tuple[str, ...] = (ITEM_COLUMN,)

# nested_structure_coder.encode_structure(rollouts_signature()).SerializeToString(): what
# reverb.Table sends its C++ table as the signature (a StructuredValue proto of one TensorSpec).
ROLLOUTS_SIGNATURE_PROTO = bytes.fromhex(
    "aa03240a220a046974656d121a8a02170a046974656d120d120b08ffffffffffffffffff011804")


def rollouts_signature() -> Dict[str, Any]:
    """The table signature: one `[None]` uint8 column, the packed rollout."""
    import tensorflow as tf

    return {ITEM_COLUMN: tf.TensorSpec([None], tf.uint8, name=ITEM_COLUMN)}


def make_rollouts_table(queue_capacity: int, name: str = DEFAULT_TABLE):
    """A `reverb.Table` that is a bounded FIFO queue of rollouts.

    Fifo sampler and remover, `max_times_sampled=1` (each item is sampled once), and a
    `Queue(queue_capacity)` rate limiter: inserts block while `queue_capacity` rollouts are queued,
    samples block while the table is empty. The signature makes the `TrajectoryWriter` check every
    item's dtypes and shapes before it is sent. An item the learner never trains (lost in a
    crash, or a replay node's restart) is still in its actor's spool: the actor re-inserts it
    when the learner reports a loss epoch (end-to-end acknowledgement, actors/spool.py).
    """
    _check_capacity(queue_capacity)
    import reverb

    return reverb.Table(
        name=name,
        sampler=reverb.selectors.Fifo(),
        remover=reverb.selectors.Fifo(),
        max_size=int(queue_capacity),
        rate_limiter=reverb.rate_limiters.Queue(int(queue_capacity)),
        max_times_sampled=1,
        signature=rollouts_signature(),
    )


def _check_capacity(queue_capacity) -> None:
    if not isinstance(queue_capacity, (int, np.integer)) or queue_capacity < 1:
        raise ValueError(f"queue_capacity={queue_capacity!r}: must be an int >= 1 (the most "
                         "rollouts that may wait in replay; SAOConfig uses 2*batch_size)")


def _cpp_rollouts_table(queue_capacity: int, name: str):
    """make_rollouts_table's table, built as reverb.Table builds it, from the C++ extension."""
    _check_capacity(queue_capacity)
    lib = pybind()
    capacity = int(queue_capacity)
    # rate_limiters.Queue(capacity)
    limiter = lib.RateLimiter(samples_per_insert=1.0, min_size_to_sample=1, min_diff=0.0,
                              max_diff=float(capacity))
    return lib.Table(name=name, sampler=lib.FifoSelector(), remover=lib.FifoSelector(),
                     max_size=capacity, max_times_sampled=1, rate_limiter=limiter,
                     extensions=[], signature=ROLLOUTS_SIGNATURE_PROTO)


class ReplayServer(core.Worker):
    """The replay node: a Reverb server hosting the rollouts table, as a `core.Worker`.

    `run()` starts the server (if `start()` has not) and serves until `stop()`. `address` is known
    from construction on, so a launcher can hand it to other nodes before the server runs.

    Network: Reverb 0.14's `Server` takes only a port, no host; it listens on all interfaces
    (`[::]:PORT`, seen as `*:PORT` by `ss -ltn`). `address` says "127.0.0.1:PORT", which is what
    local clients should use; on a shared host, firewall the port: Reverb has no authentication.

    Checkpoints: with `checkpoint_dir`, a `DefaultCheckpointer` there restores the newest checkpoint
    (items, order and counters) when the server starts, `checkpoint()` writes one, so does `run()`
    every `checkpoint_every_s` seconds (0: never) and once more when it stops. Reverb restores the
    checkpoint's rate limiter in place of the one configured here; a capacity mismatch is logged.
    Without `checkpoint_dir`, Reverb's default checkpointer (an empty temporary folder, removed
    when the server stops) is used.
    """

    def __init__(self, queue_capacity: int, port: int = 0, checkpoint_dir: Optional[str] = None,
                 *, table_name: str = DEFAULT_TABLE, checkpoint_every_s: float = 0.0):
        if not isinstance(queue_capacity, (int, np.integer)) or queue_capacity < 1:
            raise ValueError(f"queue_capacity={queue_capacity!r}: must be an int >= 1")
        if port < 0 or port > 65535:
            raise ValueError(f"port={port}: must be in [0, 65535] (0 picks a free port)")
        if checkpoint_every_s < 0:
            raise ValueError(f"checkpoint_every_s={checkpoint_every_s}: must be >= 0 (0: never)")
        if checkpoint_every_s and not checkpoint_dir:
            raise ValueError("checkpoint_every_s is set but checkpoint_dir is not: periodic "
                             "checkpoints need a checkpoint_dir")
        self.queue_capacity = int(queue_capacity)
        self.table_name = table_name
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every_s = float(checkpoint_every_s)
        if not port:
            import portpicker  # a Reverb dependency; no TensorFlow

            port = portpicker.pick_unused_port()
        self._port = int(port)
        self._server = None
        self._temp_dir: Optional[str] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        """Where local clients connect, "127.0.0.1:PORT" (the server listens on all interfaces)."""
        return f"127.0.0.1:{self._port}"

    @property
    def started(self) -> bool:
        return self._server is not None

    def start(self) -> "ReplayServer":
        """Starts serving (idempotent); returns self."""
        with self._lock:
            if self._server is not None:
                return self
            lib = pybind()
            path = self.checkpoint_dir
            if not path:   # reverb.Server's default: a TempDirCheckpointer (one per server,
                # kept across a failed start, removed by _shutdown)
                path = self._temp_dir = self._temp_dir or tempfile.mkdtemp(prefix="sao_replay_")
            checkpointer = lib.create_default_checkpointer(path, "", None)
            table = _cpp_rollouts_table(self.queue_capacity, self.table_name)
            t0 = time.time()
            self._server = lib.Server([table], self._port, checkpointer)
            logging.info("ReplayServer: table %r (queue capacity %d) serving at %s in %.2fs%s",
                         self.table_name, self.queue_capacity, self.address, time.time() - t0,
                         f", checkpoints in {self.checkpoint_dir}" if self.checkpoint_dir else "")
        if self.checkpoint_dir:
            self._check_restored()
        return self

    def _check_restored(self) -> None:
        status = connect(self.address).table_status(self.table_name)
        restored = status.insert_capacity
        if status.current_size:
            logging.info("ReplayServer: restored %d queued rollouts from %s", status.current_size,
                         self.checkpoint_dir)
        if restored != self.queue_capacity:
            logging.warning(
                "ReplayServer: the checkpoint in %s restored a rate limiter with capacity %d, "
                "not queue_capacity=%d (Reverb keeps the checkpoint's limiter). Use "
                "queue_capacity=%d, or start from an empty checkpoint_dir.", self.checkpoint_dir,
                restored, self.queue_capacity, restored)

    def client(self):
        """A `reverb.Client` connected to this server (imports TensorFlow; the project's own
        code uses `connect(address)`, replay/client.py)."""
        import reverb

        return reverb.Client(self.address)

    def checkpoint(self) -> str:
        """Writes a checkpoint now and returns its path (needs `checkpoint_dir`)."""
        if not self.checkpoint_dir:
            raise RuntimeError("ReplayServer.checkpoint(): no checkpoint_dir was given")
        if self._server is None:
            raise RuntimeError("ReplayServer.checkpoint(): the server is not started")
        path = pybind().Client(self.address).Checkpoint()
        logging.info("ReplayServer: checkpoint written to %s", path)
        return path

    def run(self) -> None:
        self.start()
        try:
            period = self.checkpoint_every_s or None
            while not self._stop.wait(timeout=period):
                self._try_checkpoint()
            if self.checkpoint_dir:
                self._try_checkpoint()
        finally:
            self._shutdown()

    def _try_checkpoint(self) -> None:
        try:
            self.checkpoint()
        except Exception as e:  # a failed checkpoint must not take replay down
            logging.error("ReplayServer: checkpoint to %s failed: %s", self.checkpoint_dir, e)

    def stop(self) -> None:
        self._stop.set()

    def _shutdown(self) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.Stop()
            logging.info("ReplayServer: stopped (%s)", self.address)
        temp, self._temp_dir = self._temp_dir, None
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
