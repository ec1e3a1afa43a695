"""LoRA for the policy (low-rank adapters, PEFT): the learner trains adapters only; whatever
leaves the learner is merged.

With `lora_rank` r > 0 the learner's policy gets, in each target linear layer with weight W
[out, in], two trainable matrices A [r, in] and B [out, r] (PEFT's `inject_adapter_in_model`,
in place: the model stays a Hugging Face causal LM, so the policy step, the fused log-probs,
gradient checkpointing and a shared-trunk value head work unchanged). Every other parameter is
frozen. The layer computes x W^T + (alpha / r) x A^T B^T; A starts random (PEFT's Kaiming
init, seeded by the run's seed), B at zero, so version 0 is the base model exactly.

What leaves the learner is merged, under the base model's parameter names
(`merged_state_dict`: W' = W + (alpha / r) B A, per target layer; adapter tensors left out):
the published weights (`checkpoint.sync_state_dict` merges), hence every engine (torch,
vLLM) loads them through the normal weight sync without knowing about adapters, and the
in-learner evaluation; and the checkpoint's model directory (`distributed.full_state_dict`
merges), so the exported final policy is a plain merged Hugging Face directory. A checkpoint
also holds the adapters in PEFT's format (`adapter/adapter_config.json` and
`adapter/adapter_model.safetensors`, loadable with `peft.PeftModel.from_pretrained(base,
<checkpoint>/adapter)`); a resumed learner rebuilds base + adapters from `--model` and that
folder (`prepare_learner_policy`) and checks that they give the checkpoint's merged weights.

Target modules: `--lora_target_modules` regexes searched (re.search) in the full module names
of the policy's linear layers (nn.Linear and GPT-2's Conv1D, the LM head left out); empty: the
architecture's default (`DEFAULT_TARGETS`). A pattern that matches no linear layer is an error
(`match_target_modules`), checked before launch (preflight) on the model's architecture alone.

No reverb, tensorflow or grpc here; peft is imported only where adapters are made or read.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

ADAPTER_DIR = "adapter"                       # the adapters' folder inside a checkpoint
ADAPTER_WEIGHTS = "adapter_model.safetensors"   # PEFT's file names
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_NAME = "default"                      # PEFT's adapter name; the only one made here
# PEFT's PeftModel.save_pretrained prefixes every adapter tensor name with this.
PEFT_PREFIX = "base_model.model."

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
# model_type -> the default target patterns: attention and MLP projections of dense decoders;
# attention only for MoE models (their experts are fused parameters, not linear layers).
DEFAULT_TARGETS: Dict[str, Tuple[str, ...]] = {
    **{t: _ATTENTION + _MLP for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2",
                                      "olmo", "olmo2", "smollm3", "granite")},
    **{t: _ATTENTION for t in ("qwen3_moe", "qwen2_moe", "mixtral")},
    "gpt2": ("c_attn", "c_proj", "c_fc"),
}


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The adapters of a run: rank r, alpha (the update is scaled by alpha / r), the target
    patterns (empty: the architecture's default) and the seed of A's initialisation."""
    rank: int
    alpha: float
    target_patterns: Tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self):
        if self.rank <= 0:
            raise ValueError(f"lora_rank={self.rank}: a LoRA rank must be > 0 (typical: 8-64)")
        if not self.alpha > 0:
            raise ValueError(f"lora_alpha={self.alpha}: must be > 0 (the update is scaled by "
                             "lora_alpha / lora_rank; typical: 16 or 2 x rank)")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, config) -> Optional["LoraSpec"]:
        """The spec of a run config (lora_rank, lora_alpha, lora_target_modules, seed); None
        when lora_rank is 0 (full fine-tuning)."""
        if not config.lora_rank:
            return None
        return cls(config.lora_rank, float(config.lora_alpha),
                   tuple(config.lora_target_modules), config.seed)


# --- target modules ---------------------------------------------------------------------------
def default_target_patterns(model_type: str) -> Tuple[str, ...]:
    """The default target patterns of `model_type`; ValueError naming the flag when there is
    none."""
    if model_type not in DEFAULT_TARGETS:
        raise ValueError(f"no default LoRA target modules for model_type={model_type!r} (known: "
                         f"{', '.join(sorted(DEFAULT_TARGETS))}); give --lora_target_modules, "
                         "regexes of its linear layers' names such as q_proj,v_proj")
    return DEFAULT_TARGETS[model_type]


