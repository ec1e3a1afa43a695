"""The planner's inputs from a command line, every assumption written down, and the preset of a
paper-scale cluster (programs/plan_staleness.py).

Costs and lengths come from, in order of precedence: a flag given explicitly, the preset
(--preset=paper), the run fitted with --from_run. Everything the planner takes is listed in the
report's assumptions with where it came from.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from experiments.staleness.inputs import (Costs, LengthDistribution, PlanError, costs_with,
                                          fit_costs, parse_lengths)
from experiments.staleness.planner import Setting

COST_FIELDS = tuple(f.name for f in dataclasses.fields(Costs))

# A paper-scale cluster: NOT measured here, every number an assumption stated in the report.
# SAO's paper trains Qwen3-30B-A3B (3B active parameters, an MoE) with 128 x 1 batches on long
# reasoning traces; the engines and the learner below are a plausible cluster for it.
PAPER_SCALE: Dict[str, object] = {
    "config": dict(batch_size=128, num_actors=32, actor_batch=16, max_new_tokens=16384,
                   max_sequence_length=18432,
                   max_steps=100, queue_capacity=0, actor_delay="none"),
    "lengths": "lognormal:6000,0.9",
    "costs": dict(gen_call_s=2.0, gen_token_s=0.0, gen_step_s=0.03, prompt_tokens=300.0,
                  learner_step_s=10.0, learner_token_s=1.3e-4, publish_s=20.0, load_s=10.0),
    "notes": [
        "policy: a 30B-parameter MoE with 3B active (the paper's Qwen3-30B-A3B)",
        "32 generation engines (e.g. vLLM on 64 GPUs, tensor-parallel 2), each generating "
        "16 prompts together (actor_batch 16): 512 rollouts in flight at most",
        "response lengths log-normal with mean 6000 tokens and sigma 0.9, capped at 16384 "
        "(max_new_tokens): long-tailed reasoning, about 6% of responses hit the cap",
        "an engine decodes its 16 sequences at 30 ms per token position (gen_step_s 0.03) and "
        "returns the batch when its longest response ends (a batch with a 16k response takes "
        "~8 min), plus 2 s of prefill and scheduling per call",
        "learner step: 10 s + 1.3e-4 s per batch token (128 x ~6300 tokens: about 2 minutes, "
        "the policy update and SAO's K=2 critic updates together, on its own GPUs)",
        "weight sync: 20 s to publish a version (60 GB of bf16 weights broadcast), 10 s for "
        "an engine to load it",
        "queue capacity 2 x batch (the program's default), admission control on, one learner",
    ],
}
PRESETS = {"paper": PAPER_SCALE}
# The config fields that describe the loop: with --from_run they default to the run's.
LOOP_FIELDS = ("batch_size", "num_actors", "actor_batch", "queue_capacity", "admission_control",
               "actor_delay", "actor_delay_mean_s", "actor_delay_max_s", "actor_delay_tail",
               "max_new_tokens", "max_sequence_length", "max_steps", "group_size")


def run_loop_fields(run_dir: str) -> Dict[str, object]:
    """The loop fields of a run's config.json ({} when it has none)."""
    import json
    import os
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        saved = json.load(f)
    return {k: saved[k] for k in LOOP_FIELDS if k in saved}

MODEL_ASSUMPTIONS = (
    "Each part runs at its own given speed: no contention for cores, GPUs or memory bandwidth "
    "between actors, learner and services (on a machine where they share cores, fit the "
    "costs to a run of the same layout)",
    "The evaluator, value pretraining and critic warm-up take no learner time; checkpoints "
    "and the rest of the loop between steps take learner_other_s",
    "A generation call's time is gen_call_s + gen_token_s x its tokens + gen_step_s x its "
    "longest response; an actor's granted prompts are generated together and inserted when "
    "the call returns (weight_sync_mode off; in-flight updates change how fast a call ends, "
    "not the staleness of its rollouts, which counts their oldest token)",
    "A learner step's time is learner_step_s + learner_token_s x the batch's prompt and "
    "response tokens, then publish_s, then learner_other_s before the next; an actor loads "
    "a newer version (load_s) before it generates with it",
    "Admission (variables/admission.Admission), the queue bound (config "
    "effective_queue_capacity), the learner's drop rule (learner/sampling.too_stale) and "
    "injected delays (actors/delays.sample_delays) are the program's own code",
    "An actor granted nothing waits for the next version or credit, then half of "
    "ADMISSION_RETRY_S (its retry sleep) on average",
    "Throughput counts from the first generate call to the last step's publish (as the "
    "tuner and programs/benchmarks/async_vs_sync.py measure); 'steady' over the second half "
    "of the steps",
)


def plan_inputs(config, lengths_spec: str, overrides: Dict[str, Optional[float]],
                from_run: str = "", preset: str = "") -> Tuple[Costs, LengthDistribution,
                                                               List[str]]:
    """(costs, lengths, the assumptions about them) from the flags' values."""
    notes: List[str] = []
    fitted: Optional[Costs] = None
    if from_run:
        fitted, fit_notes = fit_costs(from_run)
        notes += [f"{k}: {v}" for k, v in fit_notes.items()]
    given = {k: v for k, v in overrides.items() if v is not None}
    preset_costs = dict(PRESETS[preset]["costs"]) if preset else {}
    costs = costs_with(fitted, {**preset_costs, **given})
    sources = {k: ("flag" if k in given else "preset" if k in preset_costs else
                   "fitted" if fitted is not None else "default 0") for k in COST_FIELDS}
    notes.append("costs (s): " + ", ".join(f"{k}={getattr(costs, k):.4g} [{sources[k]}]"
                                           for k in COST_FIELDS))
    spec = lengths_spec or (PRESETS[preset]["lengths"] if preset else "") or \
        (f"run:{from_run}" if from_run else "")
    if not spec:
        raise PlanError("--lengths is empty and there is no --from_run or --preset: give the "
                        "response-length distribution, e.g. --lengths=lognormal:500,0.8")
    lengths = parse_lengths(spec, "--lengths", config.max_new_tokens)
    notes.append(f"response lengths: {lengths.describe()} (mean after the cap "
                 f"{lengths.mean():.1f} tokens)")
    if preset:
        notes += [f"preset {preset}: {n}" for n in PRESETS[preset]["notes"]]
    return costs, lengths, notes


def setting_notes(setting: Setting, limits: Sequence[int], seeds: int) -> List[str]:
    delay = "none" if setting.actor_delay == "none" else (
        f"{setting.actor_delay} mean {setting.actor_delay_mean_s:g}s, tail "
        f"{setting.actor_delay_tail:g}, cap {setting.actor_delay_max_s:g}s per rollout")
    return [f"loop: batch {setting.batch_size}, {setting.num_actors} actors x "
            f"{setting.actor_batch} prompts, queue capacity {setting.queue_capacity}, admission "
            f"{'on' if setting.admission_control else 'off'}, injected delay {delay}, "
            f"{setting.max_steps} learner steps simulated, {seeds} seed(s) averaged per limit, "
            f"limits {', '.join(map(str, limits))}"]
