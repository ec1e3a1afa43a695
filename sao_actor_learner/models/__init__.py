"""Tokenizers, model directories, the tiny-model factory, the critic and checkpoint I/O.
Imports no reverb, tensorflow or grpc; the names below are imported on first use (PEP 562), so
`models.model_dir` (the launcher's pre-launch checks) loads no torch."""
import importlib

_NAMES = {
    "sao_actor_learner.models.checkpoint": (
        "bytes_to_state_dict", "check_compatible", "load_policy", "load_sync_state_dict",
        "load_tokenizer", "save_checkpoint", "state_dict_to_bytes", "sync_state_dict",
        "token_limit"),
    "sao_actor_learner.models.model_dir": ("ModelDirError", "check_model_dir"),
    "sao_actor_learner.models.factory": ("KINDS", "count_parameters", "make_tiny_model"),
    "sao_actor_learner.models.hf_tokenizer": ("HFTokenizer",),
    "sao_actor_learner.models.tokenizer": ("CharTokenizer", "decode_until_eos"),
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}


def __getattr__(attr: str):
    if attr in _MODULE_OF:
        return getattr(importlib.import_module(_MODULE_OF[attr]), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = sorted(_MODULE_OF)
