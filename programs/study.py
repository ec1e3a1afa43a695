"""Every study and sweep: the reproduction study of the paper's claims and the referee's points
(seeds, 95% CIs), and the staleness, value-pretraining and online-shift sweeps.

  python programs/study.py --preset=all --workers=2 --out_dir=runs/study \
      --results_dir=results/study                                                  # ~85 min
  python programs/study.py --preset=single_rollout --out_dir=runs/study
  python programs/study.py --preset=smoke --out_dir=/tmp/study                        # ~1 min

Presets (experiments/studies/presets.py):
  single_rollout  SAO B x 1; GRPO (B/G) x G (same rollouts per step); GRPO B x G (same
                  distinct prompts); critic-free B x 1 with a running-mean baseline (the
                  referee's control); SAO (B/G) x G. Held-out accuracy vs steps, rollouts and
                  wall-clock.
  asynchrony      forced staleness k in {0, 2, 4, 8} for SAO, GRPO (PPO-clip), GRPO + DIS:
                  final accuracy, KL, masked fraction, ESS, collapse and its step.
  asynchrony_stress  the same at k in {0, 8} with learning rates 2e-4 (the policy drifts
                  further per version).
  ablations       DIS / PPO-clip / TIS / no correction (at k = 4); frozen-attention vs full
                  critic; K = 1 vs 2.
  gae             skip-observation vs standard GAE on the multi-turn calculator_tool task.
  value_pretrain  explained variance and accuracy vs value_pretrain_rollouts (0, 160, 480,
                  960 fitted online, and the value-pretrained critic directory).
  (single_rollout, ablations and value_pretrain run SAO with the critic of `make
  critic-dataset`, 5 seeds: docs/REPRODUCTION.md, "The critic".)
  online_shift    task=online_shift, the reward rule flips every 40 versions: steps to
                  recover 75% of the pre-shift held-out accuracy, per method.
  all             the seven above, in that order (cells two studies share run once).
  stability_calibration  the stability study's calibration on the arithmetic task: policy_lr x
                  batch for every arm at forced staleness 0 (2 seeds) and 8 (1 seed); a point
                  passes when no k=0 run collapses and k=8 drifts (KL >= 1e-2 or ESS <= 0.9):
                  calibration.csv/.md. Run it first.
  stability       SAO, the critic-free control + DIS, GRPO + PPO-clip / DIS / TIS at forced
                  staleness k in {0, 8, 32}, 300 steps, 5 seeds (10 for SAO and GRPO at k=32),
                  and a critic-quality arm at k=8: survival curves, time to collapse,
                  early-warning lead times (experiments/studies/stability.py).
  stability_pilot SAO and GRPO at k in {0, 8, 32}, one seed, lr 2e-4: the stability pipeline
                  end to end.
  (The stability presets are not part of `all`.)
  smoke           2 variants x 3 seeds x 2 steps on the arithmetic task: output format only.
A comma-separated list of study names also works.

Sweep presets (experiments/sweep_presets/; each runs alone, --size=smoke|full picks its grid and
run size, a flag given on the command line wins; outputs straight in --out_dir, copied to
--results_dir):
  staleness_sweep       --methods x --shapes x --staleness (--staleness_mode) x --seeds:
                        results.csv, reward_vs_step.png, drift_vs_staleness.png
                        (default --out_dir=runs/staleness_sweep)
  value_pretrain_sweep  --method, --shape, --pretrain_rollouts x --seeds: results.csv,
                        value_pretrain.png (default --out_dir=runs/value_pretrain)
  online_shift_sweep    task=online_shift, --methods x --shapes x --seeds, --window,
                        --recover_fraction: results.csv, recovery.csv, online_shift.png
                        (default --out_dir=runs/online_shift)

  python programs/study.py --preset=staleness_sweep --size=smoke --out_dir=/tmp/sweep  # ~1 min

The dataset studies need the GSM8K-style workload: data/gsm_tiny/{train,test}.parquet and the
SFT warm start checkpoints/warm_start_dataset (the Makefile's dataset workload target; other
paths: --dataset_dir, --dataset_model); the gae study checkpoints/warm_start_calculator_tool
(`make warm-start-calculator-tool`); online_shift and smoke the arithmetic warm start.
Every other SAOConfig field is a flag; a flag given on the command line applies to every run
of every study named (and so makes new cells).

--workers=N runs N cells at once, each in a process of its own (experiments/studies/pool.py; a
local_mt cell keeps about one core busy), then builds the tables as a one-at-a-time run would.
Resumable: every run is a folder <out_dir>/runs/<cell> and a cell whose folder holds a
summary.json made by the same config is never run again, whichever study asked for it; run the
same command again after an interruption. Outputs per study in <out_dir>/<study>/ (copied to
<results_dir>/<study>/): results.csv, curves.csv, summary.csv, comparisons.csv, summary.md,
study.json (sizes, durations of every invocation), invocations.jsonl and PNG figures
(experiments/studies/presets.py and plots.py describe them).
"""
import dataclasses
import json
import os
import sys
import time

