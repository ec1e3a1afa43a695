"""The stability study's presets (docs/REPRODUCTION.md, "Stability"): does SAO stay stable where
GRPO collapses, under drift that is real? On the arithmetic workload (task=arithmetic from the
warm start, ~40-75 s per 300-step run on 2 cores), where a learning rate of 2e-4 and forced
staleness 8 give a KL between the rollout's policy and the learner's of ~0.17 while k = 0 learns.

- `stability_calibration`: first. A grid of policy_lr x batch (CALIBRATION_LRS x
  CALIBRATION_BATCHES) for every arm at k = 0 (2 seeds) and k = 8 (1 seed): a point passes when
  no arm's k = 0 run collapses and every arm's k = 8 runs have KL >= 1e-2 or ESS <= 0.9
  (calibration.csv and calibration.md; experiments/studies/stability.py). Set STABILITY_LR
  and STABILITY_BATCH to a passing point (1e-4 and 32: the calibration of 2026-12-03 passed
  it, docs/REPRODUCTION.md, "Stability under real drift").
- `stability`: the arms at forced staleness k in STALENESS_K, >= 300 policy steps, 5 seeds
  (10 for the headline pair, SAO and GRPO at HEADLINE_K), and the critic-quality arm at
  DRIFT_K (SAO with no value pretraining, a partial budget, the full one).
- `stability_pilot`: SAO and GRPO (PPO-clip) at every k, one seed, at PILOT_LR (2e-4, the
  drift probe's point): the pipeline end to end. Its k = 0 and 8 cells are the calibration's
  at lr 2e-4 and batch 32, so they are not run again there.

Beside the five arms: the decoupled PPO loss (GRPO + `ppo_clip_decoupled`) at every k, a
geometric staleness-lag distribution with mean DRIFT_K (SAO and GRPO), and a precision mismatch
at k = 0 (bf16 actors, fp32 learner; SAO, GRPO and GRPO + TIS).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from experiments.studies.study_types import Study, Variant

# --- the drift arms beside the five methods ---------------------------------------------------
DECOUPLED_LOSS = "ppo_clip_decoupled"   # proximal clip, behaviour importance weight
# A geometric lag with mean k lives on {0..max_staleness} and needs max_staleness > 2k
# (config/drift.py): the tail reaches 4k.
LAG_DISTRIBUTION = (("forced_staleness_distribution", "geometric"), ("max_staleness", 32))
# --actor_dtype: actors sample from a bf16 copy, the learner trains in fp32
PRECISION_MISMATCH = (("actor_dtype", "bfloat16"),)

# --- the workload -----------------------------------------------------------------------------
# The calibration (2026-12-03) passed lr 1e-4 x batch 32: no k=0 run of any arm collapsed, and
# every arm's k=8 runs drifted (KL 0.025-0.171, ESS 0.77-0.95; docs/REPRODUCTION.md, "Stability").
STABILITY_LR = 1e-4
STABILITY_BATCH = 32
PILOT_LR = 2e-4              # the pilot's (FACTS-style probe) point
GROUP = 4
STEPS = 300
STABILITY_BASE = (
    ("task", "arithmetic"), ("max_steps", STEPS), ("eval_every", 10), ("eval_size", 200),
    ("num_actors", 2), ("actor_batch", 8), ("launch", "local_mt"),
    ("replay_checkpoints", False))
STALENESS_K = (0, 8, 32)
DRIFT_K = 8                  # the critic-quality arm's staleness
HEADLINE_K = 32              # SAO vs GRPO: the largest k (at a point where k = 0 holds)
SEEDS = tuple(range(10))
FEW = tuple(range(5))        # every variant but the headline pair
# Value pretraining on the warm start's own rollouts (learner/value_pretraining.py): 512 took
# 3.4 s of fitting on this workload and reached a held-out EV of 0.37 (the pilot's first run).
VALUE_PRETRAIN_FULL = 512
VALUE_PRETRAIN_PARTIAL = 64
CRITIC_BUDGETS = (0, VALUE_PRETRAIN_PARTIAL, VALUE_PRETRAIN_FULL)


def _vp(n: int) -> Tuple[Tuple[str, object], ...]:
    return (("value_pretrain_rollouts", n),)


def arms(batch: int = STABILITY_BATCH) -> Tuple[Tuple[str, str, str, str, tuple, str], ...]:
    """(id, label, method, shape, extra, tag) of every arm at batch size `batch`."""
    single, groups = f"{batch}x1", f"{batch // GROUP}x{GROUP}"
    out = (("sao", "SAO (value-pretrained critic)", "sao", single, _vp(VALUE_PRETRAIN_FULL),
            f"vp{VALUE_PRETRAIN_FULL}"),
           ("critic_free", "critic-free 1 rollout + DIS", "critic_free", single, (), ""),
           ("grpo", "GRPO + PPO-clip", "grpo", groups, (), ""),
           ("grpo_dis", "GRPO + DIS", "grpo_dis", groups, (), ""),
           ("grpo_tis", "GRPO + TIS", "grpo_tis", groups, (), ""))
    return out + (("grpo_decoupled", "GRPO + decoupled PPO-clip", "grpo", groups,
                   (("policy_loss", DECOUPLED_LOSS),), "decoupled"),)


def _tag(*parts: str) -> str:
    return "_".join(p for p in parts if p)


def _lr_tag(lr: float) -> str:
    """In the cells' folder names: the calibration's cells at the chosen point are the
    stability study's own (the same cells, policy_lr among their extras) and run once."""
    return f"lr{lr:g}"


