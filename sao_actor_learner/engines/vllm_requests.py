"""The vLLM engine's requests, as pure functions: a checked prompt, a generate request's body,
and the Generation read from the server's answer (vllm_engine.VLLMEngine sends and counts them).

Log-probs (`Generation.logprobs`, the behaviour policy, as TorchEngine defines it):
  vLLM's default `raw_logprobs` are log_softmax(logits) BEFORE temperature and top-p. The server
  runs with `processed_logprobs`: log_softmax(logits / T) after top-p masking, i.e. renormalised
  over the nucleus, and for greedy requests log_softmax(logits). Measured against a
  teacher-forced forward pass of the same weights in transformers (float32, tiny Llama): max
  |difference| 1.9e-6 on the warm start; <= 1.5e-5 on the tests' model (LM head x20, 24 rows x 300
  tokens) at T=1, 0.7, greedy and T=1.3 with top_p=0.9; tests assert atol 1e-4. The error grows
  with the logits' scale (2e-4 on the warm start with its LM head x20), as float32 rounding does.

Token budget: vLLM refuses prompt + max_tokens > max_model_len (the checkpoint's
max_position_embeddings by default), so a request's max_tokens is clipped to the room left
(finish_reason "length"); a prompt with no room left is an error.

Standard library only.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from sao_actor_learner import core
from sao_actor_learner.engines.vllm_process import VLLMServerError


def check_prompt(index: int, prompt: Sequence[int], vocab: int,
                 max_model_len: Optional[int]) -> List[int]:
    """Prompt `index` as a list of ids; a ValueError when it is empty, has ids outside
    [0, vocab) or leaves no room to generate under `max_model_len`."""
    ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError(f"prompt {index} is empty: every prompt needs at least one token "
                         "(start it with <bos>)")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt {index} has token ids {bad[:5]} outside the vocabulary "
                         f"[0, {vocab})")
    if max_model_len is not None and len(ids) >= max_model_len:
        raise ValueError(f"prompt {index} has {len(ids)} tokens; the served model's "
                         f"max_model_len is {max_model_len}, leaving no room to "
                         "generate: shorten the prompt")
    return ids


def request_body(prompt: List[int], params: core.SamplingParams, stop_ids: List[int],
                 seed: Optional[int], max_model_len: Optional[int],
                 extra_args: Optional[dict] = None) -> dict:
    """The body of one /inference/v1/generate request (token ids in and out, the sampled
    tokens' processed log-probs; max_tokens clipped to the room left; no request_id yet)."""
    max_tokens = params.max_new_tokens
    if max_model_len is not None:
        max_tokens = min(max_tokens, max_model_len - len(prompt))
    sampling = {"max_tokens": max_tokens, "temperature": float(params.temperature),
                "top_p": float(params.top_p), "logprobs": 0,
                "stop_token_ids": stop_ids, "detokenize": False}
    if seed is not None:
        sampling["seed"] = seed
    if extra_args:
        sampling["extra_args"] = dict(extra_args)
    return {"token_ids": prompt, "sampling_params": sampling, "output_mode": "tokens"}


def parse_choice(choice: dict, initial_version: int) -> core.Generation:
    """The Generation of one answered (not aborted) request: tokens, log-probs, and per token
    the version of vLLM's `weight_versions` span holding it ("default": `initial_version`)."""
    tokens = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = [float(c["logprob"]) for c in content]
    if len(logprobs) != len(tokens):
        raise VLLMServerError(f"the vLLM server returned {len(tokens)} tokens but "
                              f"{len(logprobs)} log-probs; was it started with "
                              "--logprobs-mode processed_logprobs?")
    versions = [initial_version] * len(tokens)
    for span in choice.get("weight_versions") or []:
        v = initial_version if span["version"] in (None, "default") else int(span["version"])
        for i in range(int(span["start"]), min(int(span["end"]), len(tokens))):
            versions[i] = v
    reason = choice.get("finish_reason") or "length"
    return core.Generation(tokens=tokens, logprobs=logprobs, versions=versions,
                           finish_reason="stop" if reason == "stop" else "length")