from absl import app, flags

# Runnable as a script from the repository root without installation (programs.*).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import sweeps  # noqa: E402
from experiments import sweep_presets  # noqa: E402
from experiments.studies import plots as study_plots  # noqa: E402
from experiments.studies import pool as study_pool  # noqa: E402
from experiments.studies import presets as studies  # noqa: E402
from experiments.studies import stability  # noqa: E402
from experiments.studies import tables as study_tables  # noqa: E402
from sao_actor_learner.builder import make_program  # noqa: E402
from sao_actor_learner.config import ConfigError, SAOConfig  # noqa: E402
from sao_actor_learner.flags import config_from_flags, define_flags_from_dataclass  # noqa: E402
from sao_actor_learner.preflight import check_before_launch  # noqa: E402
from sao_actor_learner.run import run_program  # noqa: E402

# Every study and sweep cell sets these (sweeps.Cell.config); the studies also max_staleness,
# each sweep preset its own (sweep_presets.refused_flags).
define_flags_from_dataclass(SAOConfig, skip=sweep_presets.ALWAYS_CELL_FIELDS)
flags.DEFINE_string("preset", "all", "A study (" + ", ".join(studies.STUDIES) + "), a comma-"
                    "separated list of them, or all; or one sweep ("
                    + ", ".join(sweep_presets.SWEEPS) + ").")
flags.DEFINE_string("out_dir", "", "Where runs/ and the outputs go (default: runs/study; a "
                    "sweep's own: runs/staleness_sweep, runs/value_pretrain, runs/online_shift).")
flags.DEFINE_string("results_dir", "", "Also copy each study's CSV, JSON, Markdown and PNG "
                    "files to <results_dir>/<study>/ (e.g. results/study); a sweep's CSV and "
                    "PNG files to <results_dir>/; another folder than --out_dir.")
flags.DEFINE_list("seeds", [], "Seeds of every study (default: the study's own, 3 of them) "
                  "or of the sweep (default: its --size's).")
flags.DEFINE_string("dataset_dir", studies.DATASET_DIR, "The dataset studies' data: "
                    "train.parquet and test.parquet in verl's schema.")
flags.DEFINE_string("dataset_model", studies.DATASET_MODEL, "The dataset studies' warm start "
                    "(a Hugging Face model directory).")
flags.DEFINE_integer("workers", 1, "Cells run at once, each in its own process "
                     "(experiments/studies/pool.py): a local_mt cell keeps about one core busy, so "
                     "2 on a 2-core machine.", lower_bound=1)
flags.DEFINE_bool("progress", True, "Show progress.")
# The sweep presets' flags (their defaults: the --size's values).
flags.DEFINE_enum("size", "full", ["smoke", "full"], "A sweep preset's grid and run size; "
                  "explicit flags win.")
flags.DEFINE_list("methods", [], "staleness_sweep, online_shift_sweep: methods to compare "
                  "(sweeps.METHODS).")
flags.DEFINE_list("shapes", [], "staleness_sweep, online_shift_sweep: batch shapes "
                  "PROMPTSxGROUP (GRPO skips G=1).")
