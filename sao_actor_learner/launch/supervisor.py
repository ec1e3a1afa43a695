"""Restart policies and the restart state machine that every launcher shares.

`restart={"actor": RestartPolicy(max_restarts=3, backoff_s=1.0)}` makes the launcher start a
node of group "actor" again when it crashes (an exception, a non-zero exit code, a signal such
as `kill -9`) instead of failing the program:

- Single restarts (the default): only the crashed node restarts, after `backoff_s`, doubling
  with each restart of the same node up to `max_backoff_s`, at most `max_restarts` times per
  node; one crash more fails the program with NodeFailedError naming the node.
- Together (`together=True`, e.g. the ranks of one torch.distributed group): a crash of any
  node of the group stops every other running node of the group (the cooperative stop with
  `notice_s`, then terminate and kill as `stop()` does) and starts all of them again after the
  backoff. The nodes of the group that had finished (run() returned) start again too, and
  nodes the launch has not started yet wait and start with the group, so the group's nodes
  always start together. Such a group restart counts once against `max_restarts` (the count
  and backoff are the group's), and every node's restart history records it, naming the node
  that died. Exits of the group's nodes while the group restart is under way (a peer that
  crashes because its rank died) are part of it. If the group restart cannot be carried out
  (a node that cannot be stopped, or one that fails to start), the program fails with an
  error naming the group and the node. A node that returns from run() normally does not
  restart the others; the group is finished when all its nodes are.
- `Launched.restart_node(name)` asks for a restart (a cooperative stop, then a fresh start at
  once, of the node's whole group if it restarts together); it never counts against
  `max_restarts`.
- A restarted service keeps its address; a node that returns from run() normally is
  finished, never restarted; nothing restarts once the program is stopping.
- A node the launcher killed because its heartbeat went silent (liveness.py) is a crash like
  any other; its history entry's reason is "hung" and a failure's headline says so.

`Supervisor.on_exit` decides what an exit means and does the bookkeeping (statuses, counts,
histories); the `Launched` that owns it carries out the `RestartPlan`s it returns.

Pure standard library.
"""
from __future__ import annotations

import dataclasses
import logging
import signal
import time
from typing import Dict, List, Mapping, Optional

from sao_actor_learner.launch.liveness import HUNG_PREFIX
from sao_actor_learner.launch.logs import describe_exit
from sao_actor_learner.launch.records import NodeRecord

__all__ = ["RestartPolicy", "RestartPlan", "Supervisor"]

_logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """How a launcher restarts the nodes of one group after they crash.

    max_restarts: restarts allowed per node, or per group when `together` (0: never restart);
      the crash after the last one fails the program with NodeFailedError.
    backoff_s: wait before the first restart; doubles with each further restart of the same
      node (of the group when `together`): 1, 2, 4, ... s, up to `max_backoff_s`.
    reset_after_s: an instance that ran at least this long before it crashed was not in a
      crash loop: its restart waits `backoff_s` again (the doubling starts over), so a long
      run's occasional crashes never accumulate to `max_backoff_s` each.
    together: a crash of any node of the group stops and restarts all of its nodes (see the
      module docstring).
    """
    max_restarts: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    together: bool = False
    reset_after_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts!r}: must be an int >= 0 (restarts "
                             "per node; 0 never restarts)")
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s={self.backoff_s}: must be >= 0 (seconds before the "
                             "first restart)")
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"max_backoff_s={self.max_backoff_s} < backoff_s={self.backoff_s}: "
                             "raise max_backoff_s")
        if not self.reset_after_s >= 0:
            raise ValueError(f"reset_after_s={self.reset_after_s}: must be >= 0 seconds")
        if not isinstance(self.together, bool):
            raise TypeError(f"together={self.together!r}: must be True or False")

    def delay(self, restart_number: int) -> float:
        """Seconds to wait before restart number `restart_number` (1-based)."""
        return min(self.backoff_s * 2.0 ** max(restart_number - 1, 0), self.max_backoff_s)


