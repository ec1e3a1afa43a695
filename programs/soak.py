"""Soak test: a long SAO run while nodes are killed at random, then where every rollout went.

  python programs/soak.py --run_dir=runs/soak --max_steps=300 --num_actors=4 \
      --kill_every_s=10 --kill_targets=replay,actor,learner,evaluator,variables

Runs the normal SAO program (every SAOConfig field is a flag; the defaults below differ from
programs/sao.py: restarts for every group that can restart, learner checkpoints every 10 steps,
frequent replay checkpoints) and, while it runs, every `kill_every_s` seconds on average
(uniformly 0.5x-1.5x) picks a running node of a random target group and

  any of actor, learner, evaluator, variables, replay: sends it SIGKILL (local_mp) or kills
    its Ray actor process: the launcher restarts it after its backoff. The learner resumes from
    its checkpoint and journal; replay comes back with its last periodic checkpoint (older
    items, some already trained: skipped by key) or empty; actors re-send what the learner
    never acknowledged once it reports the loss epoch. With --replay_kill=restart replay is
    restarted on request instead (a cooperative stop that checkpoints).

At the end it prints and writes `<run_dir>/soak_report.json`: steps done, restarts by node,
faults injected, and the rollout accounting of sao_actor_learner/accounting.py, by key:
completed, trained, dropped (by reason), held in spools, duplicates skipped, lost, forgotten
early and consumed twice. Exits with status 1 when any rollout was lost, forgotten early or
consumed twice, or the run did not finish.
"""
import json
import os
import random
import signal
import sys
import threading
import time

from absl import app, flags

from sao_actor_learner.accounting import rollout_accounting
from sao_actor_learner.builder import make_program
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.flags import config_from_flags, define_flags_from_dataclass
from sao_actor_learner.observers import write_json_atomic
from sao_actor_learner.run import run_program

SOAK_DEFAULTS = dict(run_dir="runs/soak", max_steps=300, num_actors=4, batch_size=16,
                     actor_batch=4, max_staleness=4, eval_every=100, eval_size=100,
                     checkpoint_every=10, keep_checkpoints=3,
                     restart_groups=("actor", "evaluator", "learner", "replay", "variables"),
                     max_restarts=1000, restart_backoff_s=0.5, replay_checkpoint_every_s=5.0)
define_flags_from_dataclass(SAOConfig)
for _name, _value in SOAK_DEFAULTS.items():
    flags.FLAGS.set_default(_name, list(_value) if isinstance(_value, tuple) else _value)
flags.DEFINE_float("kill_every_s", 10.0, "Mean seconds between injected faults.")
flags.DEFINE_list("kill_targets", ["replay", "actor", "learner", "evaluator", "variables"],
                  "Groups to hit, drawn uniformly (repeat one to weight it).")
flags.DEFINE_enum("replay_kill", "sigkill", ["restart", "sigkill"],
                  "How replay is hit: SIGKILL, or a cooperative restart (checkpoint on stop).")
flags.DEFINE_integer("soak_seed", 0, "Seed of the fault schedule.")
flags.DEFINE_integer("max_faults", 0, "Stop injecting after this many faults (0: until the end).")
flags.DEFINE_bool("progress", True, "Show a progress line.")
FLAGS = flags.FLAGS


class FaultInjector:
    """Kills or restarts random running nodes of a launched program until stopped."""

    def __init__(self, launched, targets, every_s: float, replay_kill: str, seed: int,
                 max_faults: int = 0) -> None:
        self.launched, self.targets, self.every_s = launched, list(targets), every_s
        self.max_faults = max_faults
        self.replay_kill = replay_kill
        self.rng = random.Random(seed)
        self.faults = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name="fault-injector")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _main(self) -> None:
        while not self._stop.wait(self.every_s * self.rng.uniform(0.5, 1.5)):
            statuses = self.launched.statuses
            if statuses.get("learner") == ["finished"] or self.launched.stopped:
                return
            if self.max_faults and len(self.faults) >= self.max_faults:
                return
            group = self.rng.choice(self.targets)
            running = [n for n in self.launched.nodes_info()
                       if n["label"] == group and n["status"] == "running" and n["pid"]]
            if not running:
                continue
            node = self.rng.choice(running)
            fault = {"time": time.time(), "node": node["name"], "pid": node["pid"]}
            try:
                if group == "replay" and self.replay_kill == "restart":
                    fault["fault"] = "restart_node"
                    self.launched.restart_node(node["name"])
                else:
                    fault["fault"] = "SIGKILL"
                    os.kill(node["pid"], signal.SIGKILL)
            except (RuntimeError, KeyError, ProcessLookupError, TimeoutError) as e:
                fault["skipped"] = f"{type(e).__name__}: {e}"
            self.faults.append(fault)
            print(f"\n[soak] {fault}", flush=True)


