r"""Rollouts/s through RolloutWriter + RolloutReader vs the fastest raw Reverb client loop.

A Reverb server runs in a spawned process with two queue tables of capacity --num_items:
"rollouts" (make_rollouts_table, used by RolloutWriter / RolloutReader) and "raw" (Table.queue, no
signature, used by the raw loops). Each round writes --num_items rollouts of ~2k tokens, then reads
them all back, for each path:

  ours           RolloutWriter.write (validation, free-slot check, padding to a length bucket,
                 insert confirmed per item) / RolloutReader.sample(--batch) decoded to Rollout.
  raw            one long-lived legacy reverb Writer: append + create_item per item, a single flush
                 at the end (no per-item confirmation, no timeout) / one Reverb sampler for all
                 items (32 per request), raw numpy columns, no decoding.
  raw_confirmed  the raw writer with a flush after every item (what "write returned" means in
                 ours), same reader.
  tw_per_item    the other way to write variable lengths with a timeout: a new TrajectoryWriter
                 per item (exact lengths, no padding), flushed with a timeout and closed; same
                 reader as raw.
  ours_per_item  ours, but sending through a new TrajectoryWriter per item instead of one
                 long-lived writer per length bucket: the design alternative, same checks.

The best of --repeats rounds is reported. Ends with one JSON line of figures.

  OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python programs/benchmarks/replay_path.py
"""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from typing import Dict, List

