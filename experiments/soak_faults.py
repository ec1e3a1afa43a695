"""The soak test's fault machinery: what programs/soak.py does to a running program, and what it
watches while it does it.

  FaultInjector     every `every_s` seconds on average (uniformly 0.5x-1.5x) picks a running
                    node of a random target group and a random fault kind:
                      sigkill  SIGKILL (or, for replay with replay_kill="restart", a cooperative
                               restart that checkpoints): the launcher restarts it after its
                               backoff;
                      sigstop  SIGSTOP: the node hangs, alive but silent. The launcher's liveness
                               check (--node_timeout_s, launch/liveness.py) must kill and restart
                               it; if the process is still stopped long after that deadline the
                               injector sends SIGCONT itself and records the hang as undetected
                               (a soak failure);
                      drain    a stranger's Reverb client samples every item the replay table
                               holds (as anyone who reaches the port could): the learner's loss
                               detection (--replay_loss_timeout_s, replay/loss.py) must notice and
                               start a loss epoch so the actors re-send from their spools.
  ProgressMonitor   samples the learner's step (metrics.jsonl) twice a second: the stalls (the
                    longest times without a new step) and, for each drain, how long until the
                    learner's loss epoch moved.

Everything here acts on a `launch.Launched` (nodes_info, restart_node, statuses) from outside
its processes, as an operator or an attacker would.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Dict, List, Optional

from sao_actor_learner.observers import read_metrics

FAULT_KINDS = ("sigkill", "sigstop", "drain")
TARGET_GROUPS = ("replay", "actor", "learner", "learner_store", "evaluator", "variables")


def process_stopped(pid: int) -> bool:
    """Whether process `pid` exists and is stopped (state T in /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class FaultInjector:
    """Injects faults into a launched program until stopped (module docstring).

    Args:
      launched: the running program (launch.Launched).
      targets: group labels to hit, drawn uniformly (repeat one to weight it).
      kinds: fault kinds drawn uniformly ("sigkill", "sigstop"); "drain" is scheduled
        separately (`drain_every_s`), since it hits the table, not a node.
      every_s: mean seconds between node faults.
      node_timeout_s: the program's liveness timeout (a SIGSTOPped node must be gone after it).
      replay_kill: "sigkill" or "restart" (a cooperative restart of replay).
      seed: the schedule's seed. max_faults: stop after this many node faults (0: no limit).
      drain_every_s: mean seconds between drains (0: none); max_drains: at most this many.
      table: the replay table's name.
      faults: a list to append fault records to, shared across the launches of one soak: the
        limits count every launch's faults.
    """

    def __init__(self, launched, targets, kinds, every_s: float, node_timeout_s: float,
                 replay_kill: str, seed: int, max_faults: int = 0, drain_every_s: float = 0.0,
                 max_drains: int = 0, table: str = "", faults: Optional[List[dict]] = None
                 ) -> None:
        self.launched, self.targets, self.kinds = launched, list(targets), list(kinds)
        self.every_s, self.node_timeout_s = every_s, node_timeout_s
        self.max_faults, self.replay_kill = max_faults, replay_kill
        self.drain_every_s, self.max_drains, self.table = drain_every_s, max_drains, table
        self.rng = random.Random(seed)
        self.faults = faults if faults is not None else []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._nodes_main, daemon=True,
                                          name="fault-injector")]
        if drain_every_s > 0:
            self._threads.append(threading.Thread(target=self._drain_main, daemon=True,
                                                  name="replay-drainer"))
        self._hung: List[dict] = []     # SIGSTOP faults whose process may still be stopped

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        for fault in self._hung:        # never leave a stopped process behind
            self._release(fault)

    def _done(self) -> bool:
        return self.launched.stopped or self.launched.statuses.get("learner", [""])[0] == "finished"

    def node_faults(self) -> int:
        return len([f for f in self.faults if "skipped" not in f and f["fault"] != "drain"])

    def _nodes_main(self) -> None:
        due = time.monotonic() + self.every_s * self.rng.uniform(0.5, 1.5)
        while not self._stop.wait(min(1.0, max(0.0, due - time.monotonic()))):
            self._check_hangs()   # every second: a hang's end is timed to about a second
            if time.monotonic() < due:
                continue
            due = time.monotonic() + self.every_s * self.rng.uniform(0.5, 1.5)
            if self._done() or (self.max_faults and self.node_faults() >= self.max_faults):
                continue
            group = self.rng.choice(self.targets)
            kind = self.rng.choice(self.kinds)
            running = [n for n in self.launched.nodes_info()
                       if n["label"] == group and n["status"] == "running" and n["pid"]]
            if not running:
                continue
            node = self.rng.choice(running)
            fault = {"time": time.time(), "node": node["name"], "pid": node["pid"]}
            try:
                if kind == "sigstop":
                    fault["fault"] = "SIGSTOP"
                    os.kill(node["pid"], signal.SIGSTOP)
                    self._hung.append(fault)
                elif group == "replay" and self.replay_kill == "restart":
                    fault["fault"] = "restart_node"
                    self.launched.restart_node(node["name"])
                else:
                    fault["fault"] = "SIGKILL"
                    os.kill(node["pid"], signal.SIGKILL)
            except (RuntimeError, KeyError, ProcessLookupError, TimeoutError) as e:
                fault["skipped"] = f"{type(e).__name__}: {e}"
            self.faults.append(fault)
            print(f"\n[soak] {fault}", flush=True)

    def _check_hangs(self) -> None:
        """A SIGSTOPped process gone (killed by the liveness check) is settled; one still
        stopped well past node_timeout_s is a hang the launcher missed: released, recorded."""
        deadline = 2 * self.node_timeout_s + 15.0
        for fault in list(self._hung):
            if not process_stopped(fault["pid"]):
                fault["ended_after_s"] = round(time.time() - fault["time"], 1)
                self._hung.remove(fault)
            elif time.time() - fault["time"] > deadline:
                fault["undetected"] = True
                self._release(fault)

    def _release(self, fault: dict) -> None:
        if fault in self._hung:
            self._hung.remove(fault)
        try:
            if process_stopped(fault["pid"]):
                fault["undetected"] = True
                os.kill(fault["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass

    def _drain_main(self) -> None:
        while not self._stop.wait(self.drain_every_s * self.rng.uniform(0.5, 1.5)):
            drains = len([f for f in self.faults if f["fault"] == "drain" and "skipped" not in f])
            if self._done() or (self.max_drains and drains >= self.max_drains):
                continue
            fault = {"time": time.time(), "node": "replay_0", "fault": "drain"}
            try:
                fault["items_taken"] = self._drain()
            except Exception as e:   # replay down right now (another fault): try again later
                fault["skipped"] = f"{type(e).__name__}: {e}"
            self.faults.append(fault)
            print(f"\n[soak] {fault}", flush=True)

    def _drain(self, window_s: float = 3.0) -> int:
        """For `window_s` seconds samples away every item that reaches the table (racing the
        learner for them), as a stranger's plain Reverb client would."""
        from sao_actor_learner.replay import RolloutReader   # imports reverb: only when draining

        address = next(n["address"] for n in self.launched.nodes_info()
                       if n["label"] == "replay")
        reader = RolloutReader(address, **({"table": self.table} if self.table else {}))
        taken, end = 0, time.monotonic() + window_s
        try:
            while time.monotonic() < end:
                taken += len(reader.sample(64, timeout_s=0.2))
            return taken
        finally:
            reader.close()


class ProgressMonitor:
    """Samples the learner's progress (its newest train row) twice a second."""

    def __init__(self, run_dir: str, period_s: float = 0.5) -> None:
        self.run_dir, self.period_s = run_dir, period_s
        self.samples: List[tuple] = []        # (time, newest step, loss_epoch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name="soak-monitor")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def step(self) -> int:
        return self.samples[-1][1] if self.samples else 0

    def _main(self) -> None:
        while not self._stop.wait(self.period_s):
            train = read_metrics(self.run_dir, "train")
            step = max((r["step"] for r in train), default=0)
            epoch = train[-1].get("loss_epoch", 0) if train else 0
            self.samples.append((time.time(), step, epoch))

    def stalls(self, pauses=()) -> List[Dict]:
        """Intervals without a new step, longest first; time inside `pauses` ((start, end):
        the program deliberately stopped for the mid-soak resume) is not counted."""
        out, best, since = [], 0, None
        for t, step, _ in self.samples:
            if since is None:
                since = t
            if step > best:
                if best > 0:
                    paused = sum(max(0.0, min(t, e) - max(since, s)) for s, e in pauses)
                    out.append({"from_step": best, "start": since, "s": round(t - since - paused, 1)})
                best, since = step, t
        return sorted(out, key=lambda s: -s["s"])

    def loss_epoch_after(self, t0: float) -> Optional[float]:
        """Seconds from `t0` until a train row showed a loss epoch higher than at t0."""
        before = [e for t, _, e in self.samples if t <= t0]
        base = before[-1] if before else 0
        for t, _, epoch in self.samples:
            if t > t0 and epoch > base:
                return round(t - t0, 1)
        return None
