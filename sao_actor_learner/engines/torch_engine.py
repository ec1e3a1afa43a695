"""The built-in Engine: batched sampling from a Hugging Face causal LM with a KV cache.

Prompts of different lengths are left-padded into one batch with an attention mask and position
ids counted from each prompt's first real token, so a padded prompt sees exactly what it would
see alone. One prefill forward fills the cache (HF `DynamicCache`); every further token costs one
forward of length 1. Rows that hit a stop token leave the batch (their cache rows are dropped).

Log-probs (what `Generation.logprobs` holds, the behaviour policy):
  temperature > 0, top_p = 1:  log_softmax(logits / temperature)[token]  (T=1: the raw model)
  temperature > 0, top_p < 1:  the same, renormalised over the nucleus the token was drawn from
  temperature = 0 (greedy):    log_softmax(logits)[argmax]  (the raw model distribution)
They are computed in float32 whatever the model dtype. With `token_limit` (a vocabulary padded
past the tokenizer, as real Qwen checkpoints have) the logits of ids >= token_limit are -inf
before anything else, so those ids are never sampled and the log-probs are over real tokens.

Sampling is deterministic given `SamplingParams.seed`, the prompts, `max_batch_size` and where
weights change (one torch.Generator drives every draw of a `generate` call; seed=None draws a
fresh random seed).

Precision: an engine loaded in another dtype than the published weights' (`from_checkpoint`'s
`dtype`, the config's --actor_dtype: a drift experiment) casts each loaded or offered tensor to
its model's dtype first, so it samples from a bfloat16 or float16 copy of the policy and its
log-probs are that copy's.

Weights (core.Engine; docs/DESIGN.md "Weight sync modes"). `generate` and `load_weights` hold
one lock, so `load_weights` waits for a call in flight. `offer_weights` only puts the newest
offered (version, state dict) into a one-slot mailbox and returns; the generating thread takes
it between decode steps, copies it into the model in place (no new tensors), and from then on
stamps tokens with the new version. What happens to the rows in flight (weight_sync_mode):
  off    the slot is taken only between calls (at the next call's start, or at once when no
         call is in flight): a call's tokens share one version.
  keep   the active rows' KV cache is rebuilt with one prefill of prompt + tokens so far under
         the new weights, then decoding continues: each token's log-prob is that of the
         weights that sampled it given the whole prefix (teacher forcing with those weights).
  abort  the active rows' tokens are discarded and the rows restart from their prompts (with a
         fresh max_new_tokens budget); rows that already finished keep their tokens.
An offer made while no call is in flight is applied at once by the offering thread (under the
lock). `decode_step_hook(n)`, when set, is called in the generating thread after the n-th token
of the rows in flight, before the mailbox is looked at (tests offer weights there, at a known
step). `weight_sync_counters()` counts tokens, switched rows, discarded and recomputed tokens.
"""
from __future__ import annotations

import inspect
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from absl import logging

from sao_actor_learner import core
from sao_actor_learner.distributions import nucleus_logprobs, sampling_logprobs
from sao_actor_learner.models.checkpoint import (check_compatible, load_policy,
                                                 load_sync_state_dict, sync_state_dict,
                                                 token_limit)