flags.DEFINE_list("staleness", [], "staleness_sweep: staleness values (k, or max_staleness).")
flags.DEFINE_enum("staleness_mode", "forced", ["forced", "limit"], "staleness_sweep: forced: "
                  "every rollout exactly k stale; limit: max_staleness only.")
flags.DEFINE_list("pretrain_rollouts", [], "value_pretrain_sweep: value_pretrain_rollouts "
                  "values (the budgets).")
flags.DEFINE_string("method", "sao", "value_pretrain_sweep: a method with a critic "
                    "(sweeps.METHODS).")
flags.DEFINE_string("shape", "", "value_pretrain_sweep: batch shape PROMPTSxGROUP.")
flags.DEFINE_integer("window", 5, "online_shift_sweep: steps averaged for the pre-shift level "
                     "and recovery.")
flags.DEFINE_float("recover_fraction", 0.9, "online_shift_sweep: recovered at this fraction of "
                   "the pre-shift level.")
FLAGS = flags.FLAGS
STUDY_OUT_DIR = "runs/study"


def study_names(preset: str):
    names = list(studies.FULL) if preset == "all" else [n.strip() for n in preset.split(",")]
    for n in names:
        if n in sweep_presets.SWEEPS:
            raise ConfigError(f"preset={n!r} is a sweep: it runs alone (--preset={n})")
        if n not in studies.STUDIES:
            raise ConfigError(f"preset={n!r}: must be one of {', '.join(studies.STUDIES)}, all, "
                              f"or a sweep ({', '.join(sweep_presets.SWEEPS)})")
    return names


def check_given_flags(sweep) -> None:
    """A flag on the command line that the preset does not read fails (it would be ignored)."""
    given = [name for name in FLAGS if FLAGS[name].present]
    refused = sweep_presets.refused_flags(sweep, given)
    if refused:
        what = f"the {sweep.name} preset" if sweep else "a study"
        raise ConfigError(f"{what} does not take {', '.join('--' + n for n in refused)}: it "
                          "sets it per run or does not read it (see --helpfull)")


def check_folders() -> None:
    """--results_dir must be another folder than --out_dir: the outputs are copied from the one
    into the other (a file copied onto itself is an error), checked before anything runs."""
    if not FLAGS.results_dir:
        return
    out, results = (os.path.realpath(p) for p in (FLAGS.out_dir, FLAGS.results_dir))
    if out == results or (os.path.isdir(FLAGS.out_dir) and os.path.isdir(FLAGS.results_dir)
                          and os.path.samefile(FLAGS.out_dir, FLAGS.results_dir)):
        raise ConfigError(f"--results_dir={FLAGS.results_dir!r} is the same folder as --out_dir="
                          f"{FLAGS.out_dir!r}: the outputs are copied from --out_dir into "
                          "--results_dir; give another --results_dir (e.g. results/study) or "
                          "drop it")


def run_sweep(sweep) -> None:
    """A sweep preset: its --size's flags (unless given), then its grid, files and table."""
    try:
        check_given_flags(sweep)
        sweeps.apply_preset(FLAGS, sweep.sizes[FLAGS.size])
        sweep.run(FLAGS, lambda config: run_program(config, make_program,
                                                    progress=FLAGS.progress))
    except ConfigError as e:
        sys.exit(f"invalid configuration: {e}")


def base_config(base_overrides) -> SAOConfig:
    """The study's workload, under every flag given on the command line."""
    base_overrides = studies.with_dataset(base_overrides, FLAGS.dataset_dir, FLAGS.dataset_model)
    overrides = {k: v for k, v in base_overrides if not FLAGS[k].present}
    return config_from_flags(SAOConfig, **overrides)


def plan(study):
    """[(base config, [(variant, cell, config)])] per workload of the study; every config is
    built (and so validated) before anything runs."""
    groups = {}
    for variant, cell in studies.cells_of(study):
        groups.setdefault(studies.base_of(study, variant), []).append((variant, cell))
    out = []
    for base_overrides, pairs in groups.items():
        base = base_config(base_overrides)
        out.append((base, [(v, c, c.config(base, FLAGS.out_dir)) for v, c in pairs]))
    return out