@dataclasses.dataclass(eq=False)
class RestartPlan:
    """One restart to carry out: stop `to_stop`, wait until `due`, start every member again."""
    group: str
    cause: NodeRecord                 # the node whose exit began it
    members: List[NodeRecord]         # the nodes to start again (services first, then PyNodes)
    to_stop: List[NodeRecord]         # members still running when it began
    delay: float                      # its backoff
    requested: bool                   # restart_node() asked for it
    together: bool
    due: float                        # time.monotonic() before which nothing starts
    fresh: List[NodeRecord] = dataclasses.field(default_factory=list)  # never started yet

    def what(self) -> str:
        """"group 'dp' (after dp_1 crashed)" or "node actor_0", for messages."""
        if not self.together:
            return f"node {self.cause.name}"
        why = "restart was requested" if self.requested else "crashed"
        return f"group {self.group!r} (after {self.cause.name} {why})"


def _hung(r: NodeRecord) -> bool:
    """Whether r's last instance was killed for a silent heartbeat (liveness.py)."""
    return (r.error or "").startswith(HUNG_PREFIX)


class _BackoffStreak:
    """Crashes in a row of one node (or together-group) whose instance had run for less than
    `reset_after_s`: the exponent of its next backoff (RestartPolicy)."""

    def __init__(self) -> None:
        self.streak = 0
        self.started = time.monotonic()    # when the current instance was due to start

    def next_delay(self, policy: RestartPolicy) -> float:
        now = time.monotonic()
        if now - self.started >= policy.reset_after_s:
            self.streak = 0
        self.streak += 1
        delay = policy.delay(self.streak)
        self.started = now + delay
        return delay


class _GroupState:
    """A together-group's own restart count and history."""

    def __init__(self, label: str, policy: RestartPolicy, records: List[NodeRecord]) -> None:
        self.label, self.policy, self.records = label, policy, records
        self.restarts = 0
        self.history: List[dict] = []
        self.backoff = _BackoffStreak()


