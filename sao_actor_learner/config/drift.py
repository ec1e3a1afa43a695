"""The drift lab's section of the run configuration: the drift sources a user can dial (a lag
distribution for forced staleness, the actors' precision, a labelled sampling mismatch, a
drifting reward) and the record of them that config.json, metrics and summary.json carry.

docs/USAGE.md ("Drift lab") shows them in use; docs/METHOD.md section 9 ("Drift sources") says
what each does to the behaviour policy. Checks that read other sections' fields
(forced_staleness, max_staleness, temperature, policy_loss, engine) are `check_drift`, run with
the checks across sections. Standard library only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Tuple

from sao_actor_learner.actors.lags import LAG_DISTRIBUTIONS, lag_pmf, lag_problem
from sao_actor_learner.config.sections import Fail, Section, choice, option

# "" : the engine's model in float32, the dtype of the weights the learner publishes.
ACTOR_DTYPES = ("", "float32", "bfloat16", "float16")
DRIFT_EXPERIMENTS = ("", "sampling_mismatch")
UNSET = -1.0   # drift_actor_temperature / drift_actor_top_p: the learner's value


@dataclasses.dataclass(frozen=True)
class DriftConfig(Section):
    """Drift sources as knobs (a drift experiment each; all off by default)."""
    forced_staleness_distribution: str = option(
        "constant", "With --forced_staleness=k: constant (every rollout exactly k stale), "
        "geometric or zipf (a lag drawn per actor batch over [0, max_staleness] with mean "
        "exactly k; needs max_staleness > 2k); actors/lags.py.")
    forced_staleness_tail_alpha: float = option(
        2.5, "forced_staleness_distribution=zipf: the power law's exponent alpha, P(lag=l) "
        "proportional to (l + c)^-alpha; must be > 2 (a finite mean); smaller is heavier.")
    actor_dtype: str = option(
        "", "The dtype of the actors' copy of the policy (float32, bfloat16, float16; torch "
        "engine): a precision mismatch with the learner; empty: float32, the published weights'.")
    drift_experiment: str = option(
        "", "The label of a deliberate mismatch: sampling_mismatch lets --drift_actor_temperature"
        " / --drift_actor_top_p differ from what the learner assumes; empty: none.")
    drift_actor_temperature: float = option(
        UNSET, "drift_experiment=sampling_mismatch: the actors' sampling temperature (the "
        "learner still scores with --temperature); -1: --temperature.")
    drift_actor_top_p: float = option(
        UNSET, "drift_experiment=sampling_mismatch: the actors' nucleus mass (the learner "
        "still scores with --top_p); -1: --top_p.")
    reward_drift_period: float = option(
        200.0, "task=preference_drift: policy versions per cycle of the preference weight's "
        "sinusoid.")
    reward_drift_amplitude: float = option(
        0.4, "task=preference_drift: the sinusoid's amplitude around 0.5 (the weight is "
        "clipped to [0, 1]).")
    reward_drift_walk_std: float = option(
        0.03, "task=preference_drift: the standard deviation of the weight's Gaussian random "
        "walk per policy version (seeded by --seed).")

    def check(self, fail: Fail) -> None:
        choice(self, "forced_staleness_distribution", LAG_DISTRIBUTIONS, fail)
        if self.actor_dtype not in ACTOR_DTYPES:
            fail(f"actor_dtype={self.actor_dtype!r}: must be float32, bfloat16, float16 or "
                 "empty (float32, the dtype of the weights the learner publishes)")
        if self.drift_experiment not in DRIFT_EXPERIMENTS:
            fail(f"drift_experiment={self.drift_experiment!r}: must be sampling_mismatch or "
                 "empty (no deliberate mismatch)")


def actor_sampling(config: Any) -> Tuple[float, float]:
    """(temperature, top_p) the actors sample training rollouts with."""
    t, p = config.drift_actor_temperature, config.drift_actor_top_p
    return (config.temperature if t == UNSET else t, config.top_p if p == UNSET else p)


def actor_dtype(config: Any) -> str:
    """The dtype of the actors' model ("" resolved)."""
    return config.actor_dtype or "float32"


