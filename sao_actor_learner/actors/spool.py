"""An actor's spool: completed rollouts kept on disk until replay has confirmed them.

A rollout an actor has finished generating is written here before it is inserted, and removed
once `RolloutWriter.write` confirms the insert (or refuses the rollout as invalid). If the actor
dies in between (`kill -9`, an exception, a stop while the replay table is full), its restarted
process finds the rollout here and inserts it first, so a completed rollout is never lost; a
rollout still being generated is not complete and is not kept (its tokens are simply dropped).
The writer validates before it sends anything, so a half-written rollout never reaches replay.

Folder layout (`<run_dir>/spool/actor_<id>/`):
  <seq>.pkl    one pending rollout (pickled; written to a temporary name, then renamed)
  ledger.log   one line per event, appended with a single write: "put SEQ" (completed),
               "ins SEQ" (confirmed in replay), "rej SEQ REASON" (refused by the writer's
               validation, REASON from replay.REJECT_REASONS); and for admission control
               "ask K" (about to ask for K rollouts), "adm G" (G granted), "rel R" (R slots
               returned to the variable server). Its counts are the actor's durable counters:
               completed = puts, inserted = ins lines, and so on.

Admission slots (variables/server.py): a rollout admitted but never inserted (refused by the
writer, or lost in generation when the actor died) would hold its slot for ever, and enough of
them stall the run. `owed_releases()` is what a (restarted) actor owes back: admitted, minus
inserted, minus still pending here, minus already returned; an "ask" whose answer never made
it to the ledger counts as granted (returning a slot too many only loosens admission).

What survives a crash at each point: before the rename, nothing was completed (the temporary
file is deleted at the next start); between the rename and "put", the start-up scan adds the
missing "put"; between the confirmed insert and "ins", the rollout is inserted again at the next
start (at-least-once: a duplicate in replay, which `RolloutSpool.counts` cannot see; compare
replay's own insert counter to spot one).

Plain files, no fsync: a process crash loses nothing written; a machine crash may.
"""
from __future__ import annotations

import collections
import os
import pickle
import re
import threading
from typing import Dict, List, Tuple

from absl import logging

LEDGER = "ledger.log"
_PENDING_RE = re.compile(r"^(\d{12})\.pkl$")


def spool_dir(run_dir: str, actor_id: int) -> str:
    """Where actor `actor_id` of a run keeps its spool."""
    return os.path.join(run_dir, "spool", f"actor_{actor_id}")


def read_ledger(directory: str) -> Dict[str, object]:
    """Counts from a spool's ledger: completed, inserted, rejected (by reason), pending, and
    admitted / released admission slots."""
    puts, ins, rej = set(), set(), {}
    admitted = released = 0
    asked = None               # an "ask" not yet answered by "adm"
    path = os.path.join(directory, LEDGER)
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 2 or not parts[1].isdigit():
                    continue   # a torn last line
                seq = int(parts[1])
                if parts[0] == "ask":
                    asked = seq
                elif parts[0] == "adm":
                    admitted += seq
                    asked = None
                elif parts[0] == "rel":
                    released += seq
                elif parts[0] == "put":
                    puts.add(seq)
                elif parts[0] == "ins":
                    ins.add(seq)
                elif parts[0] == "rej" and len(parts) >= 3:
                    rej[seq] = parts[2]
    pending = [int(m.group(1)) for name in (os.listdir(directory) if os.path.isdir(directory)
                                           else ()) if (m := _PENDING_RE.match(name))]
    return {"completed": len(puts | ins | set(rej)), "inserted": len(ins),
            "rejected": dict(collections.Counter(rej.values())),
            "pending": len([s for s in pending if s not in ins and s not in rej]),
            "admitted": admitted + (asked or 0), "released": released,
            "seqs": (puts, ins, rej)}


