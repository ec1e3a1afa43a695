"""The reproduction study's presets and its tables (programs/study.py, docs/REPRODUCTION.md).

A study is a list of variants (a method of sweeps.METHODS, a batch shape, a staleness setting
and extra config overrides) run with the same seeds on one workload (`base`: config overrides).
Every variant x seed is a `sweeps.Cell`; all studies put their runs in one folder
(`<out_dir>/runs/<cell name>`), so a cell two studies share (the same config) runs once and a
finished cell is never run again (sweeps.run_cells).

The workload of the main studies is the GSM8K-style word-problem dataset (task=dataset) from
its SFT warm start; the online-shift study runs task=online_shift (the only task whose reward
rule changes) and the GAE ablation task=calculator_tool (the only multi-turn task, where
skip-observation and standard GAE differ). Sizes were calibrated so that held-out accuracy
still rises at the end of the main runs and the whole grid (143 runs, ~3.2 h one at a time)
takes ~85 min with `--workers=2` on 2 CPU cores (docs/REPRODUCTION.md, "Scale" and the run log).
The critic studies (single_rollout, ablations, value_pretrain) were re-run with a critic that
learns (the value-pretrained directory of `make critic-dataset`, 5 seeds): they need it built.

The stability presets (stability_calibration, stability, stability_pilot: the arithmetic task,
300 steps, forced staleness up to 32) are defined in experiments/studies/stability_presets.py,
registered here and not part of `all`; their own outputs (survival, collapse, early warning,
calibration) come from experiments/studies/stability.py.

Per study (`<out_dir>/<study>/`, copied to <results_dir>/<study>/, e.g. results/study/): results.csv (one row per run),
curves.csv (one row per run and learner step), summary.csv (per variant: mean and 95% t
interval over seeds of each metric), comparisons.csv (differences of means with Welch
intervals and a verdict, and p-values adjusted per family of comparisons: tables.py),
summary.md (the two as tables), study.json (sizes and durations)
and PNG plots (plots.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

from experiments.studies import collapse as collapse_rule
from experiments.studies import metrics as sm
from experiments.studies import stability_presets
from experiments.studies import tables
from experiments import sweeps
from experiments.studies.study_types import Study, Variant  # noqa: F401 (re-exported)
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.observers import read_metrics


# --- workloads --------------------------------------------------------------------------------
DATASET_DIR = "data/gsm_tiny"
DATASET_MODEL = "checkpoints/warm_start_dataset"
# The dataset workload of every main study (one base, so the studies share cells). Calibration:
# docs/REPRODUCTION.md, "Scale".
DATASET_BASE = (
    ("task", "dataset"), ("model", DATASET_MODEL),
    ("train_files", (f"{DATASET_DIR}/train.parquet",)),
    ("eval_files", (f"{DATASET_DIR}/test.parquet",)),
    ("reward", "gsm8k"), ("max_new_tokens", 96), ("max_sequence_length", 224),
    ("max_steps", 40), ("eval_every", 10), ("eval_size", 200),
    ("num_actors", 2), ("actor_batch", 8), ("launch", "local_mt"),
    ("policy_lr", 3e-5), ("critic_lr", 1.5e-4))
SHIFT_BASE = (
    ("task", "online_shift"), ("shift_every", 40), ("max_steps", 150), ("eval_every", 5),
    ("eval_size", 200), ("num_actors", 2), ("actor_batch", 8),
    ("launch", "local_mt"))
CALCULATOR_BASE = (
    ("task", "calculator_tool"), ("max_steps", 60), ("eval_every", 10), ("eval_size", 100),
    ("policy_lr", 1.5e-5), ("critic_lr", 7.5e-5),
    ("num_actors", 2), ("actor_batch", 8), ("launch", "local_mt"))
SMOKE_BASE = (
    ("task", "arithmetic"), ("max_steps", 2), ("eval_every", 1), ("eval_size", 10),
    ("num_actors", 1), ("actor_batch", 4), ("launch", "local_mt"),
    ("replay_checkpoints", False))

# The studies on the small character-level tasks (gae, online_shift: a cell takes ~20 s) get 10
# seeds. They were run with 5 first and given 5 more after those results were seen
# (docs/REPRODUCTION.md says so where it matters).
CHEAP_SEEDS = tuple(range(10))
B, G = 8, 4       # SAO's B x 1 against GRPO's (B/G) x G, scaled down from 128 x 1 and 16 x 8
# The critic studies (single_rollout, ablations, value_pretrain) run SAO with a critic that learns
# (docs/REPRODUCTION.md, "The critic"): the value-pretrained critic of `make critic-dataset`,
# trained K=2 epochs of CRITIC_MINIBATCHES steps per policy step at CRITIC_LR (at 5e-4 and 2
# minibatches of 4 rollouts its held-out EV fell from 0.26 to 0.00 in 40 steps). Tag "critic"
# names those extras in the cell folders. 5 seeds each; the variants that do not touch the
# critic and were run before (GRPO 8x4, PPO-clip: at one minibatch the same objective as "none")
# are left out of this re-run to fit it in the time there was (docs/REPRODUCTION.md).
CRITIC_DIR = "checkpoints/critic_dataset"
CRITIC_LR, CRITIC_MINIBATCHES = 1e-4, 1
LEARNING_CRITIC = (("critic_model", CRITIC_DIR), ("critic_lr", CRITIC_LR),
                   ("critic_minibatches", CRITIC_MINIBATCHES))
CRITIC_SEEDS = tuple(range(5))
SAO = Variant("sao", f"SAO {B}x1", "sao", f"{B}x1", extra=LEARNING_CRITIC, tag="critic")


def _single_rollout() -> Study:
    vs = (SAO,
          Variant("grpo_same_rollouts", f"GRPO {B // G}x{G} (same rollouts)", "grpo",
                  f"{B // G}x{G}"),
          Variant("critic_free", f"critic-free {B}x1 (running mean)", "critic_free", f"{B}x1"),
          Variant("sao_groups", f"SAO {B // G}x{G} (groups)", "sao", f"{B // G}x{G}",
                  extra=LEARNING_CRITIC, tag="critic"))
    return Study("single_rollout", "Single rollout vs groups, and the prompt-diversity control",
                 "curves", vs, DATASET_BASE, seeds=CRITIC_SEEDS,
                 comparisons=(("sao", "grpo_same_rollouts"),
                              ("sao", "critic_free"), ("critic_free", "grpo_same_rollouts"),
                              ("sao", "sao_groups"), ("sao_groups", "grpo_same_rollouts")))


STALENESS = (0, 2, 4, 8)
ASYNC_METHODS = (("sao", "SAO", f"{B}x1"), ("grpo", "GRPO (PPO-clip)", f"{B // G}x{G}"),
                 ("grpo_dis", "GRPO + DIS", f"{B // G}x{G}"))


def _staleness_study(name: str, title: str, staleness: Sequence[int],
                     base: Tuple[Tuple[str, object], ...], tag: str = "") -> Study:
    """Forced staleness k in `staleness` for every ASYNC_METHODS method; SAO against each GRPO
    at every k, and every method's largest k against k = 0."""
    vs = tuple(Variant(f"{m}_k{k}", f"{label} k={k}", m, shape, k, "forced", tag=tag,
                       series=label, param=k)
               for m, label, shape in ASYNC_METHODS for k in staleness)
    comps = tuple((f"sao_k{k}", f"{m}_k{k}") for k in staleness for m in ("grpo", "grpo_dis"))
    comps += tuple((f"{m}_k{staleness[-1]}", f"{m}_k0") for m, _, _ in ASYNC_METHODS)
    return Study(name, title, "staleness", vs, base, comparisons=comps,
                 param_name="staleness k")


