"""Supervised fine-tuning of a Hugging Face causal LM on chat data, and its evaluation.

Rendering (the contract shared with the RL side): a (prompt messages, response text) pair is the
prompt ids `tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
return_dict=True)["input_ids"]` followed by the target ids `tokenizer.encode(response,
add_special_tokens=False) + [id of <|im_end|>]`. The loss is the mean next-token negative
log-likelihood over the target ids only; prompt tokens are context.

`train` runs a fixed number of AdamW steps (never a time budget, so results do not depend on the
machine's speed) on batches drawn without replacement from the shuffled examples (each batch
of similar lengths, to cut padding), with linear warm-up, cosine decay to zero and
gradient-norm clipping, and returns the per-step losses.

`evaluate` measures a model on (prompt messages, ground truth) problems by batched generation
with a KV cache (left padding, attention mask, position ids), stopping at <|im_end|> or
<|endoftext|> or after max_new_tokens. A response is correct when the last "#### <number>" in
its text (decoded with skip_special_tokens, commas removed) equals the ground truth:
  greedy_accuracy                    greedy decoding
  sampled_accuracy                   one temperature-1 sample per problem
  sampled_accuracy_on_greedy_wrong   temperature-1 samples on the problems greedy gets wrong
  pass_at_K_on_greedy_wrong          any of the K samples correct, on those problems
  length_*                           greedy completion lengths in tokens (the stop token counts)
Only torch and transformers are used.
"""
from __future__ import annotations

import inspect
import math
import re
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

Messages = List[Dict[str, str]]
ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_answer(text: str) -> Optional[str]:
    """The last "#### n" number of a response (commas removed), or None."""
    matches = ANSWER_RE.findall(text)
    return matches[-1].replace(",", "") if matches else None


def stop_ids(tokenizer) -> List[int]:
    return tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])


def prompt_ids(tokenizer, prompt: Messages) -> List[int]:
    out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)
    return list(out["input_ids"])


def encode_example(tokenizer, prompt: Messages, response: str) -> Tuple[List[int], List[int]]:
    """(token ids, loss mask): the mask is 1 exactly on the response tokens and <|im_end|>."""
    p = prompt_ids(tokenizer, prompt)
    target = tokenizer.encode(response, add_special_tokens=False) + [stop_ids(tokenizer)[0]]
    return p + target, [0] * len(p) + [1] * len(target)


def collate(encoded: Sequence[Tuple[List[int], List[int]]], pad_id: int):
    """(ids [B, L], loss mask [B, L]) right-padded; padding only follows real tokens, so the
    causal mask alone keeps it out of every trained position."""
    width = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width))
    for i, (x, m) in enumerate(encoded):
        ids[i, :len(x)] = torch.tensor(x)
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.float)
    return ids, mask


