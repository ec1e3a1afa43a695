"""Soak test: a long SAO run while nodes are killed, hung and robbed, then where every rollout went.

  python programs/soak.py --run_dir=runs/soak --max_steps=300 --num_actors=4 \
      --kill_every_s=6 --faults=sigkill,sigstop --drain_every_s=40 --resume_at_step=150

Runs the normal SAO program (every SAOConfig field is a flag; the defaults below differ from
programs/sao.py: restarts for every group that can restart, learner checkpoints every 10 steps,
frequent replay checkpoints, a 15 s liveness timeout) and, while it runs, injects the faults of
experiments/soak_faults.py:

  sigkill  SIGKILL of a random running node of --kill_targets (local_mp): the launcher restarts
           it after its backoff. The learner resumes from its checkpoint and journal; replay
           comes back with its last periodic checkpoint (older items, some already trained:
           skipped by key) or empty; actors re-send what the learner never acknowledged once it
           reports the loss epoch. With --replay_kill=restart replay is restarted on request.
  sigstop  SIGSTOP (a hang): the launcher's liveness check (--node_timeout_s) must kill it and
           restart it as after a crash; a process still stopped long after that fails the soak.
  drain    every --drain_every_s a stranger's Reverb client samples away every item in the table;
           the learner's loss detection (--replay_loss_timeout_s) must start a loss epoch so the
           actors re-send them (a learner group's ranks count their fetches together and rank 0
           judges: replay/loss.py).
  resume   with --resume_at_step=N, once the learner has done N steps the whole program is
           stopped and launched again with --resume on the same run_dir (faults continue).

With --learners=2 the learner is a group of two ranks (and its rendezvous store, the group
`learner_store`, is a target too): a fault in any of them restarts the group together.

At the end it prints and writes `<run_dir>/soak_report.json`: steps done, faults by kind and node,
restarts by node, the stalls (longest times without a new learner step, with the faults in
each), for each drain how soon the learner trained on a new loss epoch, and the rollout accounting of
sao_actor_learner/accounting.py by key: completed, trained, dropped (by reason), held in spools,
duplicates skipped, lost, forgotten early, consumed twice. Exits with status 1 when any rollout
was lost, forgotten early or consumed twice, a hang went undetected, or the run did not finish.
"""
import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.soak_faults import TARGET_GROUPS, FaultInjector, ProgressMonitor  # noqa: E402
from sao_actor_learner.accounting import rollout_accounting  # noqa: E402
from sao_actor_learner.builder import make_program  # noqa: E402
from sao_actor_learner.config import ConfigError, SAOConfig  # noqa: E402
from sao_actor_learner.flags import config_from_flags, define_flags_from_dataclass  # noqa: E402
from sao_actor_learner.observers import write_json_atomic  # noqa: E402
from sao_actor_learner.run import run_program  # noqa: E402

SOAK_DEFAULTS = dict(run_dir="runs/soak", max_steps=300, num_actors=4, batch_size=16,
                     actor_batch=4, max_staleness=4, eval_every=100, eval_size=100,
                     checkpoint_every=10, keep_checkpoints=3,
                     restart_groups=("actor", "evaluator", "learner", "learner_store", "replay",
                                     "variables"),
                     max_restarts=1000, restart_backoff_s=0.5, replay_checkpoint_every_s=5.0,
                     node_timeout_s=15.0)
define_flags_from_dataclass(SAOConfig)
for _name, _value in SOAK_DEFAULTS.items():
    flags.FLAGS.set_default(_name, list(_value) if isinstance(_value, tuple) else _value)
flags.DEFINE_float("kill_every_s", 10.0, "Mean seconds between injected node faults.")
flags.DEFINE_list("kill_targets", ["replay", "actor", "learner", "evaluator", "variables"],
                  "Groups to hit, drawn uniformly (repeat one to weight it); learner_store "
                  "exists with --learners > 1.")
flags.DEFINE_list("faults", ["sigkill"], "Node fault kinds, drawn uniformly: sigkill (a crash), "
                  "sigstop (a hang, which the liveness check must end).")
flags.DEFINE_float("drain_every_s", 0.0, "Mean seconds between drains of the replay table by "
                   "a stranger's client (0: none).")
flags.DEFINE_integer("max_drains", 0, "At most this many drains (0: no limit).")
flags.DEFINE_integer("resume_at_step", 0, "Stop the whole program once the learner has done this "
                     "many steps and launch it again with --resume (0: never).")