class Supervisor:
    """Decides, for each exit of a node, whether it finished, failed or restarts (and with
    which nodes). Every method must be called with the owning `Launched`'s lock held."""

    def __init__(self, program_name: str, policies: Mapping[str, RestartPolicy],
                 records: List[NodeRecord]) -> None:
        groups: Dict[str, List[NodeRecord]] = {}
        for r in records:
            groups.setdefault(r.label, []).append(r)
        self.policies: Dict[str, RestartPolicy] = {}
        for label, policy in policies.items():
            if not isinstance(policy, RestartPolicy):
                raise TypeError(f"restart[{label!r}]={policy!r}: expected a RestartPolicy")
            if label not in groups:
                _logger.info("restart policy for group %r, which program %r lacks; ignored",
                             label, program_name)
                continue
            self.policies[label] = policy
        self._groups = {label: _GroupState(label, policy, groups[label])
                        for label, policy in self.policies.items() if policy.together}
        self._backoff: Dict[str, _BackoffStreak] = {}   # node name -> its crash streak

    # ---------------------------------------------------------------------------- exits
    def on_exit(self, r: NodeRecord, exitcode: int, error: Optional[str],
                stopping: bool) -> Optional[RestartPlan]:
        """Records that r's current instance ended; returns a new plan to carry out, if any."""
        r.exitcode, r.error = exitcode, error
        requested, r.restart_requested = r.restart_requested, False
        state = self._groups.get(r.label)
        if stopping:
            r.plan = None
            self._settle(r, stopping)
            return None
        if r.plan is not None:         # its group's restart is under way: this exit is part
            self._enter_restarting(r, r.plan)
            return None
        policy = self.policies.get(r.label)
        count = state.restarts if state is not None else r.restarts
        if requested or (exitcode != 0 and policy is not None and count < policy.max_restarts):
            return self._begin(r, requested, policy, state)
        self._settle(r, stopping)
        return None

    def _settle(self, r: NodeRecord, stopping: bool) -> None:
        if r.exitcode == 0:
            r.status = "finished"
        elif r.killed and r.exitcode in (-signal.SIGTERM, -signal.SIGKILL):
            r.status = "killed"
        else:
            r.status = "failed"
            if not stopping:
                restarts = self._restart_count(r)
                tried = f" after {restarts} restarts" if restarts else ""
                _logger.error("node %s failed (exit code %s)%s; see %s", r.name, r.exitcode,
                              tried, r.log_path or "its traceback")

    def _begin(self, r: NodeRecord, requested: bool, policy: Optional[RestartPolicy],
               state: Optional[_GroupState]) -> RestartPlan:
        if state is not None:
            members = [m for m in state.records
                       if m is r or m.status in ("running", "finished", "pending")]
        else:
            members = [r]
        fresh = [m for m in members if m.status == "pending"]
        started = [m for m in members if m not in fresh]
        if requested:
            delay = 0.0
            for m in started:
                m.requested_restarts += 1
        else:
            if state is not None:
                state.restarts += 1
                number = state.restarts
            else:
                number = r.restarts + 1
            for m in started:
                m.restarts += 1
            del number   # counts against max_restarts; the backoff follows the crash streak
            streak = state.backoff if state is not None else self._backoff.setdefault(
                r.name, _BackoffStreak())
            delay = streak.next_delay(policy)
        plan = RestartPlan(group=r.label, cause=r, members=members,
                           to_stop=[m for m in members if m.status == "running" and m is not r],
                           delay=delay, requested=requested, together=state is not None,
                           due=time.monotonic() + delay, fresh=fresh)
        for m in members:
            m.plan = plan
            if m in fresh:
                m.status = "restarting"      # it waits for the group; the launch leaves it
            elif m.status != "running" or m is r:
                self._enter_restarting(m, plan)
        if state is not None:
            state.history.append({"time": time.time(), "cause": r.name, "exitcode": r.exitcode,
                                  "requested": requested, "backoff_s": delay,
                                  "nodes": [m.name for m in members]})
        if not requested:
            what = (f"; restarting the {len(members)} nodes of group {r.label!r} together"
                    if state is not None else "")
            _logger.warning("node %s %s (exit code %s%s)%s; restart %d of %d in %.1f s",
                            r.name, "hung" if _hung(r) else "crashed", r.exitcode,
                            describe_exit(r.exitcode), what,
                            self._restart_count(r), policy.max_restarts, delay)
        return plan

    def _enter_restarting(self, m: NodeRecord, plan: RestartPlan) -> None:
        if m is plan.cause:
            reason = "requested" if plan.requested else ("hung" if _hung(m) else "crashed")
        else:
            why = "restart requested" if plan.requested else "crashed"
            reason = f"group {plan.group}: {plan.cause.name} {why}"
        entry = {"time": time.time(), "pid": m.pid, "exitcode": m.exitcode, "reason": reason,
                 "backoff_s": plan.delay, "error": (m.error or "")[-2000:] or None}
        if plan.together:
            entry.update(group=plan.group, cause=plan.cause.name)
        m.history.append(entry)
        m.status = "restarting"
        m.killed = False

    # ---------------------------------------------------------------------------- plans
    def plan_started(self, plan: RestartPlan) -> None:
        """The members' new instances are about to start: later exits are new events."""
        for m in plan.members:
            if m.plan is plan:
                m.plan = None

    def plan_failed(self, plan: RestartPlan, node: NodeRecord, why: str) -> None:
        """The plan could not be carried out because of `node`: it fails the program."""
        self.plan_started(plan)
        node.status = "failed"
        node.headline = f"{plan.what()} could not be restarted: node {node.name} {why}"
        _logger.error("%s", node.headline)

    # --------------------------------------------------------------------------- reports
    def _restart_count(self, r: NodeRecord) -> int:
        state = self._groups.get(r.label)
        return state.restarts if state is not None else r.restarts

    def failure_headline(self, r: NodeRecord) -> str:
        """The first line of the NodeFailedError that r's failure raises."""
        if r.headline:
            return r.headline
        headline = f"node {r.name} failed (exit code {r.exitcode}{describe_exit(r.exitcode)})"
        if _hung(r):    # killed by the launcher's liveness check (liveness.py)
            headline += f", {r.error}"
        restarts = self._restart_count(r)
        if restarts and r.label in self._groups:
            headline += (f" after {restarts} restarts of group {r.label!r} (its max_restarts; "
                         "the group restarts together)")
        elif restarts:
            headline += f" after {restarts} restarts (max_restarts of its group)"
        return headline

    @property
    def group_restarts(self) -> Dict[str, int]:
        """label -> how many times each together-group restarted after a crash."""
        return {label: s.restarts for label, s in self._groups.items()}

    def groups_info(self) -> Dict[str, dict]:
        """label -> a together-group's entry in nodes.json."""
        return {label: {"together": True, "max_restarts": s.policy.max_restarts,
                        "nodes": [r.name for r in s.records], "restarts": s.restarts,
                        "restart_history": list(s.history)}
                for label, s in self._groups.items()}
