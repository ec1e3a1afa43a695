"""Tokenizer, tiny-model factory and checkpoint I/O. Imports no reverb, tensorflow or grpc."""
from sao_actor_learner.models.checkpoint import (bytes_to_state_dict, check_compatible,
                                                 load_policy, save_checkpoint,
                                                 state_dict_to_bytes)
from sao_actor_learner.models.factory import KINDS, count_parameters, make_tiny_model
from sao_actor_learner.models.tokenizer import CharTokenizer, decode_until_eos

__all__ = [
    "CharTokenizer", "decode_until_eos", "KINDS", "make_tiny_model", "count_parameters",
    "save_checkpoint", "load_policy", "state_dict_to_bytes", "bytes_to_state_dict",
    "check_compatible",
]