flags.DEFINE_enum("replay_kill", "sigkill", ["restart", "sigkill"],
                  "How replay is hit: SIGKILL, or a cooperative restart (checkpoint on stop).")
flags.DEFINE_integer("soak_seed", 0, "Seed of the fault schedule.")
flags.DEFINE_integer("max_faults", 0, "Stop injecting node faults after this many (0: until the "
                     "end).")
flags.DEFINE_bool("progress", True, "Show a progress line.")
FLAGS = flags.FLAGS


def check_soak_flags(config: SAOConfig) -> None:
    """Exits with a message saying what to change when the soak's own flags are invalid."""
    targets = [t.strip() for t in FLAGS.kill_targets if t.strip()]
    unknown = sorted(set(targets) - set(TARGET_GROUPS))
    if unknown or not targets:
        sys.exit(f"--kill_targets={FLAGS.kill_targets}: each must be one of "
                 f"{', '.join(TARGET_GROUPS)} (got {unknown or 'none'})")
    if "learner_store" in targets and config.learners < 2:
        sys.exit("--kill_targets names learner_store, which exists only with --learners > 1")
    kinds = [k.strip() for k in FLAGS.faults if k.strip()]
    if not kinds or set(kinds) - {"sigkill", "sigstop"}:
        sys.exit(f"--faults={FLAGS.faults}: each must be sigkill or sigstop (drains: "
                 "--drain_every_s)")
    if "sigstop" in kinds and not config.node_timeout_s > 0:
        sys.exit("--faults names sigstop but --node_timeout_s=0 turns the liveness check off: "
                 "every hang would stall the run for ever; set --node_timeout_s > 0")
    if FLAGS.drain_every_s < 0 or FLAGS.max_drains < 0:
        sys.exit("--drain_every_s and --max_drains must be >= 0")
    if FLAGS.drain_every_s > 0 and not config.replay_loss_timeout_s > 0:
        sys.exit("--drain_every_s needs the learner's replay loss detection: "
                 "--replay_loss_timeout_s > 0 (replay/loss.py)")
    if FLAGS.kill_every_s <= 0:
        sys.exit(f"--kill_every_s={FLAGS.kill_every_s}: must be > 0")
    if FLAGS.max_faults < 0:
        sys.exit(f"--max_faults={FLAGS.max_faults}: must be >= 0 (0: no limit)")
    if not 0 <= FLAGS.resume_at_step < config.max_steps:
        sys.exit(f"--resume_at_step={FLAGS.resume_at_step}: must be in [0, max_steps)")
    if FLAGS.resume_at_step and config.resume:
        sys.exit("--resume_at_step with --resume: start the soak fresh")
    if config.launch != "local_mp":
        sys.exit("the soak signals node processes: --launch=local_mp")
    restarted_on_request = {"replay"} if FLAGS.replay_kill == "restart" else set()
    missing = sorted(set(targets) - restarted_on_request - set(config.restart_groups))
    if missing:
        sys.exit(f"--kill_targets names {missing}, which --restart_groups does not restart: "
                 "the run would fail at the first fault; add them to --restart_groups")


def main(argv):
    del argv
    try:
        config = config_from_flags(SAOConfig)
    except ConfigError as e:
        sys.exit(f"invalid configuration: {e}")
    check_soak_flags(config)
    if config.learners == 1 and "learner_store" in config.restart_groups:   # a group's only
        config = config.replace(restart_groups=tuple(
            g for g in config.restart_groups if g != "learner_store"))
    targets = [t.strip() for t in FLAGS.kill_targets if t.strip()]
    kinds = [k.strip() for k in FLAGS.faults if k.strip()]
    faults, injectors, pauses = [], [], []
    monitor = ProgressMonitor(config.run_dir)

    def inject(launched):
        injector = FaultInjector(
            launched, targets, kinds, FLAGS.kill_every_s, config.node_timeout_s,
            FLAGS.replay_kill, FLAGS.soak_seed + len(injectors), FLAGS.max_faults,
            FLAGS.drain_every_s, FLAGS.max_drains, faults=faults)
        injectors.append(injector)
        injector.start()
        if FLAGS.resume_at_step and len(injectors) == 1:
            while not launched.stopped and monitor.step() < FLAGS.resume_at_step:
                time.sleep(0.5)
            injector.stop()
            pauses.append([time.time(), None])
            print(f"\n[soak] step {monitor.step()}: stopping the whole program to resume it",
                  flush=True)
            launched.stop()

    t0 = time.time()
    monitor.start()
    summaries = []
    try:
        summaries.append(run_program(config, make_program, progress=FLAGS.progress,
                                     on_launch=inject))
        if FLAGS.resume_at_step:
            pauses[-1][1] = time.time()
            summaries.append(run_program(config.replace(resume=True), make_program,
                                         progress=FLAGS.progress, on_launch=inject))
    finally:
        for injector in injectors:
            injector.stop()
        monitor.stop()
    wall = time.time() - t0
    report = soak_report(config, faults, summaries, monitor, pauses, wall)
    write_json_atomic(os.path.join(config.run_dir, "soak_report.json"), report)
    print(json.dumps({k: v for k, v in report.items() if k != "faults"}, indent=2))
    r = report["rollouts"]
    print(f"soak: {report['steps']}/{config.max_steps} steps in {wall:.0f}s, "
          f"{report['faults_injected']} faults {report['faults_by_kind']}, "
          f"{report['restarts_total']} restarts, longest stall {report['longest_stall_s']} s, "
          f"{r['completed']} completed, {r['trained']} trained, {r['lost']} lost, "
          f"{r['forgot_early']} forgotten early, {r['consumed_twice']} consumed twice; "
          f"report at {config.run_dir}/soak_report.json")
    if r["lost"] or r["forgot_early"] or r["consumed_twice"] or report["hangs_undetected"] or \
            report["steps"] != config.max_steps:
        sys.exit(1)