def adaptable_modules(model: torch.nn.Module) -> List[str]:
    """Names of the modules LoRA can adapt here: nn.Linear and transformers' Conv1D layers,
    the output embedding (the LM head, often tied to the input embedding) left out."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    return [name for name, m in model.named_modules()
            if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head]


def match_target_modules(patterns: Sequence[str], names: Sequence[str]) -> List[str]:
    """The `names` any regex of `patterns` matches (re.search), in their order. Raises
    ValueError naming every pattern that is not a regex or matches no name (a typo would
    otherwise silently train fewer layers), and when `patterns` is empty."""
    if not patterns:
        raise ValueError("lora_target_modules is empty: give at least one pattern")
    from sao_actor_learner.models.value import match_name_patterns
    matched, unused = match_name_patterns(patterns, names, "lora_target_modules")
    if unused:
        raise ValueError(f"lora_target_modules {unused} match no linear layer of the policy "
                         "(the LM head and embeddings cannot be adapted); its linear layers "
                         f"are named like {list(names)[:8]}: fix or drop those patterns")
    return matched


def resolve_targets(model: torch.nn.Module, patterns: Sequence[str] = ()) -> List[str]:
    """The full names of the modules `patterns` (empty: the architecture's default) target."""
    patterns = tuple(patterns) or default_target_patterns(model.config.model_type)
    return match_target_modules(patterns, adaptable_modules(model))


def check_target_patterns(model_dir: str, patterns: Sequence[str] = ()) -> List[str]:
    """`resolve_targets` for the model directory `model_dir` from its config alone (built on
    the meta device: no weights are read); the checks before launch (preflight)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return resolve_targets(model, patterns)


# --- adapters on a model ----------------------------------------------------------------------
def adapted_layers(model: torch.nn.Module) -> Dict[str, torch.nn.Module]:
    """name -> PEFT LoRA layer of every adapted module of `model` ({} for a plain model)."""
    peft_lora = sys.modules.get("peft.tuners.lora")
    if peft_lora is None:       # no LoRA layer can exist before peft is imported
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, peft_lora.LoraLayer)}


def add_adapters(model: torch.nn.Module, spec: LoraSpec,
                 base_model_name_or_path: str = "") -> List[str]:
    """Adds LoRA adapters to `model` in place (every other parameter frozen); returns the
    adapted module names. A's initialisation is seeded by spec.seed (the caller's RNG streams
    are left as they were), so every rank and every restart from the initial weights gets the
    same adapters."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ImportError("LoRA (--lora_rank > 0) needs the peft package: pip install -e "
                          "'.[lora]'") from None
    if adapted_layers(model):
        raise ValueError("the model already has LoRA adapters")
    targets = resolve_targets(model, spec.target_patterns)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=targets,
                        lora_dropout=0.0, bias="none",
                        base_model_name_or_path=base_model_name_or_path or None)
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(spec.seed)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    for name, p in model.named_parameters():   # inject_adapter_in_model froze the rest
        if p.requires_grad != (".lora_" in name):
            raise RuntimeError(f"after adding adapters {name} has requires_grad="
                               f"{p.requires_grad}")
    return targets


def lora_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
               fan_in_fan_out: bool = False) -> torch.Tensor:
    """scaling * B @ A ([out, in]; transposed for a Conv1D weight stored [in, out]), in the
    weights' dtype, computed in float32."""
    delta = (lora_b.float() @ lora_a.float()) * scaling
    return (delta.T if fan_in_fan_out else delta).to(lora_b.dtype)


def merged_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """`model.state_dict()` with every LoRA layer merged: its base weight becomes W + delta
    (lora_delta of each active adapter) under the base model's name (`...q_proj.weight`, not
    `...q_proj.base_layer.weight`), its other base tensors (bias) keep their base names, and the
    adapter tensors are left out. Key order is the state dict's. For a model without adapters,
    its state dict as it is. Merged tensors are new (detached); the rest are the state dict's."""
    layers = adapted_layers(model)
    state = model.state_dict()
    if not layers:
        return state
    out: Dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in state.items():
            owner = _owning_layer(key, layers)
            if owner is None:
                out[key] = value
                continue
            rest = key[len(owner) + 1:]
            if not rest.startswith("base_layer."):
                continue                                   # an adapter tensor
            name = f"{owner}.{rest[len('base_layer.'):]}"
            if rest == "base_layer.weight":
                value = value + _layer_delta(owner, layers[owner], value)
            out[name] = value
    return out


def _owning_layer(key: str, layers: Mapping[str, torch.nn.Module]) -> Optional[str]:
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in layers:
            return prefix
    return None


