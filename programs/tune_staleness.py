r"""Measures your config over a grid of staleness limits and recommends one.

  .venv/bin/python programs/tune_staleness.py --task=arithmetic --num_actors=2 \
      --max_steps=30 --limits=lockstep,1,2,4,8 --repeats=2 --out_dir=runs/tune \
      --report=results/tune_staleness/arithmetic_

Every SAOConfig flag is yours (model, task, actors, placement, batch...); the tuner runs the whole
program once per limit and repeat (lock-step always included), with a progress bar, and writes
<report>report.md (the table, the rule, why), <report>tuner.png, <report>staleness.png and
<report>result.json, then prints one JSON line. Runs are kept in --out_dir/runs and reused when
the same command runs again. The rule and every figure: experiments/staleness/ (tuner.py,
recommend.py); the guide: docs/STALENESS.md.
"""
import json
import os
import shlex
import sys

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from sao_actor_learner.config import ConfigError, SAOConfig  # noqa: E402
from sao_actor_learner.flags import config_from_flags, define_flags_from_dataclass  # noqa: E402

define_flags_from_dataclass(SAOConfig)
flags.DEFINE_list("limits", ["lockstep", "1", "2", "4", "8"], "Staleness limits to measure: "
                  "lockstep or an integer max_staleness each (lock-step is always added).")
flags.DEFINE_integer("repeats", 2, "Runs per limit (seeds seed, seed+1, ...), interleaved.")
flags.DEFINE_string("out_dir", "runs/tune_staleness", "Run folders go under <out_dir>/runs.")
flags.DEFINE_string("report", "", "Prefix of the report files (e.g. results/tune/arith_); "
                    "empty: <out_dir>/.")
flags.DEFINE_float("throughput_tolerance", 0.05, "The rule: a limit within this fraction of "
                   "the best rollouts/s counts as fast enough.")
flags.DEFINE_float("max_alarm_frac", 0.1, "The rule: the most steps (as a fraction) that may "
                   "raise a drift alarm.")
flags.DEFINE_bool("progress", True, "Show a progress bar and each run's progress line.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from experiments.benchmarks.generate_log import make_program_with_generate_log
    from experiments.staleness import report, tuner
    from experiments.staleness.recommend import Rule
    from sao_actor_learner.preflight import check_before_launch
    from sao_actor_learner.run import run_program
    try:
        limits = tuner.parse_limits(FLAGS.limits)
        base = config_from_flags(SAOConfig)
        rule = Rule(FLAGS.throughput_tolerance, base.alarm_max_kl, base.alarm_min_ess,
                    FLAGS.max_alarm_frac)
        check_before_launch(base)
        result = tuner.tune(base, limits, FLAGS.repeats, FLAGS.out_dir,
                            lambda c: run_program(c, make_program_with_generate_log,
                                                  progress=FLAGS.progress),
                            rule, progress=FLAGS.progress)
    except (ConfigError, ValueError) as e:
        sys.exit(f"invalid configuration: {e}")
    except RuntimeError as e:
        sys.exit(f"tune_staleness: {e}")
    prefix = FLAGS.report or os.path.join(FLAGS.out_dir, "")
    command = " ".join(shlex.quote(a) for a in sys.argv)
    paths = report.write_tune_report(result, prefix, command)
    print(report.tune_markdown(result, [], ""))
    print(f"report: {paths['report']}; plots: {paths['plots']}")
    print(json.dumps({**report.tune_json(result), **paths}, sort_keys=True))


if __name__ == "__main__":
    app.run(main)