def response_loss(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean NLL of the masked tokens, each predicted from the tokens before it; the output
    layer runs only at the positions that predict a masked token."""
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state[:, :-1]
    keep = mask[:, 1:] > 0
    logits = model.get_output_embeddings()(hidden[keep]).float()
    return torch.nn.functional.cross_entropy(logits, ids[:, 1:][keep])


def lr_at(step: int, steps: int, lr: float, warmup_steps: int) -> float:
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def epoch_batches(lengths: Sequence[int], batch_size: int, gen: torch.Generator,
                  bucket: int = 16) -> List[List[int]]:
    """One epoch of index batches in random order; each batch holds examples of similar
    length (sorted within random groups of `bucket` batches) to cut padding."""
    if len(lengths) < batch_size:
        raise ValueError(f"{len(lengths)} examples cannot fill a batch of {batch_size}")
    order = torch.randperm(len(lengths), generator=gen).tolist()
    batches = []
    for s in range(0, len(order), batch_size * bucket):
        group = sorted(order[s:s + batch_size * bucket], key=lambda i: lengths[i])
        batches += [group[i:i + batch_size] for i in range(0, len(group), batch_size)
                    if len(group) - i >= batch_size]
    return [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]


def train(model, tokenizer, examples: Sequence[Tuple[Messages, str]], steps: int = 1200,
          batch_size: int = 16, lr: float = 2e-3, warmup_steps: int = 40,
          weight_decay: float = 0.0, max_grad_norm: float = 1.0, seed: int = 0,
          log_every: int = 0, log: Callable[[str], None] = print) -> List[float]:
    """Trains `model` in place on (prompt, response) pairs; returns the loss of every step.
    The defaults are the gsm_tiny warm-start recipe (1200 steps of 16 demonstrations)."""
    encoded = [encode_example(tokenizer, p, r) for p, r in examples]
    pad_id = stop_ids(tokenizer)[1]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95),
                            weight_decay=weight_decay)
    lengths = [len(ids) for ids, _ in encoded]
    model.train()
    batches, losses, start = [], [], time.time()
    for step in range(steps):
        if not batches:
            batches = epoch_batches(lengths, batch_size, gen)
        batch = [encoded[i] for i in batches.pop()]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup_steps)
        loss = response_loss(model, *collate(batch, pad_id))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            log(f"step {step + 1}/{steps} loss {losses[-1]:.4f} "
                f"({time.time() - start:.0f} s)")
    model.eval()
    return losses


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[List[int]], max_new_tokens: int = 128,
             temperature: float = 0.0, seed: int = 0, batch_size: int = 128
             ) -> List[List[int]]:
    """Completion token ids for each prompt (ending in the stop token when one was produced);
    temperature 0 is greedy. Batches of left-padded prompts share a KV cache."""
    from transformers import DynamicCache
    stops = torch.tensor(stop_ids(tokenizer))
    pad_id = int(stops[1])
    gen = torch.Generator().manual_seed(seed)
    # transformers 5 renames forward's past_key_values to cache.
    cache_kwarg = ("cache" if "cache" in inspect.signature(model.forward).parameters
                   else "past_key_values")
    model.eval()
    out: List[List[int]] = []
    for b in range(0, len(prompts), batch_size):
        chunk = prompts[b:b + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        done = torch.zeros(len(chunk), dtype=torch.bool)
        new = []
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, attention_mask=attn, position_ids=positions,
                           use_cache=True, **{cache_kwarg: cache}).logits[:, -1].float()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = torch.multinomial(probs, 1, generator=gen)[:, 0]
            else:
                token = logits.argmax(-1)
            token = torch.where(done, torch.full_like(token, pad_id), token)
            new.append(token)
            done |= torch.isin(token, stops)
            if done.all():
                break
            ids = token[:, None]
            attn = torch.cat([attn, torch.ones_like(ids)], dim=1)
            positions = positions[:, -1:] + 1
        tokens = torch.stack(new, dim=1).tolist()
        for row in tokens:
            end = next((j + 1 for j, t in enumerate(row) if t in stops.tolist()), len(row))
            out.append(row[:end])
    return out


def evaluate(model, tokenizer, problems: Sequence[Tuple[Messages, str]], num_samples: int = 8,
             max_new_tokens: int = 128, batch_size: int = 128, seed: int = 0,
             return_responses: bool = False) -> Dict:
    """Held-out accuracies and lengths (see the module docstring)."""
    ids = [prompt_ids(tokenizer, p) for p, _ in problems]
    truth = [str(t) for _, t in problems]

    def correct(completion, i):
        text = tokenizer.decode(completion, skip_special_tokens=True)
        return extract_answer(text) == truth[i]

    start = time.time()
    greedy = generate(model, tokenizer, ids, max_new_tokens, 0.0, seed, batch_size)
    greedy_s = time.time() - start
    greedy_ok = [correct(c, i) for i, c in enumerate(greedy)]
    sampled = generate(model, tokenizer, ids, max_new_tokens, 1.0, seed, batch_size)
    sampled_ok = [correct(c, i) for i, c in enumerate(sampled)]
    wrong = [i for i, ok in enumerate(greedy_ok) if not ok]
    extra = generate(model, tokenizer, [ids[i] for i in wrong for _ in range(num_samples)],
                     max_new_tokens, 1.0, seed + 1, batch_size)
    extra_ok = [correct(c, wrong[j // num_samples]) for j, c in enumerate(extra)]
    per_wrong = [extra_ok[k * num_samples:(k + 1) * num_samples] for k in range(len(wrong))]
    lengths = sorted(len(c) for c in greedy)
    n = len(problems)

    def mean(xs):
        return sum(xs) / len(xs) if len(xs) else float("nan")

    result = {
        "greedy_accuracy": mean(greedy_ok),
        "sampled_accuracy": mean(sampled_ok),
        "sampled_accuracy_on_greedy_wrong": mean(extra_ok),
        f"pass_at_{num_samples}_on_greedy_wrong": mean([any(x) for x in per_wrong]),
        "greedy_wrong_count": len(wrong),
        "num_problems": n,
        "length_mean": mean(lengths), "length_min": lengths[0], "length_max": lengths[-1],
        "length_median": lengths[n // 2],
        "truncated_fraction": mean([len(c) >= max_new_tokens and c[-1] not in stop_ids(
            tokenizer) for c in greedy]),
        "greedy_seconds": greedy_s,
        "greedy_tokens_per_second": sum(lengths) / greedy_s,
        "eval_seconds": time.time() - start,
    }
    if return_responses:
        result["greedy_responses"] = [tokenizer.decode(c, skip_special_tokens=True)
                                      for c in greedy]
        result["greedy_correct"] = greedy_ok
    return result