def _asynchrony() -> Study:
    return _staleness_study("asynchrony", "Forced staleness k: SAO against GRPO (PPO-clip) and "
                            "GRPO + DIS", STALENESS, DATASET_BASE)


# The same question where the policy moves 6-7x further per version: make run-dataset's learning
# rates (policy and critic 2e-4) and the two ends of the staleness range. At the main studies'
# 3e-5 the KL between a rollout's policy and the learner's stays ~1e-4 even at k = 8, too little
# drift for a correction to matter (docs/REPRODUCTION.md, "Asynchrony").
STRESS_LR = 2e-4
STRESS_STALENESS = (0, 8)


def _asynchrony_stress() -> Study:
    base = tuple((k, v) for k, v in DATASET_BASE if k not in ("policy_lr", "critic_lr")) + (
        ("policy_lr", STRESS_LR), ("critic_lr", STRESS_LR))
    # tag: another workload than the asynchrony study's cells of the same method and k
    return _staleness_study("asynchrony_stress", f"Forced staleness at lr {STRESS_LR:g}: SAO "
                            "against GRPO (PPO-clip) and GRPO + DIS", STRESS_STALENESS, base,
                            tag="lr2e-4")


ABLATION_K = 4    # the off-policy corrections are compared where they have stale tokens to act on