from absl import app, flags, logging
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from sao_actor_learner.types import Rollout  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_items", 2000, "Rollouts per phase (also the tables' capacity).")
flags.DEFINE_integer("min_len", 1800, "Shortest rollout (tokens).")
flags.DEFINE_integer("max_len", 2200, "Longest rollout (tokens).")
flags.DEFINE_integer("max_sequence_length", 4096, "RolloutWriter's max_sequence_length.")
flags.DEFINE_integer("vocab_size", 32000, "Token ids are drawn from [0, vocab_size).")
flags.DEFINE_integer("buckets_per_octave", 4, "RolloutWriter's length buckets per doubling.")
flags.DEFINE_integer("batch", 32, "Rollouts per RolloutReader.sample call (the learner's batch).")
flags.DEFINE_integer("repeats", 3, "Rounds; the best of each figure is reported.")
flags.DEFINE_integer("seed", 0, "Seed of the rollouts.")


def _serve(capacity: int, conn) -> None:
    """Child process: a Reverb server with the two tables until the parent says stop."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import reverb

    from sao_actor_learner.replay import make_rollouts_table

    server = reverb.Server(tables=[make_rollouts_table(capacity, "rollouts"),
                                   reverb.Table.queue("raw", capacity)])
    conn.send(server.port)
    conn.recv()
    server.stop()


def make_rollouts(n: int, seed: int) -> List[Rollout]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(FLAGS.min_len, FLAGS.max_len + 1))
        prompt = length // 8
        mask = np.zeros(length, np.int8)
        mask[prompt:] = 1
        out.append(Rollout(
            tokens=rng.integers(0, FLAGS.vocab_size, length),
            action_mask=mask,
            rollout_logp=np.where(mask == 1, -rng.random(length) * 4, 0.0),
            versions=np.where(mask == 1, i // 64, -1),
            rewards=np.where(np.arange(length) == length - 1, 1.0, 0.0),
            prompt_id=i, actor_id=i % 4, start_time=time.time(), end_time=time.time()))
    return out


def _per_item_writer_class():
    from sao_actor_learner.replay import RolloutWriter

    class PerItemWriter(RolloutWriter):
        """RolloutWriter sending each item through its own new TrajectoryWriter (no padding)."""

        def _send(self, columns, deadline):
            writer = self._client.trajectory_writer(num_keep_alive_refs=1)
            try:
                writer.append(columns)
                history = writer.history
                writer.create_item(self._table, 1.0, {k: history[k][-1] for k in columns})
                writer.flush(timeout_ms=max(50, int((deadline - time.monotonic()) * 1000)))
            finally:
                writer.close()

    return PerItemWriter


def run_ours(address: str, rollouts: List[Rollout], per_item: bool = False) -> Dict[str, float]:
    from sao_actor_learner.replay import RolloutReader, RolloutWriter

    n = len(rollouts)
    if per_item:
        writer = _per_item_writer_class()(address, "rollouts", FLAGS.max_sequence_length,
                                          FLAGS.vocab_size)
    else:
        writer = RolloutWriter(address, "rollouts", FLAGS.max_sequence_length, FLAGS.vocab_size,
                               buckets_per_octave=FLAGS.buckets_per_octave)
    reader = RolloutReader(address, "rollouts")
    t0 = time.perf_counter()
    for r in rollouts:
        if not writer.write(r, timeout_s=30.0):
            raise RuntimeError(f"write failed: {writer.stats()}")
    t1 = time.perf_counter()
    got: List[Rollout] = []
    while len(got) < n:
        batch = reader.sample(min(FLAGS.batch, n - len(got)), timeout_s=30.0)
        if not batch:
            raise RuntimeError(f"read timed out after {len(got)} of {n}")
        got.extend(batch)
    t2 = time.perf_counter()
    writer.close()
    reader.close()
    if [r.prompt_id for r in got] != [r.prompt_id for r in rollouts]:
        raise RuntimeError("ours: rollouts came back out of order or incomplete")
    if not all(np.array_equal(a.tokens, b.tokens) for a, b in zip(got[::97], rollouts[::97])):
        raise RuntimeError("ours: tokens changed on the way")
    return {"write_s": t1 - t0, "read_s": t2 - t1}


def run_raw(client, rollouts: List[Rollout], mode: str) -> Dict[str, float]:
    n = len(rollouts)
    columns = [r.columns() for r in rollouts]  # outside the timing: the raw loop gets dicts
    writer = client.writer(max_sequence_length=1, max_in_flight_items=None)
    t0 = time.perf_counter()
    if mode == "tw_per_item":
        for cols in columns:
            tw = client.trajectory_writer(num_keep_alive_refs=1)
            tw.append(cols)
            history = tw.history
            tw.create_item("raw", 1.0, {k: history[k][-1] for k in cols})
            tw.flush(timeout_ms=30_000)
            tw.close()
    else:
        for cols in columns:
            writer.append(cols)
            writer.create_item("raw", 1, 1.0)
            if mode == "raw_confirmed":
                writer.flush()
        writer.flush()
    t1 = time.perf_counter()
    sampler = client._client.NewSampler("raw", n, 32)  # pylint: disable=protected-access
    got = [sampler.GetNextTrajectory() for _ in range(n)]
    t2 = time.perf_counter()
    del sampler
    writer.close()
    if len(got) != n:
        raise RuntimeError("raw: wrong count")
    return {"write_s": t1 - t0, "read_s": t2 - t1}


def main(argv) -> None:
    del argv
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    n = FLAGS.num_items
    rollouts = make_rollouts(n, FLAGS.seed)
    mean_tokens = float(np.mean([r.length for r in rollouts]))
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(n, child), daemon=True)
    proc.start()
    port = parent.recv()
    address = f"127.0.0.1:{port}"
    import reverb

    client = reverb.Client(address)
    results: Dict[str, List[Dict[str, float]]] = {
        "ours": [], "raw": [], "raw_confirmed": [], "tw_per_item": [], "ours_per_item": []}
    try:
        for rep in range(FLAGS.repeats):
            for name in results:  # interleaved, so load changes hit every path alike
                if name.startswith("ours"):
                    results[name].append(run_ours(address, rollouts, name == "ours_per_item"))
                else:
                    results[name].append(run_raw(client, rollouts, mode=name))
            logging.info("round %d done", rep + 1)
    finally:
        parent.send("stop")
        proc.join(timeout=10)

    figures: Dict[str, float] = {"num_items": n, "mean_tokens": round(mean_tokens, 1),
                                 "repeats": FLAGS.repeats}
    print(f"\n{n} rollouts of ~{mean_tokens:.0f} tokens, server in another process, best of "
          f"{FLAGS.repeats} rounds\n")
    print(f"{'path':<15}{'write/s':>10}{'read/s':>10}{'write+read/s':>14}")
    for name, rounds in results.items():
        write = max(n / r["write_s"] for r in rounds)
        read = max(n / r["read_s"] for r in rounds)
        both = max(n / (r["write_s"] + r["read_s"]) for r in rounds)
        figures.update({f"{name}_write_per_s": round(write), f"{name}_read_per_s": round(read),
                        f"{name}_write_read_per_s": round(both)})
        print(f"{name:<15}{write:>10.0f}{read:>10.0f}{both:>14.0f}")
    for ref in ("raw", "raw_confirmed", "tw_per_item", "ours_per_item"):
        for key in ("write", "read", "write_read"):
            figures[f"ratio_ours_over_{ref}_{key}"] = round(
                figures[f"ours_{key}_per_s"] / figures[f"{ref}_{key}_per_s"], 3)
    print(f"\nours / raw (write+read): {figures['ratio_ours_over_raw_write_read']:.2f}; "
          f"ours / raw_confirmed: {figures['ratio_ours_over_raw_confirmed_write_read']:.2f}; "
          f"ours / ours_per_item: {figures['ratio_ours_over_ours_per_item_write_read']:.2f}\n")
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    app.run(main)
