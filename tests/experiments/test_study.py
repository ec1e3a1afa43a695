"""programs/study.py: the presets are well formed, every study kind writes its CSV files and
figures (from finished runs written here, nothing trained), and the smoke preset runs for real
and resumes without rerunning finished cells. Output format only, never a learning outcome."""
import csv
import io
import json
import os
import random
import subprocess
import sys

import pytest

from experiments.studies import plots as study_plots
from experiments.studies import presets as studies
from sao_actor_learner.config import SAOConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_study(*args, timeout=300):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "programs", "study.py"), "--noprogress", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def rows_of(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def assert_outputs(folder, study):
    for name in studies.output_names(study):
        assert os.path.exists(os.path.join(folder, name)), name
    for name in study_plots.plot_names(study):
        with open(os.path.join(folder, name), "rb") as f:
            assert f.read(8) == PNG_MAGIC, name
    results = rows_of(os.path.join(folder, "results.csv"))
    assert list(results[0]) == list(studies.RUN_COLUMNS)
    assert len(results) == len(studies.cells_of(study))   # a variant may have fewer seeds
    assert all(r["status"] == "ok" for r in results)
    summary = rows_of(os.path.join(folder, "summary.csv"))
    assert list(summary[0]) == list(studies.SUMMARY_COLUMNS)
    assert [r["variant"] for r in summary] == [v.id for v in study.variants]
    assert all(r["n"] == str(len(study.variant(r["variant"]).seeds or study.seeds))
               for r in summary)
    for r in summary:   # a 95% interval around every mean of two seeds or more
        if int(r["n"]) < 2:
            continue
        assert float(r["final_eval_accuracy_lo"]) <= float(r["final_eval_accuracy_mean"]) <= \
            float(r["final_eval_accuracy_hi"])
    comps = rows_of(os.path.join(folder, "comparisons.csv"))
    assert not comps or list(comps[0]) == list(studies.COMPARISON_COLUMNS)
    assert {(c["a"], c["b"]) for c in comps} == set(study.comparisons)
    assert all(c["verdict"] in ("higher", "lower", "indistinguishable") for c in comps)
    for c in comps:   # p-values adjusted per metric: p <= Holm <= Bonferroni, Welch's p <-> CI
        if c["p_value"] == "":   # no test (e.g. no variance on either side): nothing adjusted
            assert c["p_holm"] == c["p_bonferroni"] == c["survives_holm"] == ""
            continue
        assert float(c["p_value"]) <= float(c["p_holm"]) <= float(c["p_bonferroni"]) <= 1.0
        assert (float(c["p_value"]) < 0.05) == (c["verdict"] != "indistinguishable")
        assert c["survives_holm"] == ("yes" if float(c["p_holm"]) < 0.05 else "no")
    curves = rows_of(os.path.join(folder, "curves.csv"))
    assert list(curves[0]) == list(studies.CURVE_COLUMNS)
    with open(os.path.join(folder, "study.json")) as f:
        info = json.load(f)
    assert info["cells"] == len(results) and info["failed"] == 0
    families = info["comparison_families"]
    assert sum(f["comparisons"] for f in families.values()) == len(comps)
    for metric, f in families.items():
        assert f["comparisons"] == sum(c["metric"] == metric for c in comps)
        assert f["tested"] == sum(c["metric"] == metric and c["p_value"] != "" for c in comps)
        assert f["survive_holm"] == sum(c["metric"] == metric and c["survives_holm"] == "yes"
                                        for c in comps)
    primary = families.get("final_eval_accuracy", {"comparisons": 0, "survive_holm": 0})
    with open(os.path.join(folder, "summary.md")) as f:   # (a study may compare nothing)
        assert not comps or (f"{primary['comparisons']} comparisons on final accuracy; "
                             f"{primary['survive_holm']} survive Holm at 0.05") in f.read()
    return results, summary, curves, info


# --- the presets ----------------------------------------------------------------------------
def test_presets_are_well_formed_and_cells_sharing_a_folder_are_one_config():
    by_name = {}
    for study in studies.STUDIES.values():
        # (the stability calibration and pilot are single runs, not comparisons over seeds)
        assert len(study.seeds) >= 3 or study.name in ("stability_calibration",
                                                       "stability_pilot"), study.name
        ids = [v.id for v in study.variants]
        assert len(ids) == len(set(ids)), study.name
        for a, b in study.comparisons:
            assert a in ids and b in ids, (study.name, a, b)
        for variant, cell in studies.cells_of(study):
            key = (studies.base_of(study, variant), cell)
            assert by_name.setdefault(cell.name, key) == key, cell.name
    for name in studies.FULL:
        assert name in studies.STUDIES
    # the studies reuse each other's cells: the asynchrony study's GRPO cells are the single-
    # rollout study's; SAO with the learning critic is in single_rollout, ablations (frozen,
    # K=2) and value_pretrain (the offline critic directory)
    cells = {name: {c.name for _, c in studies.cells_of(studies.STUDIES[name])}
             for name in ("asynchrony", "single_rollout", "ablations", "value_pretrain")}
    assert cells["single_rollout"] & cells["ablations"] & cells["value_pretrain"]
    for name in ("single_rollout", "ablations", "value_pretrain"):   # >= 5 seeds, the critic's
        assert len(studies.STUDIES[name].seeds) >= 5


# --- comparisons: Welch p-values adjusted per family ----------------------------------------
def test_comparisons_adjust_p_values_within_each_metric_and_mark_the_survivors():
    from experiments.studies import metrics as sm
    from experiments.studies import tables
    assert studies.COMPARISON_COLUMNS[:12] == (   # the original columns, unchanged, come first
        "study", "a", "b", "metric", "n_a", "n_b", "mean_a", "mean_b", "diff", "lo", "hi",
        "verdict")
    assert studies.COMPARISON_COLUMNS[12:] == ("p_value", "p_holm", "p_bonferroni",
                                               "survives_holm")
    study = studies.STUDIES["ablations"]
    rng = random.Random(7)
    level = {v.id: rng.uniform(0.2, 0.6) for v in study.variants}
    level[study.comparisons[0][0]] = 0.9          # one clear winner on every metric
    records = [dict(variant=v.id, status="ok", gain=rng.gauss(0, 0.02),
                    final_eval_accuracy=level[v.id] + rng.gauss(0, 0.02),
                    mean_eval_accuracy=level[v.id] + rng.gauss(0, 0.02))
               for v in study.variants for _ in study.seeds]
    records.append(dict(variant=study.variants[0].id, status="failed"))   # not counted
    comps = studies.comparison_rows(study, records)
    assert len(comps) == len(study.comparisons) * len(studies.COMPARISON_METRICS)
    for metric in studies.COMPARISON_METRICS:
        fam = [c for c in comps if c["metric"] == metric]
        assert len(fam) == len(study.comparisons)
        for c in fam:
            xa = [r[metric] for r in records if r["variant"] == c["a"] and r["status"] == "ok"]
            xb = [r[metric] for r in records if r["variant"] == c["b"] and r["status"] == "ok"]
            assert c["p_value"] == sm.welch_p(xa, xb)
        ps = [c["p_value"] for c in fam]
        assert [c["p_holm"] for c in fam] == sm.holm(ps)
        assert [c["p_bonferroni"] for c in fam] == sm.bonferroni(ps)
        assert [c["survives_holm"] for c in fam] == ["yes" if h < 0.05 else "no"
                                                     for h in sm.holm(ps)]
    primary = [c for c in comps if c["metric"] == "final_eval_accuracy"]
    survive = sum(c["survives_holm"] == "yes" for c in primary)
    assert survive >= 1 and primary[0]["survives_holm"] == "yes"
    assert tables.families(comps)["final_eval_accuracy"] == dict(
        comparisons=len(primary), tested=len(primary), survive_holm=survive)
    assert list(tables.families(comps))[0] == "final_eval_accuracy"
    summary = studies.summary_rows(study, records)
    md = studies.summary_markdown(study, summary, comps, {"cells": len(records)})
    assert f"{len(primary)} comparisons on final accuracy; {survive} survive Holm at 0.05" in md
    assert md.count(tables.MARK + " |") == sum(c["survives_holm"] == "yes" for c in comps)
    # one seed on a side: no p-value, not counted in the family; a study without final accuracy
    first = study.variants[0].id
    one = [r for r in records if r.get("status") == "ok" and r["variant"] != first]
    one.append(dict(records[0]))
    comps = studies.comparison_rows(study, one)
    untested = [c for c in comps if c["p_value"] is None]
    assert untested and all(c["p_holm"] is None and c["survives_holm"] is None
                            for c in untested)
    fam = tables.families(comps)["final_eval_accuracy"]
    assert fam["tested"] == fam["comparisons"] - len(untested) // 3
    shift = studies.STUDIES["online_shift"]
    rows = [c for c in comps if c["p_value"] is not None][:2] + untested[:1]
    rows = [dict(c, metric="phase_mean_accuracy", a="sao", b="grpo") for c in rows]
    md = studies.summary_markdown(shift, [], rows, {})
    assert "0 comparisons on final accuracy; 0 survive Holm at 0.05" in md
    assert "3 comparisons (1 without a p-value) on phase_mean_accuracy" in md


# --- every study kind's outputs, from runs written here ---------------------------------------
def fake_run(config: SAOConfig, rng: random.Random) -> None:
    """A finished run folder as run.run_program leaves it (config, summary, metrics)."""
    os.makedirs(config.run_dir, exist_ok=True)
    with open(os.path.join(config.run_dir, "config.json"), "w") as f:
        f.write(config.to_json())
    rows, acc, evals = [], rng.uniform(0.2, 0.5), {}
    if config.value_pretrain_rollouts:
        for epoch in range(3):
            rows.append({"kind": "value_pretrain", "step": epoch * 10, "epoch": epoch,
                         "heldout_ev": epoch / 10})
        rows.append({"kind": "value_pretrain_done", "heldout_ev": 0.2, "evaluations": 3,
                     "rollouts": config.value_pretrain_rollouts})
    if config.algorithm == "sao":
        rows += [{"kind": "critic_eval", "policy_version": v, "critic_heldout_ev": 0.3 - v / 1e3}
                 for v in (0, config.max_steps)]
    for step in range(config.max_steps + 1):
        if step % config.eval_every == 0 or step == config.max_steps:
            evals[step] = acc
            rows.append({"kind": "eval", "step": step, "policy_version": step,
                         "eval_accuracy": acc})
        acc = min(1.0, acc + rng.uniform(-0.01, 0.03))
        if step:
            rows.append({"kind": "train", "step": step, "policy_version": step,
                         "reward_mean": rng.random(), "rollouts_trained": step * 16,
                         "wall_time_s": 1.5 * step, "kl_rollout": rng.random() / 100,
                         "masked_frac": rng.random() / 10, "ess": 1 - rng.random() / 10,
                         "explained_variance": rng.random(), "staleness_mean": 1.0,
                         "staleness_max": 2, "policy_loss": 0.1})
    with open(os.path.join(config.run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(config.run_dir, "summary.json"), "w") as f:
        json.dump({"steps": config.max_steps, "initial_eval_accuracy": evals[0],
                   "final_eval_accuracy": evals[config.max_steps], "wall_time_s": 90.0,
                   "dropped_stale": 0}, f)


def test_every_study_writes_its_tables_and_figures_from_finished_runs(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.parquet", "test.parquet"):
        (data / name).write_bytes(b"")   # the config checks these exist; nothing reads them
    out = str(tmp_path / "study")
    rng = random.Random(0)
    for name in studies.FULL:
        study = studies.STUDIES[name]
        for variant, cell in studies.cells_of(study):
            base = studies.with_dataset(studies.base_of(study, variant), str(data),
                                        "no/such/model")
            fake_run(cell.config(SAOConfig(**dict(base)), out), rng)
    stdout = run_study("--preset=all", f"--out_dir={out}", f"--dataset_dir={data}",
                       "--dataset_model=no/such/model", f"--results_dir={tmp_path / 'res'}")
    assert "run now" in stdout
    for name in studies.FULL:
        study = studies.STUDIES[name]
        results, summary, curves, info = assert_outputs(os.path.join(out, name), study)
        assert info["cells_run_all_invocations"] == 0     # every cell was finished already
        assert os.path.exists(tmp_path / "res" / name / "summary.md")
        if name == "online_shift":
            shifts = rows_of(os.path.join(out, name, "recovery.csv"))
            assert len(shifts) == len(results) * 3   # 100 steps, a shift every 25
        if name == "value_pretrain":
            assert {r["param"] for r in summary} == {str(n) for n in studies.PRETRAIN_ROLLOUTS
                                                     } | {"2400"}
            assert all(r["critic_heldout_ev_start"] for r in results)
    shared = json.load(open(os.path.join(out, "ablations", "study.json")))
    assert shared["cells_shared_with_earlier_studies"]


# --- the real smoke preset, and resuming ------------------------------------------------------
@pytest.mark.timeout(600)
def test_smoke_preset_runs_and_resumes_without_rerunning_finished_cells(warm_start, tmp_path):
    out = str(tmp_path / "smoke")
    study = studies.STUDIES["smoke"]
    args = ("--preset=smoke", f"--out_dir={out}", f"--init_checkpoint={warm_start}")
    first = run_study(*args, "--workers=2")   # side by side (studies/pool.py); then one at a time
    assert f"running {len(study.variants) * len(study.seeds)} cells, 2 at a time" in first
    folder = os.path.join(out, "smoke")
    results, summary, curves, info = assert_outputs(folder, study)
    assert info["cells_run_all_invocations"] == len(results)
    for r in results:
        assert r["steps"] == "2" and r["seed"] in ("0", "1", "2")
        float(r["final_eval_accuracy"])
    # per-step curves: step 0 (the warm start) and every learner step of every run
    assert len(curves) == len(results) * 3
    mtimes = {r["run_dir"]: os.path.getmtime(os.path.join(r["run_dir"], "summary.json"))
              for r in results}
    again = run_study(*args)
    assert f"{len(results)} runs (0 run now, 0 failed)" in again
    assert rows_of(os.path.join(folder, "results.csv")) == results
    for run_dir, mtime in mtimes.items():
        assert os.path.getmtime(os.path.join(run_dir, "summary.json")) == mtime
    # an interrupted cell (no summary.json yet) is the only one run again
    os.remove(os.path.join(results[0]["run_dir"], "summary.json"))
    third = run_study(*args)
    assert f"{len(results)} runs (1 run now, 0 failed)" in third
    with open(os.path.join(folder, "invocations.jsonl")) as f:
        history = [json.loads(line) for line in f]
    assert [h["cells_run_now"] for h in history] == [len(results), 0, 1]
    assert [h["workers"] for h in history] == [2, 1, 1]
    assert history[0]["side_by_side_s"] > 0 and history[1]["side_by_side_s"] == 0
    for r in results:   # every side-by-side cell left its log and the config it ran
        name = os.path.basename(r["run_dir"])
        assert os.path.getsize(os.path.join(out, "logs", f"{name}.log")) > 0
        with open(os.path.join(out, "logs", f"{name}.config.json")) as f:
            assert SAOConfig.from_json(f.read()).run_dir == r["run_dir"]


def test_pool_reports_a_failed_cell_by_its_exit_status_and_refuses_shared_folders(tmp_path):
    from experiments.studies import pool
    bad = SAOConfig(run_dir=str(tmp_path / "runs" / "bad"),
                    init_checkpoint=str(tmp_path / "no_such_checkpoint"))
    with pytest.raises(ValueError, match="share a run_dir"):
        pool.run_in_processes([bad, bad], 2, str(tmp_path / "logs"))
    out = io.StringIO()
    status = pool.run_in_processes([bad], 2, str(tmp_path / "logs"), out=out)
    assert status[bad.run_dir] != 0
    assert "bad: failed (exit" in out.getvalue()
    with open(tmp_path / "logs" / "bad.log") as f:
        assert "no_such_checkpoint" in f.read()   # the child's own error, kept in its log