class TorchEngine(core.Engine):
    """`core.Engine` over an in-process Hugging Face causal LM (Llama, Qwen2/3, Qwen3-MoE, ...).

    Args:
      model: the causal LM (eval mode is set).
      eos_token_id, pad_token_id: always a stop id; the id that pads prompt batches.
      version: the policy version of the model's weights.
      max_batch_size: prompts per forward batch.
      token_limit: only ids < token_limit are sampled (None: every row of the LM head).
      weight_sync_mode: "off", "keep" or "abort": what offered weights do to rows in flight
        (module docstring).
      tokenizer: the model's tokenizer, kept as `.tokenizer` (tasks encode prompts with it).
      cast_weights: loaded and offered floating tensors are cast to the model's dtype of that
        name (a lower-precision copy of the policy); False: they must match it.
    """

    def __init__(self, model: torch.nn.Module, eos_token_id: int, pad_token_id: int,
                 version: int = 0, max_batch_size: int = 64, token_limit: Optional[int] = None,
                 weight_sync_mode: str = "off", tokenizer: Optional[core.Tokenizer] = None,
                 cast_weights: bool = False):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: must be >= 1")
        if weight_sync_mode not in core.WEIGHT_SYNC_MODES:
            raise ValueError(f"weight_sync_mode={weight_sync_mode!r}: must be one of "
                             f"{', '.join(core.WEIGHT_SYNC_MODES)}")
        vocab = model.get_output_embeddings().weight.shape[0]
        if token_limit is not None and not 0 < token_limit <= vocab:
            raise ValueError(f"token_limit={token_limit}: must be in [1, {vocab}]")
        if token_limit is not None:
            vocab = int(token_limit)
        for name, tid in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
            if not 0 <= int(tid) < vocab:
                raise ValueError(f"{name}={tid} is outside the model's vocabulary [0, {vocab})")
        self._model = model.eval()
        self._eos = int(eos_token_id)
        self._pad = int(pad_token_id)
        self._version = int(version)
        self._max_batch_size = int(max_batch_size)
        self._vocab = vocab
        rows = model.get_output_embeddings().weight.shape[0]
        self._token_limit = vocab if vocab < rows else None
        self._lock = threading.Lock()          # generate, load_weights, applying an offer
        self.weight_sync_mode = weight_sync_mode
        self._offer_lock = threading.Lock()    # the mailbox
        self._offer: Optional[Tuple[int, dict]] = None
        self.decode_step_hook: Optional[Callable[[int], None]] = None
        self._counters: Dict[str, float] = {"tokens": 0, "sequences_switched": 0,
                                            "tokens_discarded": 0, "tokens_recomputed": 0}
        forward_args = inspect.signature(model.forward).parameters
        # transformers >= 5.2x calls the KV cache `cache`; older releases `past_key_values`.
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in forward_args
        self.tokenizer = tokenizer   # the model's (None: a bare model without one)
        self._dtypes = {k: v.dtype for k, v in sync_state_dict(model).items()} \
            if cast_weights else None

    @classmethod
    def from_checkpoint(cls, path: str, version: int = 0, max_batch_size: int = 64,
                        dtype: torch.dtype = torch.float32,
                        weight_sync_mode: str = "off") -> "TorchEngine":
        """An engine on the checkpoint folder `path` (see models.checkpoint); `.tokenizer` is set."""
        model, tokenizer = load_policy(path, dtype=dtype)
        engine = cls(model, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                     version=version, max_batch_size=max_batch_size,
                     token_limit=token_limit(model, tokenizer),
                     weight_sync_mode=weight_sync_mode, tokenizer=tokenizer,
                     cast_weights=dtype != torch.float32)
        return engine

    # core.Engine ------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Validates `state_dict` against the model's sync state dict (names, shapes, dtypes;
        models.checkpoint.sync_state_dict) and loads it; nothing is loaded when it differs."""
        state_dict = self._cast(state_dict)
        with self._lock, torch.no_grad():
            load_sync_state_dict(self._model, state_dict)
            self._version = int(version)
            with self._offer_lock:   # an offer this load supersedes is dropped
                if self._offer is not None and self._offer[0] <= self._version:
                    self._offer = None
        logging.log_every_n_seconds(logging.INFO, "TorchEngine: now on policy version %d", 30,
                                    self._version)

    def offer_weights(self, state_dict: dict, version: int) -> None:
        """Puts (version, state_dict) into the mailbox (module docstring) after checking names,
        shapes and dtypes (ValueError, nothing offered); applies it at once when no generate
        call is in flight. Returns without waiting for one."""
        version = int(version)
        state_dict = self._cast(state_dict)
        check_compatible(sync_state_dict(self._model), state_dict)
        with self._offer_lock:
            newest = max(self._version, self._offer[0] if self._offer is not None else -1)
            if version <= newest:
                return
            self._offer = (version, state_dict)
        if self._lock.acquire(blocking=False):   # idle (also: not this thread's own call)
            try:
                self._take_offer()
            finally:
                self._lock.release()

    @property
    def pending_version(self) -> Optional[int]:
        """The version waiting in the mailbox; None when it is empty."""
        with self._offer_lock:
            return None if self._offer is None else self._offer[0]

    def weight_sync_counters(self) -> Dict[str, float]:
        return dict(self._counters)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: core.SamplingParams) -> List[core.Generation]:
        prompts = [self._check_prompt(i, p) for i, p in enumerate(prompts)]
        for t in params.stop_token_ids:
            if not 0 <= int(t) < self._vocab:
                raise ValueError(f"stop_token_ids contains {t}, outside the vocabulary "
                                 f"[0, {self._vocab})")
        stop_ids = torch.tensor(sorted({self._eos, *map(int, params.stop_token_ids)}))
        generator = torch.Generator(device=self._device())
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(int(params.seed))
        results: List[core.Generation] = []
        with self._lock:
            self._take_offer()   # offered between calls (every mode)
            for start in range(0, len(prompts), self._max_batch_size):
                chunk = prompts[start:start + self._max_batch_size]
                results.extend(self._generate_batch(chunk, params, stop_ids, generator))
            self._counters["tokens"] += sum(len(g.tokens) for g in results)
        return results

    # Internals --------------------------------------------------------------------------------
    def _cast(self, state_dict: dict) -> dict:
        """`state_dict` with floating tensors in the model's dtype of their name (cast_weights);
        as it is otherwise (load_sync_state_dict then checks it)."""
        if self._dtypes is None:
            return state_dict
        dtypes = self._dtypes
        return {k: v.to(dtypes[k]) if k in dtypes and v.is_floating_point() and
                dtypes[k].is_floating_point and v.dtype != dtypes[k] else v
                for k, v in state_dict.items()}

    def _device(self) -> torch.device:
        return self._model.get_input_embeddings().weight.device

    def _check_prompt(self, index: int, prompt: Sequence[int]) -> List[int]:
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {index} is empty: every prompt needs at least one token "
                             "(start it with <bos>)")
        bad = [t for t in ids if not 0 <= t < self._vocab]
        if bad:
            raise ValueError(f"prompt {index} has token ids {bad[:5]} outside the vocabulary "
                             f"[0, {self._vocab})")
        return ids

    def _forward(self, input_ids, attention_mask, position_ids, cache, last_only: bool):
        kwargs = {self._cache_arg: cache}
        if last_only and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self._model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=True, **kwargs)
        logits = out.logits[:, -1, :].float()  # [B, V]
        if self._token_limit is not None:
            logits = logits[:, :self._token_limit]   # ids past the tokenizer: never sampled
        if not torch.isfinite(logits).all():
            raise FloatingPointError(
                f"TorchEngine (policy version {self._version}): the model produced non-finite "
                "logits; the loaded weights are probably diverged (check the learner's loss)")
        return logits

    def _new_cache(self):
        from transformers import DynamicCache
        try:
            return DynamicCache(config=self._model.config)
        except TypeError:  # older transformers
            return DynamicCache()

    def _take_offer(self) -> bool:
        """Copies the mailbox's weights into the model (in place) and takes their version; True
        if it held a newer version. Only with self._lock held: between decode steps in the
        generating thread, or while no call is in flight."""
        with self._offer_lock:
            offer, self._offer = self._offer, None
        if offer is None or offer[0] <= self._version:
            return False
        with torch.no_grad():
            load_sync_state_dict(self._model, offer[1])
        self._version = offer[0]
        logging.log_every_n_seconds(logging.INFO, "TorchEngine: now on policy version %d "
                                    "(offered)", 30, self._version)
        return True

    def _prefill(self, seqs: List[List[int]], device: torch.device):
        """One forward over left-padded `seqs` into a new cache: (cache, logits of each row's
        next token [B, V], attention mask [B, W], position of each row's next token [B])."""
        batch, width = len(seqs), max(len(p) for p in seqs)
        input_ids = torch.full((batch, width), self._pad, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for row, p in enumerate(seqs):  # left padding
            input_ids[row, width - len(p):] = torch.tensor(p)
            attention_mask[row, width - len(p):] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        # Positions count real tokens only, so a padded prompt gets the positions it has alone.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache()
        logits = self._forward(input_ids, attention_mask, position_ids, cache, last_only=True)
        return cache, logits, attention_mask, position_ids[:, -1] + 1

    def _generate_batch(self, prompts: List[List[int]], params: core.SamplingParams,
                        stop_ids: torch.Tensor, generator: torch.Generator
                        ) -> List[core.Generation]:
        device = self._device()
        batch = len(prompts)
        stop_ids = stop_ids.to(device)
        interruptible = self.weight_sync_mode != "off"
        if interruptible:
            self._take_offer()   # offered while an earlier chunk of this call ran
        cache, logits, attention_mask, next_pos = self._prefill(prompts, device)
        active = torch.arange(batch, device=device)         # original row of each active row
        tokens: List[List[int]] = [[] for _ in range(batch)]
        logprobs: List[List[float]] = [[] for _ in range(batch)]
        versions: List[List[int]] = [[] for _ in range(batch)]
        stopped = [False] * batch
        n = 0   # tokens each active row holds (rows in flight advance together)

        while True:
            token, logp = _sample(logits, params, generator)    # [B_active], [B_active]
            for row, t, lp in zip(active.tolist(), token.tolist(), logp.tolist()):
                tokens[row].append(t)
                logprobs[row].append(lp)
                versions[row].append(self._version)
            n += 1
            done = torch.isin(token, stop_ids)
            for row in active[done].tolist():
                stopped[row] = True
            if n >= params.max_new_tokens or bool(done.all()):
                break
            if bool(done.any()):  # drop finished rows from the batch and its cache
                keep = (~done).nonzero(as_tuple=True)[0]
                cache.batch_select_indices(keep)
                active, token, next_pos = active[keep], token[keep], next_pos[keep]
                attention_mask = attention_mask[keep]
            if self.decode_step_hook is not None:
                self.decode_step_hook(n)
            if interruptible and self._take_offer():
                rows = active.tolist()
                self._counters["sequences_switched"] += len(rows)
                if self.weight_sync_mode == "abort":   # restart from the prompts
                    self._counters["tokens_discarded"] += n * len(rows)
                    for row in rows:
                        tokens[row], logprobs[row], versions[row] = [], [], []
                    n = 0
                    seqs = [prompts[row] for row in rows]
                else:                                  # keep: the prefix's KV, recomputed
                    seqs = [prompts[row] + tokens[row] for row in rows]
                    self._counters["tokens_recomputed"] += sum(len(q) for q in seqs)
                cache, logits, attention_mask, next_pos = self._prefill(seqs, device)
                continue
            attention_mask = torch.cat(
                [attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=1)
            logits = self._forward(token[:, None], attention_mask, next_pos[:, None], cache,
                                   last_only=False)
            next_pos = next_pos + 1

        return [core.Generation(tokens=tokens[r], logprobs=logprobs[r], versions=versions[r],
                                finish_reason="stop" if stopped[r] else "length")
                for r in range(batch)]


def _sample(logits: torch.Tensor, params: core.SamplingParams,
            generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """(token [B], log-prob of that token under the sampling distribution [B]) from logits [B, V]."""
    if params.temperature == 0.0:
        logp = torch.log_softmax(logits, dim=-1)
        token = logits.argmax(dim=-1)
        return token, logp.gather(-1, token[:, None])[:, 0]
    logp = sampling_logprobs(logits, params.temperature, params.top_p)
    token = torch.multinomial(logp.exp(), num_samples=1, generator=generator)[:, 0]
    return token, logp.gather(-1, token[:, None])[:, 0]


def _top_p_logprobs(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Log-probs renormalised over the smallest set of top tokens whose mass reaches `top_p`."""
    return nucleus_logprobs(logp, top_p)