def _ablations() -> Study:
    corr = tuple(Variant(f"sao_{loss}_k{ABLATION_K}", f"{name} (k={ABLATION_K})", m, f"{B}x1",
                         ABLATION_K, "forced", extra=LEARNING_CRITIC, tag="critic",
                         series="off-policy correction")
                 for loss, name, m in (("dis", "DIS", "sao"),
                                       ("tis", "TIS", "sao_tis"),
                                       ("none", "no correction", "sao_none")))
    critic = (dataclasses.replace(SAO, id="sao_frozen_k2", label="frozen-attention critic, K=2",
                                  series="critic"),
              Variant("sao_full_critic", "full critic, K=2", "sao", f"{B}x1",
                      extra=LEARNING_CRITIC + (("critic_frozen_patterns", ()),),
                      tag="critic_fullcritic", series="critic"),
              Variant("sao_k1", "frozen-attention critic, K=1", "sao", f"{B}x1",
                      extra=LEARNING_CRITIC + (("critic_updates", 1),), tag="critic_k1",
                      series="critic"))
    return Study("ablations", "Ablations of SAO's parts: the off-policy correction and the critic",
                 "ablation", corr + critic, DATASET_BASE, seeds=CRITIC_SEEDS,
                 comparisons=tuple((f"sao_dis_k{ABLATION_K}", f"sao_{x}_k{ABLATION_K}")
                                   for x in ("tis", "none"))
                 + (("sao_frozen_k2", "sao_full_critic"), ("sao_frozen_k2", "sao_k1")))


def _gae() -> Study:
    # tags: another workload than the dataset studies' cells of the same method
    vs = (Variant("skip_observation", "skip-observation GAE", "sao", f"{B}x1", tag="calc",
                  series="GAE"),
          Variant("standard", "standard GAE", "sao", f"{B}x1", extra=(("gae", "standard"),),
                  tag="calc_gaestandard", series="GAE"))
    return Study("gae", "Skip-observation vs standard GAE on the multi-turn calculator task",
                 "ablation", vs, CALCULATOR_BASE, seeds=CHEAP_SEEDS,
                 comparisons=(("skip_observation", "standard"),))


# Value-pretraining budgets (rollouts of the warm start fitted before RL, critic/fit.py) against
# the critic's held-out EV at the start of RL and the accuracy it ends with; 0 is the cold start
# (a zero head, no pretraining), "offline" the critic directory of `make critic-dataset`.
PRETRAIN_ROLLOUTS = (0, 240, 720)
PRETRAIN_FIT = (("critic_lr", CRITIC_LR), ("critic_minibatches", CRITIC_MINIBATCHES))
# A 720-rollout cell spends ~7 min fitting its critic on 2 shared cores: 2 seeds fitted in the
# session's time (docs/REPRODUCTION.md reports it without a verdict).
PRETRAIN_SEEDS = {720: (0, 1)}


