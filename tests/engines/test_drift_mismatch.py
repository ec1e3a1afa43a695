"""Precision and sampling mismatch (docs/USAGE.md "Drift lab"): actors built with
--actor_dtype sample from a lower-precision copy of the policy and record that copy's log-probs,
which differ from the learner's float32 recomputation of the same tokens by a measured amount;
actors in a labelled sampling-mismatch experiment sample at their own temperature/top-p and
record those log-probs, not the ones the learner assumes. Bad input fails before launch naming
the flags. No learning outcome is asserted."""
import dataclasses
import sys

import pytest
import torch

from sao_actor_learner.actor_builder import make_engine, sampling_params
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.distributions import sampling_logprobs
from sao_actor_learner.models.checkpoint import sync_state_dict
from sao_actor_learner.tasks.arithmetic import ArithmeticTask

torch.set_num_threads(1)
PROMPTS = 16


def prompts(engine):
    task = ArithmeticTask(seed=0, num_eval=PROMPTS, tokenizer=engine.tokenizer)
    return [list(p.token_ids) for p in task.eval_prompts()]


def recomputed(model, prompt, tokens, temperature=1.0, top_p=1.0):
    """log-probs of `tokens` after `prompt` under `model` in float32 at (temperature, top_p):
    what the learner computes for a rollout (teacher forcing)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp = sampling_logprobs(logits[len(prompt) - 1:-1], temperature, top_p)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def gaps(generations, model, batch, **kw):
    """|stored log-prob - recomputed log-prob| over every generated token."""
    out = []
    for g, p in zip(generations, batch):
        out += (torch.tensor(g.logprobs) - recomputed(model, p, g.tokens, **kw)).abs().tolist()
    return torch.tensor(out)


def test_bf16_actor_logprobs_differ_from_the_fp32_recomputation_of_the_same_tokens(warm_start):
    config = SAOConfig(init_checkpoint=warm_start, actor_dtype="bfloat16")
    actor = make_engine(config, role="actor_0")
    learner_copy = make_engine(config, role="evaluator")      # float32, as the learner's
    assert actor.model.dtype == torch.bfloat16 and learner_copy.model.dtype == torch.float32
    # The learner publishes float32 weights; the bf16 actor casts them when it loads them.
    published = {k: v.clone() for k, v in sync_state_dict(learner_copy.model).items()}
    actor.load_weights(published, 1)
    assert actor.version == 1
    for name, t in sync_state_dict(actor.model).items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, published[name].to(torch.bfloat16))
    batch = prompts(actor)
    params = sampling_params(config, stop_ids=actor.tokenizer.stop_ids, actor=True)
    params = dataclasses.replace(params, seed=3)
    bf16 = gaps(actor.generate(batch, params), learner_copy.model, batch)
    fp32 = gaps(learner_copy.generate(batch, params), learner_copy.model, batch)
    # Control: a float32 actor's log-probs are the recomputation's up to float32 rounding.
    assert fp32.max() < 1e-4
    # bf16: a measured, nonzero gap (seeded: mean 4.0e-3, max 3.5e-2 over 55 tokens of the warm
    # start; float16: mean 6.3e-4; the float32 control: mean 1.9e-7).
    assert bf16.mean() > 1e-3 and bf16.mean() > 100 * fp32.mean()


def test_fp16_actor_runs_on_cpu_and_vllm_refuses_a_lower_precision(warm_start):
    config = SAOConfig(init_checkpoint=warm_start, actor_dtype="float16")
    actor = make_engine(config, role="actor_0")
    assert actor.model.dtype == torch.float16
    params = sampling_params(config, stop_ids=actor.tokenizer.stop_ids, actor=True)
    out = actor.generate(prompts(actor)[:4], params)
    assert all(torch.isfinite(torch.tensor(g.logprobs)).all() for g in out)
    with pytest.raises(ConfigError, match="actor_dtype='bfloat16' with engine='vllm'.*"
                       "--engine=torch"):
        SAOConfig(engine="vllm", vllm_python=sys.executable, actor_dtype="bfloat16")
    SAOConfig(engine="vllm", vllm_python=sys.executable, actor_dtype="float32")   # no mismatch
    with pytest.raises(ConfigError, match="actor_dtype='float64': must be float32, bfloat16"):
        SAOConfig(actor_dtype="float64")


def test_sampling_mismatch_actors_record_their_own_distribution(warm_start):
    config = SAOConfig(init_checkpoint=warm_start, drift_experiment="sampling_mismatch",
                       drift_actor_temperature=0.7, drift_actor_top_p=0.9)
    engine = make_engine(config, role="actor_0")
    actor_params = sampling_params(config, stop_ids=engine.tokenizer.stop_ids, actor=True)
    assumed = sampling_params(config, stop_ids=engine.tokenizer.stop_ids)
    assert (actor_params.temperature, actor_params.top_p) == (0.7, 0.9)
    assert (assumed.temperature, assumed.top_p) == (1.0, 1.0)   # the learner's, the evaluator's
    batch = prompts(engine)
    gens = engine.generate(batch, dataclasses.replace(actor_params, seed=5))
    own = gaps(gens, engine.model, batch, temperature=0.7, top_p=0.9)
    learner = gaps(gens, engine.model, batch)                   # what the learner assumes
    assert own.max() < 1e-4
    assert learner.mean() > 1e-2


@pytest.mark.parametrize("flags,message", [
    (dict(drift_actor_temperature=0.7), "drift_actor_temperature=0.7 without drift_experiment="
     "'sampling_mismatch'"),
    (dict(drift_actor_top_p=0.9), "drift_actor_top_p=0.9 without drift_experiment"),
    (dict(drift_experiment="sampling_mismatch"), "nothing differs"),
    (dict(drift_experiment="sampling_mismatch", drift_actor_temperature=1.0), "nothing differs"),
    (dict(drift_experiment="sampling_mismatch", drift_actor_temperature=0.0),
     "drift_actor_temperature=0.0: greedy actors"),
    (dict(drift_experiment="sampling_mismatch", drift_actor_top_p=1.5),
     r"drift_actor_top_p=1.5: must be in \(0, 1\]"),
    (dict(drift_experiment="sampling_mismatch", drift_actor_temperature=0.7,
          policy_loss="none"), "policy_loss='none'"),
    (dict(drift_experiment="mismatch"), "drift_experiment='mismatch': must be sampling_mismatch"),
])
def test_a_mismatch_needs_its_label_and_a_setting_that_shows_it(flags, message):
    with pytest.raises(ConfigError, match=message):
        SAOConfig(**flags)
