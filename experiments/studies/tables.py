"""Multiplicity of a study's comparisons: the p-value columns of comparisons.csv, their marks in
summary.md and the family sizes in study.json (experiments/studies/presets.py builds the rows).

A study compares pairs of variants (Study.comparisons, a - b) on several metrics, each with a
Welch 95% interval and a verdict. Making many comparisons makes some "higher"/"lower" verdicts
likely by chance, so each row also gets its Welch p-value adjusted within a family.

Families. One family per study and metric: all the comparisons the study makes on that metric,
whichever pair. The primary family is final held-out accuracy (PRIMARY_METRIC): the studies'
claims are read there, and summary.md says how many of its comparisons survive. Every other
metric (mean accuracy, gain; the online-shift study, which compares no final accuracy, has only
its adaptation metrics) is a secondary family of its own rather than pooled with the primary one:
the metrics of a pair are strongly correlated (mean accuracy and gain move with final accuracy),
so pooling them would charge the primary tests for near-duplicates, and adding a secondary
metric never weakens the primary tests. Families never span studies: each study answers its
own question, and cells shared between studies are an economy of computing, not one experiment.

Columns added to each row (after the original ones, which are unchanged):
  p_value        two-sided Welch t-test (metrics.welch_p), the test whose 95% interval gives
                 the verdict: p < 0.05 exactly when the verdict is not "indistinguishable".
                 Empty where welch has no interval (one seed, or no variance on either side;
                 such a row is not counted in its family's m).
  p_holm         Holm-Bonferroni (step-down) within the family (metrics.holm).
  p_bonferroni   min(1, m p) within the family (metrics.bonferroni).
  survives_holm  "yes" when p_holm < ALPHA (the difference holds at family-wise error rate
                 0.05), "no" otherwise, empty without a p-value ("yes"/"no" as sweeps'
                 `collapsed` column).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from experiments.studies import metrics as sm

PRIMARY_METRIC = "final_eval_accuracy"
ALPHA = 0.05
COLUMNS = ("p_value", "p_holm", "p_bonferroni", "survives_holm")
MARK = "†"     # summary.md: survives Holm at ALPHA within its family


def _family_key(row: Dict):
    return row.get("study"), row["metric"]


def adjust(rows: Sequence[Dict]) -> List[Dict]:
    """`rows` (each with study, metric and p_value) in the same order, each with p_holm,
    p_bonferroni and survives_holm added within its (study, metric) family."""
    out = [dict(r) for r in rows]
    families: Dict[tuple, List[int]] = {}
    for i, r in enumerate(out):
        families.setdefault(_family_key(r), []).append(i)
    for idx in families.values():
        ps = [out[i].get("p_value") for i in idx]
        for i, h, b in zip(idx, sm.holm(ps), sm.bonferroni(ps)):
            out[i].update(p_holm=h, p_bonferroni=b,
                          survives_holm=None if h is None else ("yes" if h < ALPHA else "no"))
    return out


def families(rows: Sequence[Dict]) -> Dict[str, Dict[str, int]]:
    """{metric: {"comparisons", "tested" (those with a p-value: Holm's m), "survive_holm"}} of
    one study's rows, the primary metric first (study.json's comparison_families)."""
    out: Dict[str, Dict[str, int]] = {}
    for r in sorted(rows, key=lambda r: r["metric"] != PRIMARY_METRIC):
        f = out.setdefault(r["metric"], dict(comparisons=0, tested=0, survive_holm=0))
        f["comparisons"] += 1
        f["tested"] += r.get("p_value") is not None
        f["survive_holm"] += r.get("survives_holm") == "yes"
    return out


def fmt_p(p: Optional[float]) -> str:
    if p is None or p == "":
        return "-"
    p = float(p)
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def holm_cell(row: Dict) -> str:
    """summary.md's Holm-adjusted p, marked when the comparison survives in its family."""
    return fmt_p(row.get("p_holm")) + (f" {MARK}" if row.get("survives_holm") == "yes" else "")


def family_lines(rows: Sequence[Dict]) -> List[str]:
    """summary.md's lines under the comparisons: the primary family's count (always), then
    each other family's."""
    fams = families(rows)

    def count(f: Dict[str, int]) -> str:
        untested = f["comparisons"] - f["tested"]
        return (f"{f['comparisons']} comparisons" + (f" ({untested} without a p-value)"
                                                     if untested else ""))
    primary = fams.pop(PRIMARY_METRIC, dict(comparisons=0, tested=0, survive_holm=0))
    lines = [f"{MARK}: survives Holm's correction at {ALPHA:g} within its family (the study's "
             "comparisons on that metric).", "",
             f"{count(primary)} on final accuracy; {primary['survive_holm']} survive Holm at "
             f"{ALPHA:g}."]
    if fams:
        lines.append("Other families: " + "; ".join(
            f"{count(f)} on {m}, {f['survive_holm']} survive" for m, f in fams.items()) + ".")
    return lines
