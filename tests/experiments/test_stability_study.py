"""The stability presets (experiments/studies/stability_presets.py): every cell builds a valid
SAOConfig, the sizes the study promises (k, steps, seeds), the switched-off arms, the calibration
sharing the stability study's cells; and programs/study.py writing the stability outputs
(survival, collapse, early warning, calibration) from finished runs written here. Nothing is
trained; no learning outcome is asserted."""
import csv
import dataclasses
import json
import os
import random

import pytest

from experiments.studies import presets as studies
from experiments.studies import stability
from experiments.studies import stability_presets as sp
from sao_actor_learner.config import SAOConfig
from test_study import PNG_MAGIC, assert_outputs, run_study

STABILITY = ("stability_calibration", "stability", "stability_pilot")


def rows_of(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def with_seeds(study, seeds):
    """`study` with `seeds` (as --seeds gives it), each variant's own seeds cut to them."""
    return dataclasses.replace(study, seeds=seeds, variants=tuple(
        v if v.seeds is None else dataclasses.replace(v, seeds=tuple(s for s in v.seeds
                                                                   if s in seeds))
        for v in study.variants))


def configs(study, out="/tmp/unused"):
    return [(v, c, c.config(SAOConfig(**dict(studies.base_of(study, v))), out))
            for v, c in studies.cells_of(study)]


def test_every_cell_builds_a_valid_config_with_the_promised_sizes():
    for name in STABILITY:
        study = studies.STUDIES[name]
        assert name not in studies.FULL       # long: run by name, not in `all`
        ids = [v.id for v in study.variants]
        assert len(ids) == len(set(ids))
        for a, b in study.comparisons:
            assert a in ids and b in ids
        for v, cell, config in configs(study):   # SAOConfig validates on construction
            assert config.task == "arithmetic" and config.max_steps >= 300
            assert config.forced_staleness == v.staleness <= config.max_staleness
            assert config.batch_size == (sp.STABILITY_BATCH if name != "stability_calibration"
                                         else config.batch_size)
            if v.method == "sao":
                assert config.algorithm == "sao" and config.policy_loss == "dis"
    study = studies.STUDIES["stability"]
    assert {v.param for v in study.variants if v.series != "critic quality"} == {0, 8, 32}
    arms = {(c.algorithm, c.policy_loss, c.baseline if c.algorithm == "critic_free" else "")
            for _, _, c in configs(study)}
    assert {("sao", "dis", ""), ("critic_free", "dis", "running_mean"),
            ("grpo", "ppo_clip", ""), ("grpo", "dis", ""), ("grpo", "tis", "")} <= arms
    seeds = {}
    for v, cell in studies.cells_of(study):
        seeds.setdefault(v.id, set()).add(cell.seed)
    headline = (f"sao_k{sp.HEADLINE_K}", f"grpo_k{sp.HEADLINE_K}")
    assert study.comparisons[0] == headline
    assert all(len(seeds[h]) >= 10 for h in headline)
    assert all(len(s) >= 5 for s in seeds.values())
    # SAO's critic is value-pretrained; the critic-quality arm spans none, partial, full
    by_id = {v.id: c for v, _, c in configs(study)}
    assert by_id[f"sao_k{sp.DRIFT_K}"].value_pretrain_rollouts == sp.VALUE_PRETRAIN_FULL
    assert sorted(c.value_pretrain_rollouts for v, _, c in configs(study)
                  if v.series == "critic quality") == [0] * 5 + [sp.VALUE_PRETRAIN_PARTIAL] * 5
    # the calibration's cells at the chosen point are the study's own; the pilot's are the
    # study's at the pilot's learning rate, and the calibration's at that point
    names = {c.name for _, c in studies.cells_of(study)}
    pilot = {c.name for _, c in studies.cells_of(studies.STUDIES["stability_pilot"])}
    assert pilot <= {c.name for _, c in studies.cells_of(sp.STUDIES_FACTORY["stability"](
        sp.PILOT_LR))}
    calibration = {c.name for _, c in studies.cells_of(studies.STUDIES["stability_calibration"])}
    assert len(pilot & calibration) == 4          # SAO and GRPO at k = 0 and 8, seed 0
    shared = calibration & names
    assert len(shared) == len(sp.arms()) * 3      # every arm: k=0 seeds 0 and 1, k=8 seed 0
    mine = {cell.name: c for _, cell, c in configs(study)}
    for v, cell, config in configs(studies.STUDIES["stability_calibration"]):
        if cell.name in shared:
            assert dataclasses.replace(config, run_dir="") == dataclasses.replace(
                mine[cell.name], run_dir="")


def test_the_drift_arms_are_in_the_study_and_their_configs_build():
    study = studies.STUDIES["stability"]
    ids = {v.id for v in study.variants}
    assert ids >= {"grpo_decoupled_k0", "grpo_decoupled_k32", "sao_lag8", "grpo_lag8",
                   "sao_bf16", "grpo_bf16", "grpo_tis_bf16"}
    by_id = {v.id: v for v in study.variants}
    assert dict(by_id["grpo_decoupled_k8"].extra)["policy_loss"] == sp.DECOUPLED_LOSS
    for vid in ("sao_lag8", "grpo_lag8", "sao_bf16"):
        config = by_id[vid].cell(0).config(SAOConfig(**dict(study.base)), "/tmp/unused")
        if vid.endswith("lag8"):
            assert config.forced_staleness_distribution == "geometric"
            assert config.forced_staleness == 8 and config.max_staleness > 16
        else:
            assert config.actor_dtype == "bfloat16" and config.forced_staleness == 0


# --- outputs, from finished runs written here ---------------------------------------------------
def fake_run(config: SAOConfig, collapse_at=None) -> None:
    """A finished arithmetic run: accuracy 0.35 -> 0.8, KL 0.05 when stale (0 at k = 0), and
    after `collapse_at` accuracy 0.1 and reward 0.05."""
    rng = random.Random(config.seed * 1000 + config.forced_staleness)
    os.makedirs(config.run_dir, exist_ok=True)
    with open(os.path.join(config.run_dir, "config.json"), "w") as f:
        f.write(config.to_json())
    stale = config.forced_staleness > 0
    level = lambda s: 0.1 if collapse_at and s >= collapse_at else 0.35 + 0.45 * min(s, 100) / 100  # noqa: E731,E501
    rows, evals = [], {}
    for step in range(config.max_steps + 1):
        if step % config.eval_every == 0 or step == config.max_steps:
            evals[step] = level(step) + rng.uniform(-0.02, 0.02)
            rows.append({"kind": "eval", "step": step, "policy_version": step,
                         "eval_accuracy": evals[step]})
        if step:
            rows.append({"kind": "train", "step": step, "policy_version": step,
                         "reward_mean": max(0.0, level(step) - 0.05 + rng.uniform(-0.05, 0.05)),
                         "response_length_mean": 3.0 + rng.uniform(-0.2, 0.2),
                         "token_entropy_mean": 0.3, "rollouts_trained": step * 32,
                         "wall_time_s": 0.2 * step, "kl_rollout": 0.05 if stale else 0.0,
                         "ess": 0.85 if stale else 1.0, "chi2_token": 0.3 if stale else 0.0,
                         "ratio_outside_band_frac": 0.08 if stale else 0.0,
                         "masked_frac": 0.0, "explained_variance": 0.3,
                         "staleness_mean": float(config.forced_staleness),
                         "staleness_max": config.forced_staleness, "policy_loss": 0.1})
    with open(os.path.join(config.run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(config.run_dir, "summary.json"), "w") as f:
        json.dump({"steps": config.max_steps, "initial_eval_accuracy": evals[0],
                   "final_eval_accuracy": evals[config.max_steps], "wall_time_s": 60.0,
                   "dropped_stale": 0}, f)


COLLAPSE_AT = 150


def test_stability_outputs_from_finished_runs(tmp_path):
    out = str(tmp_path / "study")
    seeds = ("0", "1")
    planted = {}
    for name in STABILITY:
        study = with_seeds(studies.STUDIES[name], (0, 1))
        for v, cell, config in configs(study, out):
            at = COLLAPSE_AT if v.staleness == 32 else None
            planted[config.run_dir] = at
            if not os.path.exists(os.path.join(config.run_dir, "summary.json")):
                fake_run(config, at)
    stdout = run_study(f"--preset={','.join(STABILITY)}", f"--out_dir={out}",
                       f"--seeds={','.join(seeds)}", f"--results_dir={tmp_path / 'res'}")
    assert "0 run now" in stdout
    for name in STABILITY:
        study = with_seeds(studies.STUDIES[name], (0, 1))
        folder = os.path.join(out, name)
        results, summary, curves, info = assert_outputs(folder, study)
        assert os.path.exists(tmp_path / "res" / name / "survival.png")
        for r in results:   # the rule dates the planted collapse (2 evaluations below)
            at = planted[r["run_dir"]]
            assert r["collapse_step"] == ("" if at is None else str(at))
            assert r["collapse_cause"] == ("" if at is None else "accuracy")
            assert r["steps_survived"] == str(at or 300)
        assert {"response_length_mean", "token_entropy_mean", "chi2_token",
                "ratio_outside_band_frac"} <= set(curves[0])
        surv = rows_of(os.path.join(folder, "survival.csv"))
        for v in study.variants:
            last = [r for r in surv if r["variant"] == v.id and r["step"] == "300"]
            assert len(last) == 1
            assert float(last[0]["fraction"]) == (0.0 if v.staleness == 32 else 1.0)
            before = [r for r in surv if r["variant"] == v.id and r["step"] == str(COLLAPSE_AT - 10)]
            assert float(before[0]["fraction"]) == 1.0
            assert float(before[0]["lo"]) < 1.0 == float(before[0]["hi"])
        coll = {r["variant"]: r for r in rows_of(os.path.join(folder, "collapse.csv"))}
        for v in study.variants:
            c = coll[v.id]
            assert c["collapsed"] == (c["runs"] if v.staleness == 32 else "0")
            if v.staleness == 32:
                assert float(c["mean_step"]) == COLLAPSE_AT and c["causes"].startswith("accuracy")
        warn = rows_of(os.path.join(folder, "early_warning.csv"))
        kl = {r["variant"]: r for r in warn if r["indicator"] == "k3_kl_rise"
              and float(r["threshold"]) == 0.01}
        for v in study.variants:
            # KL 0.05 from the first step in stale runs: fires at step 5 (the first full window)
            if v.staleness == 32:
                assert kl[v.id]["hit"] == kl[v.id]["runs"] and float(kl[v.id]["lead_mean"]) == \
                    COLLAPSE_AT - 5
            elif v.staleness == 8:
                assert kl[v.id]["false_alarm"] == kl[v.id]["runs"]
            else:
                assert kl[v.id]["quiet"] == kl[v.id]["runs"]
        assert "all" in kl
        for png in ("survival.png", "early_warning.png"):
            with open(os.path.join(folder, png), "rb") as f:
                assert f.read(8) == PNG_MAGIC
        with open(os.path.join(folder, "stability.md")) as f:
            assert "Collapse rule" in f.read()
    cal = rows_of(os.path.join(out, "stability_calibration", "calibration.csv"))
    assert len(cal) == len(sp.CALIBRATION_LRS) * len(sp.CALIBRATION_BATCHES) * len(sp.arms())
    assert all(r["holds"] == "yes" and r["drifts"] == "yes" for r in cal)
    assert stability.passing_points(cal) == [sp.calibration_point(lr, b)
                                             for lr in sp.CALIBRATION_LRS
                                             for b in sp.CALIBRATION_BATCHES]
    with open(os.path.join(out, "stability_calibration", "calibration.md")) as f:
        assert "Passing points: lr0.0001_b32" in f.read()
