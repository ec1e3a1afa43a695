"""The staleness planner (experiments/staleness/planner.py) against queues whose answer is known
in closed form, its inputs (lengths, costs, fitting to a run) and its bad input."""
import json
import math
import os

import numpy as np
import pytest

from experiments.staleness import planner
from experiments.staleness.inputs import (Costs, PlanError, fit_costs, lengths_from_run,
                                          parse_lengths)
from experiments.staleness.planner import Setting, closed_form_deterministic, simulate


def _setting(**kw):
    base = dict(batch_size=16, max_staleness=4, num_actors=2, actor_batch=8,
                queue_capacity=1000, max_steps=60, admission_poll_s=0.0)
    base.update(kw)
    return Setting(**base)


def test_lockstep_throughput_is_one_batch_per_generation_plus_training():
    # Deterministic: 2 actors x 8 = one batch of 16 per version; each version waits for the
    # weight load, the generation, the learner step and the publish in turn.
    costs = Costs(gen_call_s=0.1, gen_token_s=0.01, learner_step_s=0.2, learner_token_s=0.001,
                  publish_s=0.05, load_s=0.03, prompt_tokens=5)
    setting = _setting(max_staleness=0, queue_capacity=32)
    r = simulate(setting, costs, parse_lengths("fixed:10"))
    gen = 0.1 + 0.01 * 80
    train = 0.2 + 0.001 * 16 * 15 + 0.05
    assert r.steady_rollouts_per_s == pytest.approx(16 / (0.03 + gen + train), rel=1e-9)
    assert r.steady_rollouts_per_s == pytest.approx(
        closed_form_deterministic(setting, costs, 10)["lockstep"], rel=1e-9)
    assert r.staleness_hist == [16 * 60] and r.dropped_stale == 0
    assert r.admission_wait_frac > 0.2          # actors idle while the learner trains


@pytest.mark.parametrize("gen_token_s,bound", [(0.01, "actors"), (0.0001, "learner")])
def test_with_room_to_overlap_the_slower_side_sets_the_rate(gen_token_s, bound):
    costs = Costs(gen_call_s=0.1, gen_token_s=gen_token_s, learner_step_s=0.2,
                  learner_token_s=0.001, publish_s=0.05)
    setting = _setting(max_staleness=4, queue_capacity=64)
    r = simulate(setting, costs, parse_lengths("fixed:10"))
    actor_rate = 2 * 8 / (0.1 + gen_token_s * 80)
    learner_rate = 16 / (0.2 + 0.001 * 160 + 0.05)
    assert (actor_rate < learner_rate) == (bound == "actors")
    assert r.steady_rollouts_per_s == pytest.approx(min(actor_rate, learner_rate), rel=0.01)
    assert r.steady_rollouts_per_s == pytest.approx(
        closed_form_deterministic(setting, costs, 10)["overlapped"], rel=0.01)
    if bound == "learner":
        assert r.learner_busy_frac > 0.95


def test_free_generation_trains_every_rollout_exactly_eta_stale_after_the_start():
    # Admission lets actors run (eta + 1) batches ahead; with generation far faster than the
    # learner every rollout waits eta versions: the limit's purpose, in one number.
    costs = Costs(gen_call_s=1e-4, learner_step_s=1.0, publish_s=0.1)
    for eta in (1, 3):
        r = simulate(_setting(max_staleness=eta, max_steps=40), costs, parse_lengths("fixed:4"))
        assert r.staleness_hist == [16] * eta + [16 * (40 - eta)]
        assert r.dropped_stale == 0
        assert r.steady_rollouts_per_s == pytest.approx(16 / 1.1, rel=1e-6)


def test_a_batch_waits_for_its_longest_response():
    # Stochastic closed form: lengths ~ Exp(mean m), a call costs gen_step_s x its longest
    # response, and E[max of A exponentials] = m * H_A; the learner is all but free, so the
    # rate is N * A / (gen_step_s * m * H_A).
    m, a, n, step = 50.0, 4, 2, 0.001
    costs = Costs(gen_step_s=step, learner_step_s=1e-6)
    r = simulate(_setting(batch_size=8, actor_batch=a, num_actors=n, max_staleness=8,
                          max_steps=3000), costs, parse_lengths(f"exponential:{m}"), seed=1)
    harmonic = sum(1.0 / k for k in range(1, a + 1))
    assert r.steady_rollouts_per_s == pytest.approx(n * a / (step * m * harmonic), rel=0.03)


def test_late_rollouts_are_dropped_and_nothing_staler_than_eta_is_trained():
    costs = Costs(gen_call_s=0.05, gen_token_s=0.002, learner_step_s=0.3, publish_s=0.02,
                  load_s=0.01)
    setting = _setting(batch_size=32, num_actors=2, actor_batch=8, max_staleness=1,
                       queue_capacity=64, max_steps=80, actor_delay="heavy_tailed",
                       actor_delay_mean_s=0.25, actor_delay_max_s=5.0)
    r = simulate(setting, costs, parse_lengths("lognormal:20,1.0"))
    assert r.dropped_stale > 0
    assert len(r.staleness_hist) <= 2 and sum(r.staleness_hist) == 32 * 80
    # every dropped rollout came back as admission credit: more generated than trained
    assert r.rollouts_generated >= sum(r.staleness_hist) + r.dropped_stale


