"""The critic: the policy's architecture with a scalar head, trained with attention frozen.

SAO.md section 4: a separate network, initialised from the policy (or a value-pretraining)
checkpoint; during RL only the MLP / MoE expert projections and the value head are trained.
Which parameters stay frozen is a list of name patterns (config `critic_frozen_patterns`).
No reverb, tensorflow or grpc here.
"""
from __future__ import annotations

import copy
import re
from typing import Iterable, List, Sequence

import torch
from torch import nn


def base_model_of(causal_lm: nn.Module) -> nn.Module:
    """The transformer body of a Hugging Face causal LM (e.g. `LlamaForCausalLM.model`)."""
    prefix = getattr(causal_lm, "base_model_prefix", "model")
    body = getattr(causal_lm, prefix, None)
    if body is None:
        raise ValueError(f"{type(causal_lm).__name__} has no base model at .{prefix}; "
                         "the critic needs a Hugging Face causal LM")
    return body


class ValueModel(nn.Module):
    """V(s) at every position: a causal LM body plus a linear head on its last hidden state.

    forward(input_ids [B,T], attention_mask [B,T]) -> [B,T] float32 values, where out[:, t] is the
    value of the state after reading x_0..x_t (i.e. before x_{t+1} is emitted). Use
    `values_for_tokens` to align them to token positions as the advantage functions expect.
    """

    def __init__(self, body: nn.Module, hidden_size: int):
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy: nn.Module) -> "ValueModel":
        body = copy.deepcopy(base_model_of(policy))
        return cls(body, policy.config.hidden_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden).squeeze(-1).float()

    def values_for_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B,T] values aligned to token positions: out[:, t] = V(state before x_t); out[:, 0] = 0."""
        v = self.forward(input_ids, attention_mask)
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)

    def freeze(self, patterns: Sequence[str]) -> List[str]:
        """Freezes the body's parameters whose name matches any regex in `patterns`.

        The head is never frozen. Returns the frozen names. Raises if a pattern matches nothing
        (a typo would otherwise silently train attention).
        """
        frozen, used = [], set()
        for name, p in self.body.named_parameters():
            hits = [pat for pat in patterns if re.search(pat, name)]
            if hits:
                p.requires_grad_(False)
                frozen.append(name)
                used.update(hits)
        unused = [p for p in patterns if p not in used]
        if unused:
            raise ValueError(f"critic_frozen_patterns {unused} match no critic parameter; "
                             f"names look like {[n for n, _ in self.body.named_parameters()][:4]}")
        return frozen

    def trainable_parameters(self) -> Iterable[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]