def check_names(plans) -> None:
    """Two cells with one folder must be one config (else each would rerun the other)."""
    seen = {}
    for base, items in plans:
        for _, cell, config in items:
            other = seen.setdefault(config.run_dir, config)
            if other != config:
                raise ConfigError(f"two different runs would share {config.run_dir}: give one "
                                  "of their variants its own tag (studies.Variant.tag)")


def code_version() -> dict:
    """The commit the runs were made with, and how many files differed from it."""
    import subprocess

    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    status = git("status", "--short", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"),
            "modified_files": len(status.splitlines()) if status else 0}


def run_study(study, plans, earlier_cells, ran_side_by_side=frozenset(),
              side_by_side_s=0.0) -> dict:
    """Runs the study's unfinished cells (one at a time), writes its tables, figures and
    study.json. A cell counts as run by this study when this invocation ran it, here or in its
    --workers pass (`ran_side_by_side`: those run folders; side_by_side_s: how long that pass
    took, all studies together), and no earlier study of the invocation holds it."""
    out = studies.study_dir(FLAGS.out_dir, study)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    records, curves, shifts, ran, cells_wall = [], [], [], 0, 0.0
    for base, items in plans:
        unfinished = {config.run_dir for _, _, config in items
                      if sweeps.finished_summary(config) is None}
        ran += sum(1 for _, c, config in items if c.name not in earlier_cells
                   and (config.run_dir in unfinished or config.run_dir in ran_side_by_side))
        if unfinished:
            check_before_launch(base)
        rows = sweeps.run_cells([c for _, c, _ in items], base, FLAGS.out_dir,
                                lambda config: run_program(config, make_program,
                                                           progress=FLAGS.progress),
                                progress=FLAGS.progress,
                                csv_name=os.path.join(study.name, "results.csv"),
                                record_name=os.path.join(study.name, f"sweep_{base.task}.json"))
        for (variant, cell, config), row in zip(items, rows):
            rec = studies.run_record(study, variant, row, config)
            records.append(rec)
            curves += studies.curve_rows(study, variant, row, config)
            cells_wall += float(rec.get("wall_time_s") or 0.0)
            if study.kind == "shift" and row.get("status") == "ok":
                shifts += [dict(variant=variant.id, seed=cell.seed, **s)
                           for s in studies.shift_table(row["run_dir"], config)]
    summary = studies.summary_rows(study, records)
    comps = studies.comparison_rows(study, records)
    sweeps.write_csv(records, os.path.join(out, "results.csv"), studies.RUN_COLUMNS)
    sweeps.write_csv(curves, os.path.join(out, "curves.csv"), studies.CURVE_COLUMNS)
    sweeps.write_csv(summary, os.path.join(out, "summary.csv"), studies.SUMMARY_COLUMNS)
    sweeps.write_csv(comps, os.path.join(out, "comparisons.csv"), studies.COMPARISON_COLUMNS)
    if study.kind == "shift":
        sweeps.write_csv(shifts, os.path.join(out, "recovery.csv"), studies.RECOVERY_COLUMNS)
    base = plans[0][0]
    title = (f"{study.title}\ntask={base.task}, {base.max_steps} steps, seeds "
             f"{','.join(map(str, study.seeds))}, mean and 95% CI over seeds")
    study_plots.draw(study, curves, summary, out, title,
                     shift_every=base.shift_every if study.kind == "shift" else None,
                     max_steps=base.max_steps)
    if study.kind in studies.STABILITY_KINDS:
        stability.write_outputs(study, records, summary, out, base.max_steps, base.eval_every,
                                title)
    elapsed = time.time() - t0
    with open(os.path.join(out, "invocations.jsonl"), "a") as f:
        f.write(json.dumps({"started": t0, "elapsed_s": elapsed, "cells_run_now": ran,
                            "workers": FLAGS.workers, "side_by_side_s": side_by_side_s,
                            **code_version()}) + "\n")
    with open(os.path.join(out, "invocations.jsonl")) as f:
        history = [json.loads(line) for line in f if line.strip()]
    own = [c.name for _, items in plans for _, c, _ in items]
    info = {
        "study": study.name, "title": study.title, "kind": study.kind,
        "cells": len(records), "seeds": list(study.seeds),
        "variants": [dataclasses.asdict(v) for v in study.variants],
        "failed": sum(1 for r in records if r.get("status") != "ok"),
        "cells_shared_with_earlier_studies": sorted(set(own) & earlier_cells),
        "cells_wall_time_s": cells_wall,
        "invocations": len(history),
        "elapsed_s_all_invocations": sum(h["elapsed_s"] for h in history),
        "cells_run_all_invocations": sum(h["cells_run_now"] for h in history),
        "bases": {b.task: json.loads(b.to_json()) for b, _ in plans},
        # one Holm family per metric (experiments/studies/tables.py), the primary metric first
        "primary_metric": study_tables.PRIMARY_METRIC,
        "comparison_families": study_tables.families(comps),
    }
    sweeps.write_json_atomic(os.path.join(out, "study.json"), info)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(studies.summary_markdown(study, summary, comps, info))
    sweeps.copy_results(out, os.path.join(FLAGS.results_dir, study.name) if FLAGS.results_dir
                        else "", studies.output_names(study) + ("invocations.jsonl",))
    print(f"{study.name}: {len(records)} runs ({ran} run now, {info['failed']} failed) in "
          f"{elapsed:.0f}s; outputs in {out}")
    return info