class RolloutSpool:
    """The on-disk spool of one actor (see the module docstring). Not shared between processes:
    one actor process per folder at a time."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._lock = threading.Lock()
        self._ledger = os.open(os.path.join(directory, LEDGER),
                               os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        counts = read_ledger(directory)
        self._admitted, self._released = counts["admitted"], counts["released"]
        puts, ins, rej = counts["seqs"]
        seen = set(puts) | set(ins) | set(rej)
        self._inserted = len(ins)
        self._rejected = collections.Counter(rej.values())
        self._completed = len(seen)
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if name.endswith(".tmp"):
                os.remove(path)            # never completed
                continue
            m = _PENDING_RE.match(name)
            if not m:
                continue
            seq = int(m.group(1))
            if seq in ins or seq in rej:
                os.remove(path)            # confirmed before the crash; its ledger line made it
            elif seq not in puts:
                self._append(f"put {seq}")  # completed, ledger line lost
                self._completed += 1
            seen.add(seq)
        self._next_seq = max(seen) + 1 if seen else 0

    # --- counters -----------------------------------------------------------------------------
    @property
    def completed(self) -> int:
        """Rollouts ever put here (this run, all incarnations of the actor)."""
        return self._completed

    @property
    def inserted(self) -> int:
        """Rollouts confirmed in replay."""
        return self._inserted

    @property
    def rejected(self) -> Dict[str, int]:
        """Rollouts the writer refused, by reason."""
        return dict(self._rejected)

    def owed_releases(self) -> int:
        """Admission slots to return: admitted, minus inserted, minus pending, minus returned
        (rollouts refused by the writer or lost in generation with a crashed actor)."""
        pending = len([n for n in os.listdir(self.directory) if _PENDING_RE.match(n)])
        return max(0, self._admitted - self._inserted - pending - self._released)

    def asking(self, count: int) -> None:
        """About to ask admission for `count` rollouts."""
        self._append(f"ask {int(count)}")

    def admitted(self, granted: int) -> None:
        """Admission granted `granted` rollouts (0 included: it answers the "ask")."""
        self._append(f"adm {int(granted)}")
        self._admitted += int(granted)

    def released(self, count: int) -> None:
        """`count` slots were returned to the variable server."""
        if count:
            self._append(f"rel {int(count)}")
            self._released += int(count)

    def pending(self) -> List[Tuple[int, object]]:
        """(seq, rollout) of every rollout not yet confirmed, oldest first."""
        out = []
        for name in sorted(os.listdir(self.directory)):
            m = _PENDING_RE.match(name)
            if not m:
                continue
            path = os.path.join(self.directory, name)
            try:
                with open(path, "rb") as f:
                    out.append((int(m.group(1)), pickle.load(f)))
            except Exception as e:  # noqa: BLE001 - unreadable: count it, never insert it
                logging.warning("RolloutSpool: %s is unreadable (%s); dropped", path, e)
                self.rejected_seq(int(m.group(1)), "unreadable_spool_file")
        return out

    # --- events ---------------------------------------------------------------------------------
    def put(self, rollout) -> int:
        """Keeps a completed rollout; returns its sequence number."""
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
        path = self._path(seq)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(rollout, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        self._append(f"put {seq}")
        with self._lock:
            self._completed += 1
        return seq

    def inserted_seq(self, seq: int) -> None:
        """Replay confirmed rollout `seq`: forget it."""
        self._append(f"ins {seq}")
        with self._lock:
            self._inserted += 1
        self._remove(seq)

    def rejected_seq(self, seq: int, reason: str) -> None:
        """The writer refused rollout `seq` (invalid): forget it, counting `reason`."""
        self._append(f"rej {seq} {reason.replace(' ', '_')}")
        with self._lock:
            self._rejected[reason] += 1
        self._remove(seq)

    def close(self) -> None:
        if self._ledger is not None:
            os.close(self._ledger)
            self._ledger = None

    def _path(self, seq: int) -> str:
        return os.path.join(self.directory, f"{seq:012d}.pkl")

    def _remove(self, seq: int) -> None:
        try:
            os.remove(self._path(seq))
        except FileNotFoundError:
            pass

    def _append(self, line: str) -> None:
        os.write(self._ledger, (line + "\n").encode())