def _stability(policy_lr: Optional[float] = None) -> Study:
    policy_lr = STABILITY_LR if policy_lr is None else policy_lr
    vs = []
    lr_tag = _lr_tag(policy_lr)
    lr = (("policy_lr", policy_lr),)   # in the cells (as the calibration's), not the base
    for aid, label, method, shape, extra, tag in arms():
        for k in STALENESS_K:
            headline = k == HEADLINE_K and aid in ("sao", "grpo")
            vs.append(Variant(f"{aid}_k{k}", f"{label}, k={k}", method, shape, k, "forced",
                              extra=extra + lr, tag=_tag("stab", tag, lr_tag), series=label,
                              param=k,
                              seeds=None if headline else FEW))
    sao_method, sao_shape = "sao", f"{STABILITY_BATCH}x1"
    for n in CRITIC_BUDGETS[:-1]:    # the full budget is the SAO arm itself
        vs.append(Variant(f"sao_vp{n}_k{DRIFT_K}", f"SAO, value pretraining {n} rollouts, "
                          f"k={DRIFT_K}", sao_method, sao_shape, DRIFT_K, "forced",
                          extra=_vp(n) + lr, tag=_tag("stab", f"vp{n}", lr_tag),
                          series="critic quality",
                          param=n, seeds=FEW))
    for aid, label, method, shape, extra, tag in arms():
        if aid in ("sao", "grpo"):
            vs.append(Variant(f"{aid}_lag{DRIFT_K}", f"{label}, geometric lag, mean "
                              f"{DRIFT_K}", method, shape, DRIFT_K, "forced",
                              extra=extra + lr + LAG_DISTRIBUTION,
                              tag=_tag("stab", tag, lr_tag, "lag"),
                              series="lag distribution", param=DRIFT_K, seeds=FEW))
    for aid, label, method, shape, extra, tag in arms():
        if aid in ("sao", "grpo", "grpo_tis"):
            vs.append(Variant(f"{aid}_bf16", f"{label}, bf16 actors, k=0", method, shape,
                              0, "forced", extra=extra + lr + PRECISION_MISMATCH,
                              tag=_tag("stab", tag, lr_tag, "bf16"),
                              series="precision mismatch",
                              param=0, seeds=FEW))
    ids = [a[0] for a in arms()]
    comps = [(f"sao_k{HEADLINE_K}", f"grpo_k{HEADLINE_K}")]
    comps += [(f"sao_k{k}", f"{a}_k{k}") for k in STALENESS_K for a in ids[1:]
              if (f"sao_k{k}", f"{a}_k{k}") not in comps]
    comps += [(f"{a}_k{k}", f"{a}_k0") for a in ids for k in STALENESS_K[1:]]
    comps += [(f"sao_k{DRIFT_K}", f"sao_vp0_k{DRIFT_K}"),
              (f"sao_vp{VALUE_PRETRAIN_PARTIAL}_k{DRIFT_K}", f"sao_vp0_k{DRIFT_K}")]
    base = STABILITY_BASE
    return Study("stability", f"Stability under forced staleness (lr {policy_lr:g}, batch "
                 f"{STABILITY_BATCH}, {STEPS} steps)", "stability", tuple(vs), base,
                 seeds=SEEDS, comparisons=tuple(comps), param_name="staleness k")


def _pilot() -> Study:
    full = _stability(PILOT_LR)
    vs = tuple(dataclasses.replace(v, seeds=None) for v in full.variants
               if v.id in {f"{a}_k{k}" for a in ("sao", "grpo") for k in STALENESS_K})
    return Study("stability_pilot", f"Stability pilot: SAO and GRPO (PPO-clip), one seed, lr "
                 f"{PILOT_LR:g}",
                 "stability", vs, full.base, seeds=(0,),
                 comparisons=tuple((f"sao_k{k}", f"grpo_k{k}") for k in STALENESS_K),
                 param_name="staleness k")


CALIBRATION_LRS = (1e-4, 2e-4)
CALIBRATION_BATCHES = (32, 64)
CALIBRATION_K = (0, 8)
CALIBRATION_SEEDS = {0: (0, 1), 8: (0,)}
# a drift point: KL(rollout || current) at least this, or ESS at most this, at k >= 8
CALIBRATION_MIN_KL = 1e-2
CALIBRATION_MAX_ESS = 0.9


def calibration_point(lr: float, batch: int) -> str:
    return f"lr{lr:g}_b{batch}"


def _calibration() -> Study:
    vs = []
    for lr in CALIBRATION_LRS:
        for batch in CALIBRATION_BATCHES:
            point = calibration_point(lr, batch)
            for aid, label, method, shape, extra, tag in arms(batch):
                for k in CALIBRATION_K:
                    vs.append(Variant(f"{aid}_{point}_k{k}", f"{label}, lr {lr:g}, batch "
                                      f"{batch}, k={k}", method, shape, k, "forced",
                                      extra=extra + (("policy_lr", lr),),
                                      tag=_tag("stab", tag, _lr_tag(lr)), series=point,
                                      param=k, seeds=CALIBRATION_SEEDS[k]))
    return Study("stability_calibration", "Stability calibration: policy_lr x batch, k = 0 "
                 "must hold, k = 8 must drift", "calibration", tuple(vs), STABILITY_BASE,
                 seeds=(0, 1), param_name="staleness k")


# name -> the function that builds it (again, e.g. after a switch above is turned on)
STUDIES_FACTORY = {"stability_calibration": _calibration, "stability": _stability,
                   "stability_pilot": _pilot}
STUDIES: Dict[str, Study] = {name: make() for name, make in STUDIES_FACTORY.items()}