def run_side_by_side(configs, chosen) -> float:
    """--workers > 1: every unfinished cell of every chosen study (each once, in study order),
    FLAGS.workers at a time in processes of their own; run_study then finds them finished."""
    dirs = {c.run_dir for c in configs}
    try:
        for _, plans in chosen:   # invalid workloads fail before anything is launched
            for base, items in plans:
                if any(c.run_dir in dirs for _, _, c in items):
                    check_before_launch(base)
    except ConfigError as e:
        sys.exit(f"invalid configuration: {e}")
    print(f"running {len(configs)} cells, {FLAGS.workers} at a time; logs in "
          f"{os.path.join(FLAGS.out_dir, 'logs')}")
    t0 = time.time()
    study_pool.run_in_processes(configs, FLAGS.workers, os.path.join(FLAGS.out_dir, "logs"),
                                progress=FLAGS.progress)
    return time.time() - t0


def main(argv):
    del argv
    sweep = sweep_presets.SWEEPS.get(FLAGS.preset.strip())
    if not FLAGS.out_dir:
        FLAGS.out_dir = sweep.out_dir if sweep else STUDY_OUT_DIR
    try:
        check_folders()
    except ConfigError as e:
        sys.exit(f"invalid configuration: {e}")
    if sweep is not None:
        run_sweep(sweep)
        return
    try:
        check_given_flags(None)
        names = study_names(FLAGS.preset)
        chosen = []
        for n in names:
            study = studies.STUDIES[n]
            if FLAGS.seeds:
                study = dataclasses.replace(study, seeds=tuple(int(s) for s in FLAGS.seeds))
            chosen.append((study, plan(study)))
        check_names([p for _, plans in chosen for p in plans])
    except ConfigError as e:
        sys.exit(f"invalid configuration: {e}")
    side_by_side_s, ran_side_by_side = 0.0, frozenset()
    if FLAGS.workers > 1:
        configs = {}   # run_dir -> config: a cell two studies share runs once
        for _, plans in chosen:
            for _, items in plans:
                for _, _, config in items:
                    configs.setdefault(config.run_dir, config)
        unfinished = [c for c in configs.values() if sweeps.finished_summary(c) is None]
        if unfinished:
            side_by_side_s = run_side_by_side(unfinished, chosen)
            ran_side_by_side = frozenset(c.run_dir for c in unfinished)
    failed, earlier = 0, set()
    for study, plans in chosen:
        try:
            info = run_study(study, plans, earlier, ran_side_by_side, side_by_side_s)
        except ConfigError as e:
            sys.exit(f"invalid configuration ({study.name}): {e}")
        failed += info["failed"]
        earlier |= {c.name for _, items in plans for _, c, _ in items}
    if failed:
        sys.exit(f"{failed} runs failed; run the same command again to retry them")


if __name__ == "__main__":
    app.run(main)
