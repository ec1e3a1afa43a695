"""The critic: the policy's architecture with a scalar head, trained with attention frozen.

docs/METHOD.md section 6: a separate network, initialised from the policy (or a value-pretraining)
checkpoint; during RL only the MLP / MoE expert projections and the value head are trained.
Which parameters stay frozen is a list of name patterns (config `critic_frozen_patterns`,
regexes searched in the body's parameter names). The default patterns (`self_attn`,
`embed_tokens`, `norm`) mean the same thing in Llama, Qwen2, Qwen3 and Qwen3-MoE, whose bodies
name attention `layers.N.self_attn.{q,k,v,o}_proj` (Qwen3 adds `self_attn.{q,k}_norm`), norms
`*_layernorm` and `norm`, and the MLP `mlp.*` (`mlp.experts.*` / `mlp.gate` in MoE layers).

`ValueModel.sharing_trunk(policy)` is the other option (config `critic=shared_trunk`, not SAO):
the value head on the policy's own body, the same module object, so one forward of the trunk
gives the LM head's logits and the values (docs/METHOD.md section 6, the shared-trunk option).

A critic directory (`ValueModel.save`) holds the body as a Hugging Face model (config.json +
safetensors, loadable with AutoModel) and `value_head.safetensors`; `ValueModel.load` reads one,
or builds a fresh critic (zero head) from a causal-LM directory.
No reverb, tensorflow or grpc here.
"""
from __future__ import annotations

import copy
import json
import os
import re
import struct
from typing import Iterable, List, Sequence, Tuple

VALUE_HEAD_FILE = "value_head.safetensors"

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

    shares_trunk = False   # True: `body` is the policy's own body (sharing_trunk)

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

    @classmethod
    def sharing_trunk(cls, policy: nn.Module) -> "ValueModel":
        """A zero value head on `policy`'s own body (not a copy): the body's parameters are the
        policy's, trained by the policy's optimizer; only `head` belongs to the critic. The
        head is on the device and in the dtype of the policy's LM head."""
        critic = cls(base_model_of(policy), policy.config.hidden_size)
        critic.shares_trunk = True
        lm_head = policy.get_output_embeddings().weight
        critic.head.to(device=lm_head.device, dtype=lm_head.dtype)
        return critic

    @classmethod
    def load(cls, path: str, dtype: torch.dtype = torch.float32) -> "ValueModel":
        """The critic in `path`: a critic directory (body + value head, `save`), or a causal-LM
        directory whose body starts a fresh critic with a zero head."""
        from safetensors.torch import load_file
        from transformers import AutoModel, AutoModelForCausalLM

        if os.path.exists(os.path.join(path, VALUE_HEAD_FILE)):
            body = AutoModel.from_pretrained(path, dtype=dtype, local_files_only=True)
            critic = cls(body, body.config.hidden_size)
            critic.head.load_state_dict(load_file(os.path.join(path, VALUE_HEAD_FILE)))
            return critic
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        return cls(base_model_of(policy), policy.config.hidden_size)

    def save(self, path: str) -> str:
        """Writes a critic directory `ValueModel.load` reads back."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        self.body.save_pretrained(path, safe_serialization=True)
        save_file({k: v.detach().contiguous() for k, v in self.head.state_dict().items()},
                  os.path.join(path, VALUE_HEAD_FILE))
        return path

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
        params = dict(self.body.named_parameters())
        frozen = match_frozen_patterns(patterns, list(params))
        for name in frozen:
            params[name].requires_grad_(False)
        return frozen

    def trainable_parameters(self) -> Iterable[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def match_name_patterns(patterns: Sequence[str], names: Sequence[str],
                        flag: str) -> Tuple[List[str], List[str]]:
    """(the `names` any regex of `patterns` matches (re.search), in their order; the patterns
    that match none). Raises ValueError naming `flag` for a pattern that is not a regex."""
    for pat in patterns:
        try:
            re.compile(pat)
        except re.error as e:
            raise ValueError(f"{flag} entry {pat!r} is not a regex: {e}") from None
    matched, used = [], set()
    for name in names:
        hits = [pat for pat in patterns if re.search(pat, name)]
        if hits:
            matched.append(name)
            used.update(hits)
    return matched, [p for p in patterns if p not in used]


def match_frozen_patterns(patterns: Sequence[str], names: Sequence[str]) -> List[str]:
    """The names any regex of `patterns` matches (re.search). Raises ValueError naming every
    pattern that matches nothing (a typo would otherwise silently train attention) or is not a
    valid regex."""
    matched, unused = match_name_patterns(patterns, names, "critic_frozen_patterns")
    if unused:
        raise ValueError(f"critic_frozen_patterns {unused} match no critic parameter; the "
                         f"critic's parameters are named like {list(names)[:6]}: fix or drop "
                         "those patterns")
    return matched


def critic_parameter_names(path: str) -> List[str]:
    """The critic body's parameter names (sorted) for the model (or critic) directory `path`.
    A critic directory's body file names them in its safetensors header (read without
    importing the model's code: the pre-launch check's -2.5 s, docs/DESIGN.md); a causal-LM
    directory's critic is built from its config on the meta device (no weights are read)."""
    if os.path.exists(os.path.join(path, VALUE_HEAD_FILE)):
        names = safetensors_tensor_names(path)
        if names is not None:
            return sorted(names)
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        if os.path.exists(os.path.join(path, VALUE_HEAD_FILE)):
            body = AutoModel.from_config(config)
        else:
            body = base_model_of(AutoModelForCausalLM.from_config(config))
    return sorted(n for n, _ in body.named_parameters())


def safetensors_tensor_names(path: str):
    """The tensor names of the model directory `path`'s weights (model.safetensors, or the
    shards its index names), from the headers alone; None when it has neither."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return list(json.load(f)["weight_map"])
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        return None
    with open(single, "rb") as f:   # the format: u64 little-endian header size, JSON header
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return [k for k in header if k != "__metadata__"]
