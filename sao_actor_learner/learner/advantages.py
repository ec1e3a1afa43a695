"""Advantage functions of the learner (docs/METHOD.md section 7), by name.

They live in `sao_actor_learner.learner_math`, the math the learner shares with `kernels/`
(whose `skip_observation_gae` runs the reference below on its torch backend); this module names
them for the learner's estimators: the length-adaptive lambda, skip-observation GAE, plain
token-level GAE (the ablation) and whitening. Pure functions on [B, T] tensors aligned to token
positions (see learner_math). No reverb, tensorflow or grpc here.
"""
from __future__ import annotations

from sao_actor_learner.learner_math import (Lambda, as_row_tensor, length_adaptive_lambda,
                                            masked_whiten, skip_observation_gae,
                                            token_level_gae)

__all__ = ["Lambda", "as_row_tensor", "length_adaptive_lambda", "masked_whiten",
           "skip_observation_gae", "token_level_gae"]