def _value_pretrain() -> Study:
    vs = tuple(Variant(f"pretrain_{n}", f"pretrain {n} rollouts", "sao", f"{B}x1",
                       extra=PRETRAIN_FIT + (("value_pretrain_rollouts", n),),
                       tag=f"critic_pretrain{n}", series="sao", param=n,
                       seeds=PRETRAIN_SEEDS.get(n))
               for n in PRETRAIN_ROLLOUTS)
    offline = dataclasses.replace(SAO, id="pretrain_offline", label="value-pretrained critic "
                                  "directory (2,400 rollouts)", series="offline", param=2400)
    return Study("value_pretrain", "Value pretraining scale: explained variance and accuracy",
                 "pretrain", vs + (offline,), DATASET_BASE, seeds=CRITIC_SEEDS,
                 comparisons=tuple((f"pretrain_{n}", "pretrain_0") for n in PRETRAIN_ROLLOUTS[1:])
                 + (("pretrain_offline", "pretrain_0"),),
                 param_name="value_pretrain_rollouts")


def _online_shift() -> Study:
    # tag "shift": another workload than the dataset studies' cells of the same method
    vs = (Variant("sao", f"SAO {B}x1", "sao", f"{B}x1", tag="shift"),
          Variant("grpo", f"GRPO {B // G}x{G}", "grpo", f"{B // G}x{G}", tag="shift"),
          Variant("critic_free", f"critic-free {B}x1", "critic_free", f"{B}x1", tag="shift"))
    return Study("online_shift", "Online shift: the reward rule flips every 40 versions",
                 "shift", vs, SHIFT_BASE, seeds=CHEAP_SEEDS,
                 comparisons=(("sao", "grpo"), ("sao", "critic_free"), ("critic_free", "grpo")))


def _smoke() -> Study:
    vs = (Variant("sao", "SAO 4x1", "sao", "4x1", 1, tag="smoke"),
          Variant("grpo", "GRPO 2x2", "grpo", "2x2", 1, tag="smoke"))
    return Study("smoke", "Smoke: output format only", "curves", vs, SMOKE_BASE,
                 comparisons=(("sao", "grpo"),))


STUDIES: Dict[str, Study] = {s.name: s for s in (
    _single_rollout(), _asynchrony(), _asynchrony_stress(), _ablations(), _gae(), _value_pretrain(), _online_shift(),
    _smoke())}
# The stability presets (arithmetic workload; not in `all`: run them by name).
STUDIES.update(stability_presets.STUDIES)
STABILITY_KINDS = ("stability", "calibration")
# Where a variant runs on another workload than its study's base (none at present).
VARIANT_BASES: Dict[Tuple[str, str], Tuple[Tuple[str, object], ...]] = {}
FULL = ("single_rollout", "asynchrony", "asynchrony_stress", "ablations", "gae", "value_pretrain",
        "online_shift")


def base_of(study: Study, variant: Variant) -> Tuple[Tuple[str, object], ...]:
    return VARIANT_BASES.get((study.name, variant.id), study.base)


def with_dataset(base: Tuple[Tuple[str, object], ...], dataset_dir: str = DATASET_DIR,
                 model: str = DATASET_MODEL) -> Tuple[Tuple[str, object], ...]:
    """`base` with the dataset workload's files and warm start at other paths (task=dataset
    bases only; others are returned unchanged)."""
    if dict(base).get("task") != "dataset":
        return base
    paths = {"model": model, "train_files": (os.path.join(dataset_dir, "train.parquet"),),
             "eval_files": (os.path.join(dataset_dir, "test.parquet"),)}
    return tuple((k, paths.get(k, v)) for k, v in base)


# --- one run -> one record ---------------------------------------------------------------------
RUN_COLUMNS = ("study", "variant", "label", "series", "param") + sweeps.RESULT_COLUMNS + (
    "rollouts_trained", "mean_eval_accuracy", "mid_eval_accuracy", "late_gain", "gain",
    "late_kl", "late_masked_frac", "late_ess", "pretrain_final_ev", "early_ev", "late_ev",
    "critic_heldout_ev_start", "critic_heldout_ev_end", "collapse_step", "eval_steps_to_recover", "phase_mean_accuracy", "recovered_shifts",
    "mean_steps_to_recover", "phase_mean_reward", "collapse_cause", "steps_survived")