def soak_report(config, faults, summaries, monitor, pauses, wall):
    accounting = rollout_accounting(config.run_dir)
    done = [f for f in faults if "skipped" not in f]
    drains = [f for f in done if f["fault"] == "drain"]
    restarts = {}
    for s in summaries:   # nodes.json is rewritten by each launch: add the launches up
        for node, n in s.get("restarts", {}).items():
            restarts[node] = restarts.get(node, 0) + n
    stalls = monitor.stalls([tuple(p) for p in pauses if p[1] is not None])
    t_first = monitor.samples[0][0] if monitor.samples else 0.0
    for stall in stalls:
        inside = [f for f in done if f["time"] <= stall["start"] + stall["s"]
                  and f["time"] >= stall["start"] - 5]
        stall["faults_in_it"] = [f"{f['fault']} {f['node']}" for f in inside]
        stall["start"] = round(stall["start"] - t_first, 1)
    # What one fault alone costs: stalls (over 2 s) with exactly one node fault in them, the
    # longest per fault kind and node group (overlapping faults add up; these do not).
    alone: dict = {}
    for stall in stalls:
        node_faults = [f for f in stall["faults_in_it"] if not f.startswith("drain")]
        if stall["s"] > 2.0 and len(node_faults) == 1:
            kind, node = node_faults[0].split(" ", 1)
            key = f"{kind} {node.rsplit('_', 1)[0]}"
            alone[key] = max(alone.get(key, 0.0), stall["s"])
    hang_costs = [f["ended_after_s"] for f in done if f["fault"] == "SIGSTOP" and
                  "ended_after_s" in f]
    return {
        "command": " ".join(sys.argv),
        "wall_time_s": round(wall, 1),
        "steps": accounting["learner_version"],
        "max_steps": config.max_steps,
        "learners": config.learners,
        "node_timeout_s": config.node_timeout_s,
        "restart_backoff_s": config.restart_backoff_s,
        "launches": len(summaries),
        "resumed_at_step": FLAGS.resume_at_step or None,
        "faults_injected": len(done),
        "faults_by_kind": _count(f["fault"] for f in done),
        "faults_by_node": _count(f"{f['fault']} {f['node']}" for f in done),
        "hangs_undetected": len([f for f in done if f.get("undetected")]),
        "hang_ended_after_s": {"max": max(hang_costs, default=None), "n": len(hang_costs)},
        # The learner's first step on a higher loss epoch after each drain (a loss epoch makes
        # the actors re-send; a learner restart in between also starts one).
        "drains": [{"items_taken": d["items_taken"],
                    "new_loss_epoch_after_s": monitor.loss_epoch_after(d["time"])}
                   for d in drains],
        "restarts": restarts,
        "restarts_total": sum(restarts.values()),
        "longest_stall_s": stalls[0]["s"] if stalls else None,
        "stalls_longest_5": stalls[:5],
        "longest_stall_after_one_fault_s": dict(sorted(alone.items())),
        "eval_accuracy": {"initial": summaries[0].get("initial_eval_accuracy"),
                          "final": summaries[-1].get("final_eval_accuracy")},
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


def _count(items):
    out = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


if __name__ == "__main__":
    app.run(main)