def main(argv):
    del argv
    try:
        config = config_from_flags(SAOConfig)
    except ConfigError as e:
        sys.exit(f"invalid configuration: {e}")
    targets = [t.strip() for t in FLAGS.kill_targets if t.strip()]
    unknown = sorted(set(targets) - {"actor", "learner", "evaluator", "replay", "variables"})
    if unknown or not targets:
        sys.exit(f"--kill_targets={FLAGS.kill_targets}: each must be one of actor, learner, "
                 f"evaluator, replay, variables (got {unknown or 'none'})")
    if FLAGS.kill_every_s <= 0:
        sys.exit(f"--kill_every_s={FLAGS.kill_every_s}: must be > 0")
    if FLAGS.max_faults < 0:
        sys.exit(f"--max_faults={FLAGS.max_faults}: must be >= 0 (0: no limit)")
    restarted_on_request = {"replay"} if FLAGS.replay_kill == "restart" else set()
    missing = sorted(set(targets) - restarted_on_request - set(config.restart_groups))
    if missing:
        sys.exit(f"--kill_targets names {missing}, which --restart_groups does not restart: "
                 "the run would fail at the first kill; add them to --restart_groups")
    injectors = []

    def inject(launched):
        injector = FaultInjector(launched, targets, FLAGS.kill_every_s, FLAGS.replay_kill,
                                 FLAGS.soak_seed, FLAGS.max_faults)
        injectors.append(injector)
        injector.start()

    t0 = time.time()
    try:
        summary = run_program(config, make_program, progress=FLAGS.progress, on_launch=inject)
    finally:
        for injector in injectors:
            injector.stop()
    wall = time.time() - t0
    faults = injectors[0].faults if injectors else []
    accounting = rollout_accounting(config.run_dir)
    report = {
        "command": " ".join(sys.argv),
        "wall_time_s": round(wall, 1),
        "steps": accounting["learner_version"],
        "max_steps": config.max_steps,
        "faults_injected": len([f for f in faults if "skipped" not in f]),
        "faults_by_node": _count(f["node"] for f in faults if "skipped" not in f),
        "restarts": summary.get("restarts", {}),
        "restarts_total": sum(summary.get("restarts", {}).values()),
        "eval_accuracy": {"initial": summary.get("initial_eval_accuracy"),
                          "final": summary.get("final_eval_accuracy")},
        "rollouts": {
            "completed": accounting["completed"],
            "sent_once": accounting["sent_once"],
            "resent": accounting["resent"],
            "trained": accounting["trained"],
            "value_pretraining": accounting["value_pretraining"],
            "dropped": {"stale (learner: staler than max_staleness)":
                        accounting["dropped_stale"],
                        "from the future (learner: a version newer than its own)":
                        accounting["refused_from_future"],
                        **{f"refused by the actor's check: {k}": v
                           for k, v in accounting["refused"].items()}},
            "consumed_keys": accounting["consumed"],
            "held_in_actor_spools_at_end": accounting["held"],
            "in_learner_journal_at_end": accounting["in_learner_journal"],
            "duplicates_skipped": accounting["duplicates"],
            "lost": accounting["lost"],
            "forgot_early": accounting["forgot_early"],
            "consumed_twice": accounting["consumed_twice"],
        },
        "faults": faults,
    }
    write_json_atomic(os.path.join(config.run_dir, "soak_report.json"), report)
    shown = {k: v for k, v in report.items() if k != "faults"}
    print(json.dumps(shown, indent=2))
    print(f"soak: {report['steps']}/{config.max_steps} steps in {wall:.0f}s, "
          f"{report['faults_injected']} faults, {report['restarts_total']} restarts, "
          f"{accounting['completed']} completed, {accounting['trained']} trained, "
          f"{accounting['dropped_stale']} dropped stale, {accounting['held']} held, "
          f"{accounting['duplicates']} duplicates skipped, {accounting['lost']} lost, "
          f"{accounting['forgot_early']} forgotten early, {accounting['consumed_twice']} "
          f"consumed twice; report at {config.run_dir}/soak_report.json")
    if accounting["lost"] or accounting["forgot_early"] or accounting["consumed_twice"] or \
            report["steps"] != config.max_steps:
        sys.exit(1)


def _count(items):
    out = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


if __name__ == "__main__":
    app.run(main)
