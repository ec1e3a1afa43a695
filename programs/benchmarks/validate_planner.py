r"""The staleness planner against measured runs: >= 8 configurations side by side.

  OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python \
      programs/benchmarks/validate_planner.py --out_dir=runs/validate_planner \
      --report=results/plan_staleness/validation_        # ~12 runs of 40 steps, ~15 min

Runs each --cases entry LIMIT:ACTORS:DELAY (default: limits 0..8, 1-4 actors, with and
without the heavy-tailed delay of programs/benchmarks/async_vs_sync.py) once as the whole program
with generate-call logs, then simulates it with the planner from the costs fitted to that run
(self) and from the first case's run (calibration), and writes <report>validation.md and
<report>validation.json: measured and predicted rollouts/s and mean staleness with their errors
(target: within 15%). Timing: run it on a quiet machine (the load average is in the table).
Every SAOConfig flag applies to every case (defaults here: the arithmetic task, batch 32,
actor batch 8, 40 steps, evaluator off, local_mp). experiments/staleness/validation.py has the
method.
"""
import json
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, REPO)

from absl import app, flags  # noqa: E402

from sao_actor_learner.config import ConfigError, SAOConfig  # noqa: E402
from sao_actor_learner.flags import config_from_flags, define_flags_from_dataclass  # noqa: E402

define_flags_from_dataclass(SAOConfig)
flags.DEFINE_list("cases", None, "LIMIT:ACTORS:DELAY entries (default: the 12 of "
                  "experiments/staleness/validation.DEFAULT_CASES).")
flags.DEFINE_float("delay_mean_s", 0.25, "Mean injected delay of the cases with a delay.")
flags.DEFINE_integer("seeds", 3, "Simulated runs per case, averaged.")
flags.DEFINE_string("out_dir", "runs/validate_planner", "Run folders go under <out_dir>/runs.")
flags.DEFINE_string("report", "", "Prefix of validation.md and validation.json; empty: "
                    "<out_dir>/.")
FLAGS = flags.FLAGS
DEFAULTS = dict(task="arithmetic", max_steps=40, batch_size=32, actor_batch=8,
                evaluator="off", launch="local_mp", actor_delay_tail=1.5, actor_delay_max_s=5.0)


def main(argv):
    del argv
    from experiments import sweeps
    from experiments.benchmarks.generate_log import make_program_with_generate_log
    from experiments.staleness import validation
    from sao_actor_learner.run import run_program
    sweeps.apply_preset(FLAGS, DEFAULTS)
    try:
        cases = validation.parse_cases(FLAGS.cases or list(validation.DEFAULT_CASES))
        base = config_from_flags(SAOConfig)
        load_before = os.getloadavg()
        rows = validation.validate(
            base, cases, FLAGS.delay_mean_s, FLAGS.out_dir,
            lambda c: run_program(c, make_program_with_generate_log, progress=False),
            FLAGS.seeds, out=sys.stdout)
    except ConfigError as e:
        sys.exit(f"invalid configuration: {e}")
    prefix = FLAGS.report or os.path.join(FLAGS.out_dir, "")
    os.makedirs(os.path.dirname(os.path.abspath(prefix + "x")), exist_ok=True)
    text = validation.markdown(rows, " ".join(shlex.quote(a) for a in sys.argv),
                               cases[0].name)
    with open(prefix + "validation.md", "w") as f:
        f.write(text)
    result = {"benchmark": "validate_planner", "target": validation.TARGET,
              "within_target": sum(r["self_within_target"] for r in rows), "cases": len(rows),
              "load_avg_before": list(load_before), "load_avg_after": list(os.getloadavg()),
              "rows": rows}
    with open(prefix + "validation.json", "w") as f:
        json.dump(result, f, indent=1)
    print(text)
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    app.run(main)
