"""The vLLM engine serves the converted SmolLM2-135M-Instruct directory (`make real-model`) and
its log-probs are the learner's: a real CPU vLLM server from `.venv-vllm` (one start, ~1-2
minutes), chat-template prompts of the real vocabulary, greedy and temperature-1 samples, each
token's log-prob against a teacher-forced transformers forward of the same directory.

Skipped when `.venv-vllm` is missing (tests/engines/test_vllm_engine.py's rule); the model directory is
missing only when `make real-model` was not run (a failure under make, a skip otherwise).
"""
import os

import pytest
import torch

import test_real_model
from sao_actor_learner.core import SamplingParams
from sao_actor_learner.distributions import sampling_logprobs
from sao_actor_learner.engines import VLLMEngine
from sao_actor_learner.engines.vllm_engine import resolve_vllm_python
from sao_actor_learner.models.checkpoint import load_policy

VLLM_PYTHON = resolve_vllm_python()
pytestmark = pytest.mark.skipif(not os.path.exists(VLLM_PYTHON),
                                reason=f"no vLLM environment at {VLLM_PYTHON}: `make vllm-env`")
real_model = test_real_model.real_model     # the fixture
# vLLM's log-probs against the learner's forward: the tolerance tests/engines/test_vllm_engine.py states
# for the tiny models (ATOL there), which the 30-layer float32 model holds too (measured 2.8e-5
# at most, 2026-12-02).
ATOL = 1e-4
CHATS = ["What is 2 plus 3? Answer after ####.", "Name a colour.",
         "Tom has 3 apples and buys 4 more. How many apples does he have?"]


def learner_logprobs(model, prompt, tokens, temperature):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt) + list(tokens)])).logits[0]
    logp = sampling_logprobs(logits, temperature if temperature > 0 else 1.0, 1.0)
    return logp[len(prompt) - 1:-1].gather(-1, torch.tensor(tokens)[:, None])[:, 0], logits


@pytest.mark.timeout(900)
def test_vllm_serves_the_real_model_with_the_learners_logprobs(real_model, tmp_path):
    torch.set_num_threads(2)
    model, tokenizer = load_policy(real_model)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    engine = VLLMEngine.from_checkpoint(real_model, version=0, start_timeout_s=600,
                                        log_path=str(tmp_path / "vllm_server.log"))
    try:
        assert engine.tokenizer.stop_ids == tokenizer.stop_ids == (2,)
        worst = 0.0
        for temperature in (0.0, 1.0):
            params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=11,
                                    stop_token_ids=tokenizer.stop_ids)
            for p, g in zip(prompts, engine.generate(prompts, params)):
                assert 0 < len(g.tokens) <= 12 and g.versions == [0] * len(g.tokens)
                if g.finish_reason == "stop":
                    assert g.tokens[-1] == 2 and 2 not in g.tokens[:-1]
                ref, logits = learner_logprobs(model, p, g.tokens, temperature)
                got = torch.tensor(g.logprobs, dtype=ref.dtype)
                worst = max(worst, float((got - ref).abs().max()))
                torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
                if temperature == 0.0:   # greedy: the forward's argmax, unless a near-tie
                    steps = logits[len(p) - 1:-1]
                    top2 = steps.topk(2, dim=-1).values
                    clear = (top2[:, 0] - top2[:, 1]) > 10 * ATOL
                    argmax = steps.argmax(-1)
                    assert (argmax[clear] == torch.tensor(g.tokens)[clear]).all()
        print(f"max |vLLM - learner| log-prob on the real model: {worst:.2e}")
    finally:
        engine.close()
