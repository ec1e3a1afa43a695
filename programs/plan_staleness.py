r"""Predicts throughput, learner utilisation, staleness and drops against the staleness limit
for a configuration, without running it: a discrete-event simulation of the actor-learner loop
with the program's own admission, queue and drop rules (experiments/staleness/planner.py).

  # from a finished run's measured costs and lengths (a tuner or validation run):
  .venv/bin/python programs/plan_staleness.py --from_run=runs/tune_staleness/runs/eta0_r0 \
      --num_actors=8 --limits=0,1,2,4,8
  # a paper-scale cluster, every number an assumption written into the report:
  .venv/bin/python programs/plan_staleness.py --preset=paper --limits=0,1,2,4,8,16 \
      --report=results/plan_staleness/paper_
  # everything given:
  .venv/bin/python programs/plan_staleness.py --lengths=lognormal:500,0.8 --gen_step_s=0.02 \
      --learner_step_s=5 --learner_token_s=1e-4 --publish_s=2 --load_s=1 --num_actors=16

Every SAOConfig flag describes the loop (batch_size, num_actors, actor_batch, queue_capacity,
actor_delay*, max_new_tokens caps lengths, max_steps is the simulated horizon). Prints the
assumptions and the table; with --report also writes <report>plan.md, <report>plan.png and
<report>plan.json. The guide: docs/STALENESS.md.
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
flags.DEFINE_list("limits", ["0", "1", "2", "4", "8"], "Staleness limits to simulate (0 is "
                  "lock-step; 'lockstep' also names it).")
flags.DEFINE_string("lengths", "", "Response-length distribution: fixed:L, uniform:LO,HI, "
                    "exponential:MEAN, lognormal:MEAN,SIGMA, pareto:MEAN,TAIL, file:PATH or "
                    "run:DIR (experiments/staleness/inputs.py).")
flags.DEFINE_string("from_run", "", "A finished run (with generate-call logs) to fit the "
                    "costs and lengths to, and whose config the loop flags default to; flags "
                    "given explicitly win.")
flags.DEFINE_enum("preset", "", ["", "paper"], "paper: a paper-scale cluster's costs and "
                  "lengths (assumptions, written into the report).")
flags.DEFINE_integer("seeds", 3, "Simulated runs per limit, averaged.")
flags.DEFINE_string("report", "", "Prefix of plan.md, plan.png, plan.json; empty: print only.")
for _name, _help in (
        ("gen_call_s", "Seconds of a generation call besides its tokens (prefill, overhead)."),
        ("gen_token_s", "Generation seconds per generated token of a call (all its rows)."),
        ("gen_step_s", "Generation seconds per token of a call's longest response."),
        ("prompt_tokens", "Mean prompt tokens per rollout (counted in the learner's batch)."),
        ("learner_step_s", "Learner seconds per step besides its tokens."),
        ("learner_token_s", "Learner seconds per batch token (prompt and response)."),
        ("learner_other_s", "Learner seconds between steps (checkpoints and the like)."),
        ("publish_s", "Learner seconds to publish a version (weight sync, learner side)."),
        ("load_s", "Actor seconds to load a new version (weight sync, actor side).")):
    flags.DEFINE_float(_name, None, _help + " Unset: the preset's, the fitted run's, or 0.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from experiments import sweeps
    from experiments.staleness import plan, planner, report
    from experiments.staleness.inputs import PlanError
    from experiments.staleness.tuner import parse_limits
    try:
        if FLAGS.preset:
            sweeps.apply_preset(FLAGS, plan.PRESETS[FLAGS.preset]["config"])
        if FLAGS.from_run:   # the loop of the run, where no flag says otherwise
            sweeps.apply_preset(FLAGS, plan.run_loop_fields(FLAGS.from_run))
        limits = parse_limits(FLAGS.limits)
        if FLAGS.seeds < 1:
            raise ConfigError(f"--seeds={FLAGS.seeds}: must be >= 1")
        config = config_from_flags(SAOConfig)
        costs, lengths, notes = plan.plan_inputs(
            config, FLAGS.lengths, {k: FLAGS[k].value for k in plan.COST_FIELDS},
            FLAGS.from_run, FLAGS.preset)
        setting = planner.Setting.from_config(config)
        rows = planner.curve(setting, costs, lengths, limits, FLAGS.seeds)
    except (ConfigError, PlanError) as e:
        sys.exit(f"invalid planner input: {e}")
    assumptions = plan.setting_notes(setting, limits, FLAGS.seeds) + notes + \
        list(plan.MODEL_ASSUMPTIONS)
    title = f"Staleness planner{' (preset ' + FLAGS.preset + ')' if FLAGS.preset else ''}"
    command = " ".join(shlex.quote(a) for a in sys.argv)
    plot = None
    if FLAGS.report:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.report + "x")), exist_ok=True)
        plot = report.plan_plot(rows, FLAGS.report + "plan.png", title)
    text = report.plan_markdown(rows, assumptions, title, command, plot)
    print(text)
    line = {"tool": "plan_staleness", "preset": FLAGS.preset, "assumptions": assumptions,
            "limits": limits, "curve": rows}
    if FLAGS.report:
        with open(FLAGS.report + "plan.md", "w") as f:
            f.write(text)
        with open(FLAGS.report + "plan.json", "w") as f:
            json.dump(line, f, indent=1)
    print(json.dumps(line, sort_keys=True))


if __name__ == "__main__":
    app.run(main)