CURVE_COLUMNS = ("study", "variant", "seed", "step", "rollouts", "wall_time_s", "reward_mean",
                 "eval_accuracy", "kl_rollout", "masked_frac", "ess", "explained_variance",
                 "staleness_mean", "response_length_mean", "token_entropy_mean", "chi2_token",
                 "ratio_outside_band_frac")
EARLY_STEPS = 5
RECOVER_WINDOW = 5      # steps of the training reward's moving average (online shift)
RECOVER_FRACTION = 0.75  # recovered at this fraction of the pre-shift level


def _mean(xs: Sequence) -> Optional[float]:
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def eval_points(run_dir: str) -> List[Tuple[int, float]]:
    return [(r["policy_version"], r["eval_accuracy"]) for r in read_metrics(run_dir, "eval")
            if isinstance(r.get("eval_accuracy"), (int, float))]


def run_record(study: Study, variant: Variant, row: Dict, config: SAOConfig) -> Dict:
    """results.csv's row of one run: the sweep row and the study's extra columns."""
    rec = dict(row, study=study.name, variant=variant.id, label=variant.label,
               series=variant.series, param=variant.param)
    if row.get("status") != "ok":
        return rec
    run_dir = row["run_dir"]
    train = read_metrics(run_dir, "train")
    evals = sm.bin_curve(eval_points(run_dir), config.eval_every)
    late = train[len(train) // 2:]
    mid_step = config.max_steps // 2 // max(config.eval_every, 1) * max(config.eval_every, 1)
    rec.update(
        rollouts_trained=train[-1].get("rollouts_trained") if train else None,
        mean_eval_accuracy=_mean(list(evals.values())),
        mid_eval_accuracy=evals.get(mid_step),
        late_kl=_mean([r.get("kl_rollout") for r in late]),
        late_masked_frac=_mean([r.get("masked_frac") for r in late]),
        late_ess=_mean([r.get("ess") for r in late]),
        early_ev=_mean([r.get("explained_variance") for r in train[:EARLY_STEPS]]),
        late_ev=_mean([r.get("explained_variance") for r in late]))
    if rec.get("final_eval_accuracy") is not None and rec.get("initial_eval_accuracy") is not None:
        rec["gain"] = rec["final_eval_accuracy"] - rec["initial_eval_accuracy"]
    if rec.get("final_eval_accuracy") is not None and rec["mid_eval_accuracy"] is not None:
        rec["late_gain"] = rec["final_eval_accuracy"] - rec["mid_eval_accuracy"]
    pre = read_metrics(run_dir, "value_pretrain_done")
    rec["pretrain_final_ev"] = pre[-1].get("heldout_ev") if pre else None
    yard = read_metrics(run_dir, "critic_eval")   # the critic on its fixed held-out rollouts
    rec["critic_heldout_ev_start"] = yard[0]["critic_heldout_ev"] if yard else None
    rec["critic_heldout_ev_end"] = yard[-1]["critic_heldout_ev"] if yard else None
    nonfinite = next((r["step"] for r in train
                      if not isinstance(r.get("policy_loss", 0.0), (int, float))
                      or not math.isfinite(r.get("policy_loss", 0.0))), None)
    if study.kind in STABILITY_KINDS:   # the stability study's rule (studies/collapse.py)
        found = collapse_rule.collapse(
            sorted(evals.items()), [(r["step"], r["reward_mean"]) for r in train],
            [(r["step"], r["response_length_mean"]) for r in train
             if isinstance(r.get("response_length_mean"), (int, float))], nonfinite)
        rec["collapse_step"], rec["collapse_cause"] = found if found else (None, None)
        rec["steps_survived"] = found[0] if found else config.max_steps
        return rec
    # (the online shift's reward falls at every shift by design: no collapse test there)
    rec["collapse_step"] = None if study.kind == "shift" else sm.collapse_step(
        [(r["step"], r["reward_mean"]) for r in train], sweeps.REWARD_WINDOW,
        sweeps.COLLAPSE_REWARD_FRACTION, sorted(evals.items()), sweeps.COLLAPSE_EVAL_DROP,
        nonfinite)
    if study.kind == "shift":
        shifts = shift_records(train, evals, config)

        def censored(key):   # a shift not recovered from within its phase counts as the phase
            return _mean([config.shift_every if s[key] is None else s[key] for s in shifts])
        rec.update(recovered_shifts=sum(s["eval_steps_to_recover"] is not None for s in shifts),
                   eval_steps_to_recover=censored("eval_steps_to_recover"),
                   mean_steps_to_recover=censored("steps_to_recover"),
                   phase_mean_accuracy=_mean([s["eval_phase_mean"] for s in shifts]),
                   phase_mean_reward=_mean([s["phase_mean"] for s in shifts]))
    return rec


def shift_records(train: Sequence[Dict], evals: Dict[int, float], config: SAOConfig
                  ) -> List[Dict]:
    """Adaptation after each reward shift: on held-out accuracy under the current rule
    (study_metrics.eval_recovery, the eval_* keys) and on the training reward
    (study_metrics.recovery, RECOVER_WINDOW-step moving average)."""
    rewards = {r["step"]: r["reward_mean"] for r in train}
    by_reward = sm.recovery(rewards, config.shift_every, config.max_steps, RECOVER_WINDOW,
                            RECOVER_FRACTION)
    by_eval = {e["shift"]: e for e in sm.eval_recovery(evals, config.shift_every,
                                                       config.max_steps, RECOVER_FRACTION)}
    out = []
    for r in by_reward:
        e = by_eval.get(r["shift"], {})
        out.append(dict(r, eval_pre=e.get("pre_level"), eval_at_shift=e.get("at_shift"),
                        eval_phase_mean=e.get("phase_mean"),
                        eval_steps_to_recover=e.get("steps_to_recover")))
    return out


RECOVERY_COLUMNS = ("variant", "seed", "shift", "shift_step", "to_phase", "eval_pre",
                    "eval_at_shift", "eval_phase_mean", "eval_steps_to_recover", "pre_level",
                    "dip", "dip_step", "phase_mean", "steps_to_recover")


def shift_table(run_dir: str, config: SAOConfig) -> List[Dict]:
    """recovery.csv's rows of one run (shift_records from its metrics)."""
    return shift_records(read_metrics(run_dir, "train"),
                         sm.bin_curve(eval_points(run_dir), config.eval_every), config)


def curve_rows(study: Study, variant: Variant, row: Dict, config: SAOConfig) -> List[Dict]:
    """curves.csv's rows of one run: step 0 (the warm start's accuracy) and every learner step,
    with the held-out accuracy filed under its eval_every bin."""
    if row.get("status") != "ok":
        return []
    run_dir = row["run_dir"]
    evals = sm.bin_curve(eval_points(run_dir), config.eval_every)
    out = [dict(study=study.name, variant=variant.id, seed=row["seed"], step=0, rollouts=0,
                wall_time_s=0.0, eval_accuracy=evals.get(0))]
    for r in read_metrics(run_dir, "train"):
        out.append(dict(study=study.name, variant=variant.id, seed=row["seed"], step=r["step"],
                        rollouts=r.get("rollouts_trained"), wall_time_s=r.get("wall_time_s"),
                        reward_mean=r.get("reward_mean"), eval_accuracy=evals.get(r["step"]),
                        kl_rollout=r.get("kl_rollout"), masked_frac=r.get("masked_frac"),
                        ess=r.get("ess"), explained_variance=r.get("explained_variance"),
                        staleness_mean=r.get("staleness_mean"),
                        response_length_mean=r.get("response_length_mean"),
                        token_entropy_mean=r.get("token_entropy_mean"),
                        chi2_token=r.get("chi2_token"),
                        ratio_outside_band_frac=r.get("ratio_outside_band_frac")))
    return out


# --- per variant: means and intervals ----------------------------------------------------------
SUMMARY_METRICS = ("final_eval_accuracy", "gain", "late_gain", "mean_eval_accuracy",
                   "final_reward", "late_kl", "late_masked_frac", "late_ess",
                   "mean_explained_variance", "pretrain_final_ev", "early_ev", "late_ev",
                   "critic_heldout_ev_start", "critic_heldout_ev_end", "mean_staleness",
                   "eval_steps_to_recover", "phase_mean_accuracy", "mean_steps_to_recover",
                   "phase_mean_reward", "wall_time_s",
                   "rollouts_trained", "steps_survived")
SUMMARY_COLUMNS = ("study", "variant", "label", "series", "param", "n", "failed", "collapsed",
                   "collapse_steps") + tuple(f"{m}_{x}" for m in SUMMARY_METRICS
                                             for x in ("mean", "lo", "hi"))
COMPARISON_METRICS = ("final_eval_accuracy", "mean_eval_accuracy", "gain")
COMPARISON_COLUMNS = ("study", "a", "b", "metric", "n_a", "n_b", "mean_a", "mean_b", "diff",
                      "lo", "hi", "verdict") + tables.COLUMNS


def _ok(records: Sequence[Dict], vid: str) -> List[Dict]:
    return [r for r in records if r["variant"] == vid and r.get("status") == "ok"]


def summary_rows(study: Study, records: Sequence[Dict]) -> List[Dict]:
    out = []
    for v in study.variants:
        ok = _ok(records, v.id)
        row = dict(study=study.name, variant=v.id, label=v.label, series=v.series,
                   param=v.param, n=len(ok),
                   failed=sum(1 for r in records if r["variant"] == v.id
                              and r.get("status") != "ok"),
                   collapsed=sum(1 for r in ok if r.get("collapse_step") is not None),
                   collapse_steps=" ".join(str(r["collapse_step"]) for r in ok
                                           if r.get("collapse_step") is not None))
        for m in SUMMARY_METRICS:
            ci = sm.mean_ci([r.get(m) for r in ok])
            row.update({f"{m}_mean": ci["mean"], f"{m}_lo": ci["lo"], f"{m}_hi": ci["hi"]})
        out.append(row)
    return out


def comparison_rows(study: Study, records: Sequence[Dict]) -> List[Dict]:
    metrics = (("eval_steps_to_recover", "phase_mean_accuracy", "mean_steps_to_recover",
                "phase_mean_reward") if study.kind == "shift" else COMPARISON_METRICS)
    if study.kind in STABILITY_KINDS:   # + steps before the collapse (max_steps: none)
        metrics = COMPARISON_METRICS + ("steps_survived",)
    out = []
    for a, b in study.comparisons:
        ra, rb = _ok(records, a), _ok(records, b)
        for m in metrics:
            xa, xb = [r.get(m) for r in ra], [r.get(m) for r in rb]
            d = sm.welch(xa, xb)
            out.append(dict(study=study.name, a=a, b=b, metric=m, n_a=len(ra), n_b=len(rb),
                            mean_a=sm.mean_ci(xa)["mean"], mean_b=sm.mean_ci(xb)["mean"],
                            diff=d["diff"], lo=d["lo"], hi=d["hi"], verdict=sm.verdict(d),
                            p_value=sm.welch_p(xa, xb)))
    return tables.adjust(out)


def _fmt(x, digits: int = 3) -> str:
    """`digits` decimals; a value too small to show in them (a KL of 1e-4) in scientific form."""
    if x is None or x == "":
        return "-"
    x = float(x)
    return f"{x:.1e}" if 0 < abs(x) < 0.5 * 10 ** -digits else f"{x:.{digits}f}"


def _ci(row: Dict, m: str, digits: int = 3) -> str:
    mean, lo, hi = row.get(f"{m}_mean"), row.get(f"{m}_lo"), row.get(f"{m}_hi")
    if mean is None:
        return "-"
    if lo is None:
        return _fmt(mean, digits)
    return f"{_fmt(mean, digits)} [{_fmt(lo, digits)}, {_fmt(hi, digits)}]"


def summary_markdown(study: Study, summary: Sequence[Dict], comps: Sequence[Dict],
                     info: Dict) -> str:
    """summary.md: the per-variant table (mean [95% CI]) and the comparisons."""
    cols = [("final_eval_accuracy", "final acc"), ("gain", "gain"),
            ("late_gain", "gain, 2nd half"), ("mean_eval_accuracy", "mean acc (AUC)")]
    if study.kind == "staleness":
        cols += [("late_kl", "KL"), ("late_masked_frac", "masked"), ("late_ess", "ESS")]
    if study.kind == "pretrain":
        cols += [("pretrain_final_ev", "EV after pretrain"), ("early_ev", "EV, first 5 steps")]
    if study.kind in ("curves", "ablation", "pretrain") and study.base is DATASET_BASE:
        # the mechanisms under test, active or not: the critic's EV (in-batch, late; on its
        # fixed held-out rollouts at the start and end), drift and staleness
        cols += [("late_ev", "EV, 2nd half"), ("critic_heldout_ev_start", "held-out EV start"),
                 ("critic_heldout_ev_end", "held-out EV end"), ("late_kl", "KL"),
                 ("late_ess", "ESS"), ("mean_staleness", "staleness")]
    if study.kind in STABILITY_KINDS:
        cols = [("final_eval_accuracy", "final acc"), ("mean_eval_accuracy", "mean acc (AUC)"),
                ("steps_survived", "steps before collapse"), ("late_kl", "KL, 2nd half"),
                ("late_ess", "ESS, 2nd half"), ("late_masked_frac", "masked, 2nd half")]
    if study.kind == "shift":
        cols = [("eval_steps_to_recover", "steps to recover (held-out)"),
                ("phase_mean_accuracy", "phase mean acc"),
                ("mean_steps_to_recover", "steps to recover (reward)"),
                ("phase_mean_reward", "phase mean reward")]
    cols += [("wall_time_s", "wall s")]
    lines = [f"# {study.title}", "",
             f"{info.get('cells', '?')} runs ({len(study.variants)} variants x "
             f"{len(study.seeds)} seeds), seeds {','.join(map(str, study.seeds))}; "
             f"mean [95% t interval over seeds].", "",
             "| variant | n | " + " | ".join(c for _, c in cols) + " | collapsed |",
             "|---|---|" + "---|" * len(cols) + "---|"]
    for r in summary:
        lines.append(f"| {r['label']} | {r['n']} | " + " | ".join(
            _ci(r, m, 1 if m == "wall_time_s" else 3) for m, _ in cols)
            + f" | {r['collapsed']}/{r['n']}" + (f" (steps {r['collapse_steps']})"
                                                 if r["collapse_steps"] else "") + " |")
    if comps:
        lines += ["", "| a - b | metric | diff [95% Welch CI] | verdict | p | p (Holm) |",
                  "|---|---|---|---|---|---|"]
        label = {v.id: v.label for v in study.variants}
        for c in comps:
            lines.append(f"| {label[c['a']]} - {label[c['b']]} | {c['metric']} | "
                         f"{_fmt(c['diff'])} [{_fmt(c['lo'])}, {_fmt(c['hi'])}] | "
                         f"{c['verdict']} | {tables.fmt_p(c.get('p_value'))} | "
                         f"{tables.holm_cell(c)} |")
        lines += [""] + tables.family_lines(comps)
    return "\n".join(lines) + "\n"


def cells_of(study: Study) -> List[Tuple[Variant, sweeps.Cell]]:
    """Seed-major: every variant's seed 0, then every variant's seed 1, ..., so that a study
    stopped part-way has its comparisons on equal numbers of seeds."""
    return [(v, v.cell(seed)) for seed in study.seeds for v in study.variants
            if v.seeds is None or seed in v.seeds]


def output_names(study: Study) -> Tuple[str, ...]:
    from experiments.studies import plots as study_plots
    from experiments.studies import stability
    return ("results.csv", "curves.csv", "summary.csv", "comparisons.csv", "summary.md",
            "study.json") + study_plots.plot_names(study) + (
        ("recovery.csv",) if study.kind == "shift" else ()) + (
        stability.output_names(study) if study.kind in STABILITY_KINDS else ())


def study_dir(out_dir: str, study: Study) -> str:
    return os.path.join(out_dir, study.name)
