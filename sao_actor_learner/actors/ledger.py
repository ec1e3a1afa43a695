"""An actor spool's ledger (spool.py): reading it, and compacting it so it stays small.

`ledger.log` is appended one line per event (the kinds are in spool.py's docstring). Left
alone it grows with every rollout the actor ever made, and every actor start re-reads it
whole. `compacted_lines(state)` says the same thing in few lines: the admission totals, the
acknowledged seqs as ranges, the count of rollouts sent, refusals by reason, and one "put"
(and "sent") line per rollout still held. Its extra line kinds:

  "adm A" / "rel R"     totals (as the per-event lines, which they replace, added up)
  "acks LO HI"          every seq in [LO, HI) completed and acknowledged
  "sentn N"             N acknowledged rollouts were sent (their per-seq "sent" lines dropped)
  "rejn N REASON"       N rollouts refused for REASON

so `read_ledger` of a compacted ledger returns exactly what it returned before compaction
(except the per-seq send epochs of acknowledged rollouts, which nothing uses: `sent_once`
keeps their count). The spool rewrites its ledger this way when it starts and whenever the
ledger has grown by `max(COMPACT_MIN_BYTES, 2 x its compacted size)` since (temporary file,
fsync, rename: a crash leaves the old ledger or the new one, both complete), so the ledger
holds O(rollouts held + holes in the acknowledged seqs) lines, not O(rollouts made).

Standard library only.
"""
from __future__ import annotations

import collections
import os
import re
from typing import Dict, Iterable, List, Tuple

LEDGER = "ledger.log"
COMPACT_MIN_BYTES = 1 << 20
PENDING_RE = re.compile(r"^(\d{12})\.rollout$")
OLD_PENDING_RE = re.compile(r"^(\d{12})\.pkl$")   # pickled by earlier versions: never read


def ranges(seqs: Iterable[int]) -> List[Tuple[int, int]]:
    """Sorted, non-adjacent half-open ranges [lo, hi) covering exactly `seqs`."""
    out: List[List[int]] = []
    for s in sorted(set(seqs)):
        if out and out[-1][1] == s:
            out[-1][1] = s + 1
        else:
            out.append([s, s + 1])
    return [(lo, hi) for lo, hi in out]


def read_ledger(directory: str) -> Dict[str, object]:
    """What a spool's ledger and files hold: the seqs completed, sent (held or not yet
    compacted seq -> last epoch; `sent_once` counts every rollout ever sent), acknowledged and
    still held, rollouts refused before spooling (by reason), and admission slots admitted and
    released. A last line without its newline (torn by a crash) is ignored."""
    puts, acked, sent = set(), set(), {}
    refused: collections.Counter = collections.Counter()
    admitted = released = sent_acked = 0
    asked = None               # an "ask" not yet answered by "adm"
    path = os.path.join(directory, LEDGER)
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if not line.endswith("\n"):
                    break      # a torn last line
                parts = line.split()
                if len(parts) < 2 or not parts[1].isdigit():
                    continue
                n = int(parts[1])
                kind = parts[0]
                if kind == "ask":
                    asked = n
                elif kind == "adm":
                    admitted += n
                    asked = None
                elif kind == "rel":
                    released += n
                elif kind == "put":
                    puts.add(n)
                elif kind == "sent" and len(parts) >= 3 and parts[2].isdigit():
                    sent[n] = int(parts[2])
                elif kind == "ack":
                    acked.add(n)
                elif kind == "acks" and len(parts) >= 3 and parts[2].isdigit():
                    acked.update(range(n, int(parts[2])))
                elif kind == "sentn":
                    sent_acked += n
                elif kind == "rej" and len(parts) >= 3:
                    refused[parts[2]] += 1
                elif kind == "rejn" and len(parts) >= 3:
                    refused[parts[2]] += n
    files = {int(m.group(1)) for name in (os.listdir(directory) if os.path.isdir(directory)
                                          else ()) if (m := PENDING_RE.match(name))}
    return {"completed": puts | files | acked, "puts": puts, "sent": sent, "acked": acked,
            "held": files - acked, "refused": dict(refused),
            "sent_once": sent_acked + len(sent),
            "admitted": admitted + (asked or 0), "released": released,
            "asked": asked}


def compacted_lines(state: Dict[str, object]) -> List[str]:
    """The lines of a ledger that `read_ledger` reads back as `state` (one read_ledger
    returned, with the same files in the folder)."""
    acked = state["acked"]
    sent = state["sent"]
    asked = state.get("asked")
    lines = [f"adm {state['admitted'] - (asked or 0)}", f"rel {state['released']}"]
    if asked is not None:
        lines.append(f"ask {asked}")           # still unanswered: stays pending
    lines += [f"acks {lo} {hi}" for lo, hi in ranges(acked)]
    kept = state["completed"] - acked
    lines.append(f"sentn {state['sent_once'] - sum(1 for s in sent if s in kept)}")
    lines += [f"rejn {n} {reason}" for reason, n in sorted(state["refused"].items())]
    for seq in sorted(kept):
        lines.append(f"put {seq}")
        if seq in sent:
            lines.append(f"sent {seq} {sent[seq]}")
    return lines


def write_compacted(directory: str) -> int:
    """Rewrites the ledger in `directory` compacted (temporary file, fsync, rename); returns
    its size in bytes. The caller makes sure nobody appends meanwhile. Raises OSError."""
    path = os.path.join(directory, LEDGER)
    data = "".join(line + "\n" for line in compacted_lines(read_ledger(directory))).encode()
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return len(data)