def _layer_delta(name: str, layer: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    if getattr(layer, "merged", False):
        raise ValueError(f"LoRA layer {name} has its adapter merged into the base weight "
                         "already (merge_adapter): it would be added twice")
    delta = torch.zeros_like(weight)
    for adapter in layer.active_adapters:
        delta += lora_delta(layer.lora_A[adapter].weight.detach(),
                            layer.lora_B[adapter].weight.detach(), layer.scaling[adapter],
                            layer.fan_in_fan_out).to(weight.device)
    return delta


def adapter_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The adapters' tensors under PEFT's saved names (`base_model.model.<layer>.lora_A.weight`),
    on CPU."""
    out = {}
    for name, layer in adapted_layers(model).items():
        for kind in ("lora_A", "lora_B"):
            weight = getattr(layer, kind)[ADAPTER_NAME].weight
            out[f"{PEFT_PREFIX}{name}.{kind}.weight"] = weight.detach().to("cpu").contiguous()
    return out


def save_adapter(model: torch.nn.Module, directory: str) -> Optional[str]:
    """Writes the adapters in PEFT's format into `directory`/adapter/ (config and safetensors);
    returns that folder, or None (writing nothing) for a model without adapters."""
    layers = adapted_layers(model)
    if not layers:
        return None
    from safetensors.torch import save_file

    path = os.path.join(directory, ADAPTER_DIR)
    os.makedirs(path, exist_ok=True)
    model.peft_config[ADAPTER_NAME].save_pretrained(path)
    save_file(adapter_state_dict(model), os.path.join(path, ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    return path


def load_adapter(model: torch.nn.Module, directory: str) -> None:
    """Copies the adapters saved by `save_adapter` into `directory` into `model`'s adapters.
    Raises ValueError naming the flag to change when they are of another rank, alpha or set
    of target modules."""
    from safetensors.torch import load_file

    path = os.path.join(directory, ADAPTER_DIR)
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        saved = json.load(f)
    layers = adapted_layers(model)
    config = model.peft_config[ADAPTER_NAME]
    problems = []
    if saved.get("r") != config.r:
        problems.append(f"rank {saved.get('r')} (now --lora_rank={config.r})")
    if float(saved.get("lora_alpha", 0)) != float(config.lora_alpha):
        problems.append(f"alpha {saved.get('lora_alpha')} (now --lora_alpha={config.lora_alpha})")
    if set(saved.get("target_modules") or ()) != set(layers):
        problems.append("other target modules (--lora_target_modules): "
                        f"{sorted(set(saved.get('target_modules') or ()) ^ set(layers))[:6]}")
    if problems:
        raise ValueError(f"the adapters in {path} were trained with " + "; ".join(problems) +
                         ": resume with the LoRA flags of the run that wrote them")
    tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    expected = adapter_state_dict(model)
    if set(tensors) != set(expected):
        raise ValueError(f"{path}: adapter tensors {sorted(set(tensors) ^ set(expected))[:6]} "
                         "do not match the model's adapters")
    with torch.no_grad():
        for name, layer in layers.items():
            for kind in ("lora_A", "lora_B"):
                weight = getattr(layer, kind)[ADAPTER_NAME].weight
                saved_t = tensors[f"{PEFT_PREFIX}{name}.{kind}.weight"]
                if saved_t.shape != weight.shape:
                    raise ValueError(f"{path}: {name}.{kind} has shape {tuple(saved_t.shape)}, "
                                     f"the model's {tuple(weight.shape)}")
                weight.copy_(saved_t)


def check_merged_matches(model: torch.nn.Module, checkpoint: str, atol: float = 1e-5) -> None:
    """Raises ValueError when base + adapters of `model` do not give the merged weights saved
    in the model directory `checkpoint` (the base model is not the one the adapters were
    trained on)."""
    from safetensors import safe_open

    merged = merged_state_dict(model)
    targets = {f"{name}.weight" for name in adapted_layers(model)}
    files = [f for f in sorted(os.listdir(checkpoint)) if f.endswith(".safetensors")]
    checked = 0
    for file in files:
        with safe_open(os.path.join(checkpoint, file), framework="pt") as f:
            for key in set(f.keys()) & targets:
                saved = f.get_tensor(key)
                mine = merged[key].detach().to("cpu", saved.dtype)
                if saved.shape != mine.shape or not torch.allclose(mine, saved, rtol=1e-5,
                                                                   atol=atol):
                    raise ValueError(
                        f"base + adapters give other weights for {key} than the checkpoint "
                        f"{checkpoint} saved: --model is not the base model this run's adapters "
                        "were trained on; resume with the run's --model")
                checked += 1
    if not checked:
        raise ValueError(f"{checkpoint}: none of the adapted layers' merged weights is in its "
                         "safetensors files; it is not a checkpoint of this LoRA policy")


def prepare_learner_policy(policy: torch.nn.Module, spec: Optional[LoraSpec],
                           checkpoint: Optional[str], base_model: str = "") -> List[str]:
    """The learner's policy for `spec` (None: full fine-tuning), in place: adapters added and,
    resuming from `checkpoint`, loaded from it and checked against its merged weights (with
    LoRA `policy` must be the base model, `--model`, not the checkpoint's merged one). Raises
    ValueError when the checkpoint is of the other kind (LoRA vs full). Returns the adapted
    module names."""
    has_adapter = checkpoint is not None and os.path.isdir(os.path.join(checkpoint, ADAPTER_DIR))
    if spec is None:
        if has_adapter:
            raise ValueError(f"the checkpoint {checkpoint} was trained with LoRA adapters: "
                             "resume with the run's --lora_rank, --lora_alpha and "
                             "--lora_target_modules")
        return []
    if checkpoint is not None and not has_adapter:
        raise ValueError(f"--lora_rank={spec.rank} but the checkpoint {checkpoint} has no "
                         f"{ADAPTER_DIR}/ folder (it was trained without LoRA): resume with "
                         "--lora_rank=0")
    targets = add_adapters(policy, spec, base_model)
    if checkpoint is not None:
        load_adapter(policy, checkpoint)
        check_merged_matches(policy, checkpoint)
    return targets