def lag_mean(config: Any):
    """The exact mean of the forced staleness lag (k for constant); None without forced
    staleness."""
    if config.forced_staleness < 0:
        return None
    pmf = lag_pmf(config.forced_staleness_distribution, config.forced_staleness,
                  config.forced_staleness_tail_alpha, config.max_staleness)
    return sum(i * p for i, p in enumerate(pmf))


def check_drift(config: Any, fail: Fail) -> None:
    """The drift knobs against the rest of the configuration (module docstring)."""
    dist, k = config.forced_staleness_distribution, config.forced_staleness
    if dist != "constant":
        if k < 0:
            fail(f"forced_staleness_distribution={dist!r} with forced_staleness={k}: the "
                 "distribution's mean is forced_staleness; set --forced_staleness=k >= 0 "
                 "(the mean lag), or drop --forced_staleness_distribution")
        problem = lag_problem(dist, k, config.forced_staleness_tail_alpha, config.max_staleness)
        if problem:
            fail(f"forced_staleness_distribution={dist!r}, forced_staleness={k}, "
                 f"forced_staleness_tail_alpha={config.forced_staleness_tail_alpha}, "
                 f"max_staleness={config.max_staleness}: {problem}")
    if config.actor_dtype not in ("", "float32") and config.engine != "torch":
        fail(f"actor_dtype={config.actor_dtype!r} with engine={config.engine!r}: the vLLM "
             "engine serves the checkpoint's dtype and checks every weight load against it, "
             "so it cannot take a lower-precision copy of the learner's float32 weights; use "
             "--engine=torch for a precision mismatch, or drop --actor_dtype")
    _check_sampling_mismatch(config, fail)


def _check_sampling_mismatch(config: Any, fail: Fail) -> None:
    given = [f"{name}={getattr(config, name)}" for name in
             ("drift_actor_temperature", "drift_actor_top_p") if getattr(config, name) != UNSET]
    if config.drift_experiment != "sampling_mismatch":
        if given:
            fail(f"{', '.join(given)} without drift_experiment='sampling_mismatch': actors "
                 "sampling differently from what the learner assumes is a deliberate "
                 "experiment; add --drift_experiment=sampling_mismatch, or drop them")
        return
    temperature, top_p = actor_sampling(config)
    if not given or (temperature, top_p) == (config.temperature, config.top_p):
        fail(f"drift_experiment='sampling_mismatch' with actors sampling at temperature="
             f"{temperature}, top_p={top_p}, what the learner assumes (--temperature, "
             "--top_p): nothing differs; set --drift_actor_temperature or --drift_actor_top_p "
             "to another value")
    if not temperature > 0:
        fail(f"drift_experiment='sampling_mismatch' with drift_actor_temperature={temperature}:"
             " greedy actors record the raw model's log-probs, not those of the distribution "
             "they sampled from, which hides the mismatch; use a temperature > 0")
    if not 0 < top_p <= 1:
        fail(f"drift_actor_top_p={top_p}: must be in (0, 1] (or -1: --top_p)")
    if config.policy_loss == "none":
        fail("drift_experiment='sampling_mismatch' with policy_loss='none': that loss never "
             "reads the rollouts' log-probs, so the run cannot tell a mismatch from training "
             "at the actors' sampling settings (--temperature/--top_p); use a loss that "
             "corrects for the behaviour policy (dis, tis, icepop, ppo_clip, gspo)")


def knob_record(config: Any) -> Dict[str, Any]:
    """The drift knobs of a run as summary.json and the metrics rows record them."""
    temperature, top_p = actor_sampling(config)
    record: Dict[str, Any] = {
        "drift_experiment": config.drift_experiment or "none",
        "forced_staleness": config.forced_staleness,
        "forced_staleness_distribution": config.forced_staleness_distribution,
        "forced_staleness_tail_alpha": config.forced_staleness_tail_alpha,
        "forced_lag_mean": lag_mean(config),
        "actor_dtype": actor_dtype(config), "learner_dtype": config.dtype,
        "actor_temperature": temperature, "actor_top_p": top_p,
        "learner_temperature": config.temperature, "learner_top_p": config.top_p,
    }
    if config.task == "preference_drift":
        record.update(reward_drift_period=config.reward_drift_period,
                      reward_drift_amplitude=config.reward_drift_amplitude,
                      reward_drift_walk_std=config.reward_drift_walk_std)
    return record