def test_the_setting_comes_from_the_programs_config():
    from sao_actor_learner.config import SAOConfig
    config = SAOConfig(batch_size=16, num_actors=3, actor_batch=4, lockstep=True)
    s = Setting.from_config(config)
    assert (s.max_staleness, s.queue_capacity, s.num_actors) == (0, 32, 3)
    with pytest.raises(PlanError, match="group_size=4"):
        Setting.from_config(SAOConfig(batch_size=16, group_size=4, actor_batch=8))


# --- inputs ---------------------------------------------------------------------------------
def test_length_distributions_have_their_means_and_caps():
    rng = np.random.default_rng(0)
    assert parse_lengths("lognormal:400,0.8").sample(rng, 200_000).mean() == \
        pytest.approx(400, rel=0.02)
    assert parse_lengths("pareto:100,2.5").sample(rng, 200_000).mean() == \
        pytest.approx(100, rel=0.05)
    capped = parse_lengths("lognormal:4000,1.0", cap=8000)
    assert capped.sample(rng, 10_000).max() == 8000 and capped.mean() < 4000


@pytest.mark.parametrize("spec,match", [
    ("", "--lengths=''"), ("gamma:3", "KIND"), ("fixed:", "finite number"),
    ("pareto:100,1.0", "no finite mean"), ("lognormal:nan,1", "finite number"),
    ("uniform:5,2", "LO <= HI")])
def test_bad_length_specs_fail_naming_the_flag(spec, match):
    with pytest.raises(PlanError, match=match) as e:
        parse_lengths(spec)
    assert "--lengths" in str(e.value)


def test_an_empty_or_non_finite_length_file_fails_naming_the_flag(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"response_lengths": []}))
    with pytest.raises(PlanError, match=r"--lengths.*empty distribution"):
        parse_lengths(f"file:{empty}")
    bad = tmp_path / "bad.json"
    bad.write_text("[10, Infinity]")
    with pytest.raises(PlanError, match=r"--lengths.*no finite mean"):
        parse_lengths(f"file:{bad}")
    with pytest.raises(PlanError, match=r"--lengths.*empty distribution"):
        parse_lengths(f"run:{tmp_path}")        # a folder with no recorded lengths
    good = tmp_path / "lengths.json"   # rollout_lengths.py's format: total minus prompt
    good.write_text(json.dumps({"lengths": [15, 25], "prompt_lengths": [5, 5]}))
    assert parse_lengths(f"file:{good}").mean() == 15


def test_costs_refuse_negative_or_free_generation_naming_the_flag():
    with pytest.raises(PlanError, match="--publish_s=-1"):
        Costs(gen_call_s=1, publish_s=-1)
    with pytest.raises(PlanError, match="--gen_call_s, --gen_token_s, --gen_step_s"):
        Costs(learner_step_s=1)
    with pytest.raises(PlanError, match="--limits is empty"):
        planner.curve(_setting(), Costs(gen_call_s=1), parse_lengths("fixed:1"), [])


def test_costs_and_lengths_are_fitted_to_a_runs_logs(tmp_path):
    # A synthetic run whose generation and learner times follow known lines exactly.
    rng = np.random.default_rng(0)
    with open(tmp_path / "generate_calls_actor_0.jsonl", "w") as f:
        for i in range(30):
            lengths = rng.integers(2, 40, size=4).tolist()
            t = 0.05 + 0.001 * sum(lengths) + 0.01 * max(lengths)
            f.write(json.dumps({"t0": float(i), "t1": i + t, "n": 4, "tokens": sum(lengths),
                                "lengths": lengths}) + "\n")
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 11):
            response = 10.0 + step
            tokens = 8 * (6 + response)
            step_time = 0.2 + 0.002 * tokens + 0.05 + 0.1
            f.write(json.dumps({"kind": "train", "step": step, "step_time_s": step_time,
                                "time": 10.0 * step,
                                "wait_s": 0.1, "publish_s": 0.05, "batch_size": 8,
                                "tokens_per_s": tokens / step_time,
                                "response_length_mean": response}) + "\n")
    with open(tmp_path / "actor_0_stats.json", "w") as f:
        json.dump({"weight_updates": 4, "weight_load_s": 0.2}, f)
    costs, notes = fit_costs(str(tmp_path))
    assert (costs.gen_call_s, costs.gen_token_s, costs.gen_step_s) == pytest.approx(
        (0.05, 0.001, 0.01), abs=1e-9)
    assert (costs.learner_step_s, costs.learner_token_s) == pytest.approx((0.2, 0.002), abs=1e-9)
    assert costs.prompt_tokens == pytest.approx(6.0)
    assert costs.publish_s == pytest.approx(0.05) and costs.load_s == pytest.approx(0.05)
    assert costs.learner_other_s == pytest.approx(
        np.mean([10.0 - (0.2 + 0.002 * 8 * (16 + s) + 0.15) for s in range(2, 11)]))
    assert set(notes) == {"generation", "learner", "prompt_tokens", "weight sync"}
    assert lengths_from_run(str(tmp_path), "--lengths").mean() > 2
    with pytest.raises(PlanError, match="--from_run"):
        fit_costs(str(tmp_path / "missing"))
    assert math.isinf(parse_lengths("fixed:3").cap)
