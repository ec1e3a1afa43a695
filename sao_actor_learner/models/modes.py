"""The module mode the learner's policy passes run in: training without dropout.

The learner's log-probs are importance ratios' numerators and denominators: the recomputed old
log-probs, the log-probs of the gradient pass, DIS's ratio against the rollout log-probs and the
drift metrics must all be of one deterministic function, the policy the actors sample from
(engines run it in eval mode). Dropout would make each pass a different random sub-network: at
lr ~ 0 the PPO ratio would not be 1. So every module is put in eval mode (nn.Dropout modules and
the attention implementations read their own module's `training` flag), except the layers
Hugging Face's gradient checkpointing gates on `training` (those with gradient checkpointing
switched on), which stay in train mode so their activations are still recomputed in the backward
pass; their children, where the dropout lives, stay in eval mode.
"""
from __future__ import annotations

from typing import List, Sequence

import torch


def checkpointed_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules of `model` whose gradient checkpointing is on (after Hugging Face's
    `gradient_checkpointing_enable`; none before): they checkpoint only in train mode."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]


def train_without_dropout(model: torch.nn.Module,
                          checkpointed: Sequence[torch.nn.Module] = ()) -> torch.nn.Module:
    """Puts `model` in the learner's mode (module docstring): eval mode but for the modules
    `checkpointed` (`checkpointed_layers(model)`, found once), which are set to train mode
    without their children. Returns `model`."""
    model.eval()
    for module in checkpointed:
        module.training = True
    return model
